"""PEFT's ``lora_dropout``: what a LoRA'd linear keeps for its backward with p > 0 (the dropout's
output, saved by ``lora_A``, and the dropout's mask), checked against the tensors a real PEFT model
saves (``torch.autograd.graph.saved_tensors_hooks`` over one decoder block, parameters left out),
and read from where users set it (``LoraConfig``, ``--lora-dropout``)."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from memguard_core.estimator import activations as E  # noqa: E402
from memguard_core.errors import ConfigError  # noqa: E402
from memguard_torch.train_reading import method_and_lora  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_torch.module_spec import model_spec_from_module

TOKENS = 512


def _peft_llama(p: float, dtype, targets="all-linear"):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=640, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)
    cfg._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(LlamaForCausalLM(cfg).to(dtype),
                               LoraConfig(r=8, lora_alpha=16, lora_dropout=p, target_modules=targets))
    return model.train()


def _saved_per_token(model) -> float:
    """Bytes per token the second decoder block saves for the backward: unique storages packed by
    autograd inside its forward, parameters excluded (the first block's q/k/v inputs do not require
    grad, so its dropouts keep no mask: the second is a block as every later one)."""
    from memguard_torch.saved_census import saved_bytes_per_block

    layer = model.base_model.model.model.layers[1]
    ids = torch.randint(0, 1000, (1, TOKENS))
    saved = saved_bytes_per_block(lambda: model(input_ids=ids, labels=ids), [layer], exclude=list(model.parameters()))
    return saved[0] / TOKENS


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_block_estimate_matches_what_peft_saves_with_and_without_dropout(dtype, name):
    got = {}
    for p in (0.0, 0.1):
        model = _peft_llama(p, dtype)
        ms = model_spec_from_module(model)
        method, lora = method_and_lora(model, ms)
        assert method == "lora" and lora.get("lora_dropout", 0.0) == p   # read from the LoraConfig
        ts = TrainSpec(batch_size=1, seq_length=TOKENS, method="lora", lora_rank=8, lora_targets=("all-linear",),
                       lora_dropout=p, dtype=name)
        a = E.block_act_per_token_modules(ms, ts, lora=True, trainable_block=False)
        est = a.hidden + a.scores + a.lora
        measured = _saved_per_token(model)
        assert est == pytest.approx(measured, rel=0.04), (p, est, measured)
        got[p] = (est, measured)
    # the dropout's output and mask per LoRA'd linear: a block keeps ~1.5-1.7 x as much here
    assert got[0.1][1] > 1.4 * got[0.0][1]
    assert got[0.1][0] > 1.4 * got[0.0][0]


def test_cuda_keeps_a_one_byte_mask_not_the_noise():
    ms = model_spec_from_module(_peft_llama(0.0, torch.bfloat16))
    ts = TrainSpec(batch_size=1, seq_length=TOKENS, method="lora", lora_targets=("all-linear",), dtype="bf16")

    def block(t):
        a = E.block_act_per_token_modules(ms, t, lora=True, trainable_block=False)
        return a.hidden

    # all-linear on this block: six linears read 256 features, down_proj 640; each keeps an fp32
    # dropout output (4 B) and a mask: CPU the fp32 noise (4 B), CUDA native_dropout's bool (1 B)
    lora_in = 6 * 256 + 640
    cpu = block(ts.replace(lora_dropout=0.1)) - block(ts)
    cuda = block(ts.replace(lora_dropout=0.1, device="cuda")) - block(ts.replace(device="cuda"))
    assert cpu == 4 * lora_in
    assert cuda == 1 * lora_in


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), "0.1", True])
def test_lora_dropout_must_be_a_probability(bad):
    with pytest.raises(ConfigError, match="lora_dropout"):
        TrainSpec(lora_dropout=bad)


def test_cli_takes_lora_dropout(tmp_path, capsys):
    from memguard_core.cli import main

    args = ["estimate", "--model-params", "1.1e9", "--hidden-dim", "2048", "--num-layers", "22",
            "--num-heads", "32", "--num-kv-heads", "4", "--vocab-size", "32000", "--intermediate-size", "5632",
            "--seq-length", "1024", "--lora-targets", "all-linear", "--device", "cuda", "--json"]
    peaks = []
    for p in ("0", "0.05"):
        assert main(args + ["--lora-dropout", p]) == 0
        out = json.loads(capsys.readouterr().out)
        peaks.append(out["peak_bytes"])
        assert out["train"]["lora_dropout"] == float(p)
    assert peaks[1] > peaks[0]
    assert main([a for a in args if a != "--json"] + ["--lora-dropout", "0.05"]) == 0
    assert "dropout 0.05" in " ".join(capsys.readouterr().out.split())     # the table says what it counted
    assert main(args + ["--lora-dropout", "1.5"]) != 0
    assert "--lora-dropout" in capsys.readouterr().err
