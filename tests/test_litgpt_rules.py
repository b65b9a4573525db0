"""``model_code="litgpt"``: LitGPT's own model code (memguard_core/_litgpt.py) -- what it refuses,
its adapter count against the transformers path, its peak moments, the CLI flag, and the published
LitGPT CUDA rows it is scored on (bench/cuda_published.json; analytic, no GPU). What LitGPT's real
modules keep per block is checked against them in tests/test_litgpt_code.py."""

from __future__ import annotations

import json
import os

import pytest

from memguard_testing.bench_scripts import load_bench_script

from memguard_core.estimator import litgpt as _litgpt
from memguard_core.cli import main
from memguard_core.errors import ConfigError
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.trainable import trainable_param_count
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "bench", "cuda_published.json")


def _config(name: str) -> dict:
    with open(DATA) as f:
        models = json.load(f)["models"]
    return {k: v for k, v in models[name].items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def llama2():
    return model_spec_from_hf_config(_config("Llama-2-7b-hf"), name="Llama-2-7b-hf")


@pytest.fixture(scope="module")
def llama3():
    return model_spec_from_hf_config(_config("Meta-Llama-3-8B"), name="Meta-Llama-3-8B")


@pytest.fixture(scope="module")
def phi():
    return model_spec_from_hf_config(_config("phi-1_5"), name="phi-1_5")


def _ts(**kw) -> TrainSpec:
    base = dict(method="lora", model_code="litgpt", dtype="bf16", device="cuda", seq_length=512, batch_size=2,
                lora_dropout=0.05)
    base.update(kw)
    return TrainSpec(**base)


def test_model_code_is_validated():
    with pytest.raises(ConfigError) as e:
        TrainSpec(model_code="megatron")
    assert e.value.field == "model_code"
    assert TrainSpec(model_code="LitGPT").model_code == "litgpt"
    assert TrainSpec().model_code == "transformers"


@pytest.mark.parametrize("change, field", [
    (dict(method="full"), "method"),
    (dict(mixed_precision=True), "mixed_precision"),
    (dict(grad_checkpoint=True), "grad_checkpoint"),
    (dict(attn_impl="eager"), "attn_impl"),
    (dict(sharding="ddp", world_size=2), "sharding"),
    (dict(lora_targets=("o_proj",)), "lora_targets"),
    (dict(framework="mlx", device="mlx"), "framework"),
])
def test_settings_outside_the_rules_are_refused_by_name(llama2, change, field):
    with pytest.raises(ConfigError) as e:
        estimate(llama2, _ts(**change))
    assert e.value.field == field


def test_a_family_without_a_litgpt_block_is_refused():
    gpt2 = model_spec_from_hf_config(os.path.join(ROOT, "tests", "configs", "gpt2.json"))
    with pytest.raises(ConfigError) as e:
        estimate(gpt2, _ts())
    assert e.value.field == "model_code" and "gpt2" in str(e.value)


def test_lora_parts_read_litgpt_and_module_names():
    assert _litgpt.lora_parts(TrainSpec(model_code="litgpt")) == {"q", "v"}  # LitGPT's default
    assert _litgpt.lora_parts(_ts(lora_targets=("lora_query", "k_proj", "value"))) == {"q", "k", "v"}


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj")])
def test_adapter_count_equals_peft_on_separate_projections(llama3, targets):
    # LoRAQKVLinear's lora_A (r x parts, C) and lora_B (trained widths, r) hold what PEFT's per-projection
    # adapters hold: r x (C + width) each
    lit = _litgpt.trainable_params(llama3, _ts(lora_targets=targets, lora_rank=16))
    peft = trainable_param_count(llama3, TrainSpec(lora_targets=targets, lora_rank=16))
    assert lit == peft > 0


def test_adapters_and_their_states_are_in_the_weights_dtype(llama2):
    # PEFT upcasts adapters to fp32; LitGPT converts the whole module to bf16-true
    lit = estimate(llama2, _ts(lora_rank=64))
    n = lit.trainable_params
    assert lit.breakdown["optimizer_states"] == 2 * 2 * n
    hf = estimate(llama2, TrainSpec(method="lora", dtype="bf16", device="cuda", seq_length=512, batch_size=2,
                                    lora_rank=64))
    assert hf.breakdown["optimizer_states"] == 2 * 4 * n


def test_qlora_quantizes_the_head_too(phi):
    # Lightning's BitsandbytesPrecision swaps every nn.Linear, lm_head included (transformers skips it)
    lora = estimate(phi, _ts()).breakdown["weights"]
    qlora = estimate(phi, _ts(method="qlora", bnb_version="0.41.1", keeps_last_graph=False,
                              litgpt_version="0.4.13")).breakdown["weights"]
    head = phi.params.lm_head
    assert head > 0
    blocks_and_head = phi.params.attention + phi.params.mlp + head
    saved = lora - qlora
    assert saved == pytest.approx(blocks_and_head * (2 - 4.5 / 8), rel=1e-3)


def test_qlora_peaks_at_the_head_backward_and_with_a_kept_graph_in_the_next_forward(phi):
    old = estimate(phi, _ts(method="qlora", bnb_version="0.41.1", keeps_last_graph=False, seq_length=1044,
                            batch_size=1))
    assert any("4-bit head's backward" in n for n in old.notes)
    # the dequantized head: an fp16 copy cast to bf16, (2 + 2) x V x C
    assert old.breakdown["weight_copies"] == 4 * phi.vocab_size * phi.hidden_size
    kept = estimate(phi, _ts(method="qlora", bnb_version="0.42.0", seq_length=1044, batch_size=1,
                             litgpt_version="0.4.13"))
    assert any("next forward beside the kept graph" in n for n in kept.notes)
    assert kept.peak_bytes > old.peak_bytes
    lora = estimate(phi, _ts(seq_length=1044, batch_size=1, keeps_last_graph=False))
    assert any("first loss chunk's backward" in n for n in lora.notes)
    assert lora.breakdown["weight_copies"] == 0
    # a loop that keeps the last logits: at 2048 positions Fabric's fp32 copy beside the e-sized chunks and
    # the previous fp32 logits (4 + 2 + 4 bytes per logit) outweighs the loss chunk's backward (8 + 1/2)
    long_run = estimate(phi, _ts(seq_length=2048, batch_size=1))
    assert any("end of the forward" in n for n in long_run.notes)
    n = 2048 * phi.vocab_size
    assert long_run.breakdown["logits"] == 10 * n


def test_litgpt_counts_less_than_transformers_for_phi(phi):
    # transformers' Phi MLP runs gelu_new in Python (four saved tensors of the intermediate size) and
    # PEFT two fp32 dropouts; LitGPT's F.gelu keeps its input and one bf16 dropout serves the fused qkv
    ts = dict(method="lora", dtype="bf16", device="cuda", seq_length=1044, batch_size=4, lora_dropout=0.05)
    lit = estimate(phi, TrainSpec(model_code="litgpt", **ts))
    hf = estimate(phi, TrainSpec(lora_targets=("q_proj", "v_proj"), **ts))
    assert lit.breakdown["activations"] < 0.75 * hf.breakdown["activations"]


def test_cli_flag_estimates_and_says_the_default_targets(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_config("phi-1_5")))
    code = main(["estimate", "--config", str(cfg), "--model-code", "litgpt", "--device", "cuda", "--dtype", "bf16",
                 "--seq-length", "1044", "--lora-dropout", "0.05", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "query,value (LitGPT's finetune/lora.py default)" in err
    assert json.loads(out)["peak_bytes"] > 0
    given = json.loads(out)["peak_bytes"]
    # without --lora-dropout: LitGPT's own default (0.05), said on stderr, not PEFT's 0
    code = main(["estimate", "--config", str(cfg), "--model-code", "litgpt", "--device", "cuda", "--dtype", "bf16",
                 "--seq-length", "1044", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["peak_bytes"] == given and "--lora-dropout not given: 0.05" in err
    code = main(["estimate", "--config", str(cfg), "--model-code", "litgpt", "--device", "cuda", "--dtype", "bf16",
                 "--seq-length", "1044", "--lora-dropout", "0", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0 and json.loads(out)["peak_bytes"] < given
    code = main(["estimate", "--config", str(cfg), "--model-code", "litgpt", "--trace"])
    _, err = capsys.readouterr()
    assert code != 0 and "--trace" in err and "Traceback" not in err
    code = main(["estimate", "--config", str(cfg), "--model-code", "litgpt", "--lora-targets", "fc1"])
    _, err = capsys.readouterr()
    assert code != 0 and "--lora-targets" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["Llama-2-7b-hf", "phi-1_5", "stablelm-base-alpha-3b"])
def test_the_planner_keeps_litgpts_targets_and_offers_nothing_litgpt_lacks(name):
    from memguard_core.plan import _suggestions, plan

    ms = model_spec_from_hf_config(_config(name), name=name)
    ts = TrainSpec(method="lora", model_code="litgpt", dtype="bf16", device="cuda", seq_length=2048, batch_size=4)
    need = estimate(ms, ts).peak_bytes
    p = plan(ms, ts, int(need * 0.8), allow=("grad_checkpoint", "micro_batch", "seq_length", "lora_rank",
                                            "lora_layers"))
    assert {c.field for c in p.changes} & {"grad_checkpoint", "lora_layers"} == set()
    assert p.train_spec.batch_size * p.train_spec.grad_accum == 4
    assert _litgpt.lora_parts(p.train_spec) == {"q", "v"}  # LitGPT's default, not PEFT's for the model type
    offered = " ".join(_suggestions(ms, ts, ts, ("grad_checkpoint", "micro_batch")))
    assert "checkpointing" not in offered and "fewer layers" not in offered


def test_every_published_litgpt_row_is_in_the_band():
    # the published max_memory_allocated of LitGPT's own LoRA / QLoRA runs (bench/cuda_published.json):
    # the band, no constant fitted on them
    cp = load_bench_script("cuda_published")
    data = cp.load()
    rows = [r for r in cp.score(data) if r["source"].startswith("litgpt")]
    assert len(rows) >= 30
    bad = [(r["case"], round(r["error"] * 100, 1)) for r in rows if not r["within"]]
    assert not bad, bad


def test_current_litgpt_qlora_keeps_its_stable_embedding_gradient(llama3):
    # from LitGPT 0.5.0 on, finetune/lora.py swaps a trainable bitsandbytes StableEmbedding in after the
    # optimizer is built: a dense V x C gradient nobody clears, and the bottom block's input needs a gradient
    kw = dict(method="qlora", bnb_version="0.45.2", seq_length=512, batch_size=2)
    old = estimate(llama3, _ts(litgpt_version="0.4.13", **kw))
    new = estimate(llama3, _ts(**kw))  # None: the current LitGPT
    dense = llama3.vocab_size * llama3.hidden_size * 2
    assert new.phase_breakdowns["optimizer"]["gradients"] - old.phase_breakdowns["optimizer"]["gradients"] == dense
    assert new.phase_breakdowns["backward"]["backward_transients"] >= dense
    assert new.breakdown["activations"] > old.breakdown["activations"]
    # finetune/lora.py's main() keeps the replaced embedding in a local for the whole run
    assert new.breakdown["weights"] - old.breakdown["weights"] == dense
    assert any("StableEmbedding" in n for n in new.notes) and not any("StableEmbedding" in n for n in old.notes)
    assert estimate(llama3, _ts(litgpt_version="0.5.0")).peak_bytes == estimate(llama3, _ts()).peak_bytes  # LoRA: none
    with pytest.raises(ConfigError) as e:
        TrainSpec(model_code="litgpt", litgpt_version="latest")
    assert e.value.field == "litgpt_version"
