"""Block kinds read from the model's own module tree (memguard_torch.block_kinds), the census of what a
block the rules do not model saves (memguard_torch.saved_census, memguard_hf.block_trace) and how the
estimate counts and names them (memguard_core.estimator.block_terms). Real transformers models built
from tiny configs; the census on fake tensors is checked against the same census on real tensors.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from memguard_core.estimator.estimate import estimate  # noqa: E402
from memguard_core.estimator.specs import BlockKind, TrainSpec, trace_key  # noqa: E402
from memguard_hf.block_trace import with_block_kinds  # noqa: E402
from memguard_hf.model_spec import model_spec_from_hf_config  # noqa: E402
from memguard_torch.block_kinds import block_kinds, find_blocks, with_live_block_kinds  # noqa: E402
from memguard_torch.saved_census import saved_bytes_per_block  # noqa: E402

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_HYBRID = dict(_TINY, model_type="granitemoehybrid", num_hidden_layers=4, shared_intermediate_size=128,
               num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
               mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=32,
               position_embedding_type="nope", layer_types=["mamba", "attention", "mamba", "mamba"])
_SHORT_CONV = dict(_TINY, model_type="lfm2", num_hidden_layers=4, block_ff_dim=128, block_auto_adjust_ff_dim=False,
                   layer_types=["conv", "full_attention", "conv", "full_attention"])


def _cfg(d: dict):
    d = dict(d)
    return AutoConfig.for_model(d.pop("model_type"), **d)


def _meta_model(d: dict):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_cfg(d))


@pytest.mark.parametrize("model_type,extra", [
    ("llama", dict(num_hidden_layers=2)),
    ("qwen2", dict(num_hidden_layers=2)),
    ("gemma2", dict(num_hidden_layers=2, head_dim=16)),
    ("mixtral", dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)),
    ("qwen2_moe", dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64)),
    ("phi3", dict(num_hidden_layers=2)),
    ("gpt_neox", dict(num_hidden_layers=2)),
    ("opt", dict(num_hidden_layers=2, ffn_dim=128, word_embed_proj_dim=64)),
    ("gpt2", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256)),
])
def test_families_the_rules_model_are_modelled(model_type, extra):
    d = dict(_TINY, **extra) if model_type != "gpt2" else dict(extra)
    model = _meta_model(dict(d, model_type=model_type))
    kinds, where = block_kinds(find_blocks(model))
    assert len(kinds) == 1 and kinds[0].modelled, kinds
    assert kinds[0].count == 2 and where[kinds[0].name] == [0, 1]


def test_hybrid_blocks_are_named_by_their_mixer():
    kinds, where = block_kinds(find_blocks(_meta_model(_HYBRID)))
    by = {k.name: k for k in kinds}
    assert by["GraniteMoeHybridMambaLayer"].count == 3 and not by["GraniteMoeHybridMambaLayer"].modelled
    assert where["GraniteMoeHybridMambaLayer"] == [0, 2, 3]
    assert by["GraniteMoeHybridDecoderLayer"].count == 1 and by["GraniteMoeHybridDecoderLayer"].modelled
    kinds, _ = block_kinds(find_blocks(_meta_model(_SHORT_CONV)))
    assert {(k.name, k.count, k.modelled) for k in kinds} == {("Lfm2ShortConv", 2, False),
                                                              ("Lfm2DecoderLayer", 2, True)}


def _lora_ts(seq: int = 64) -> TrainSpec:
    return TrainSpec(batch_size=1, seq_length=seq, method="lora", lora_rank=4, lora_targets=("all-linear",),
                     dtype="fp32")


def test_fake_census_equals_the_census_of_real_tensors():
    """The figure traced on fake tensors is what the same blocks save when the model runs for real."""
    ts = _lora_ts()
    ms = model_spec_from_hf_config(_HYBRID_CFG())
    traced = with_block_kinds(_HYBRID_CFG(), ms, ts)
    mamba = next(k for k in traced.block_kinds if not k.modelled)
    assert mamba.traced_under == trace_key(ts) and mamba.saved_per_token > 0

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(_HYBRID_CFG()),
                           LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    blocks = find_blocks(model)
    kinds, where = block_kinds(blocks)
    ids = torch.randint(0, 256, (1, ts.seq_length))
    per = saved_bytes_per_block(lambda: model(input_ids=ids), blocks,
                                exclude=list(model.parameters()) + list(model.buffers()))
    real = sum(per[i] for i in where[mamba.name]) / (mamba.count * ts.seq_length)
    assert real == pytest.approx(mamba.saved_per_token, rel=1e-9)
    # the lowest Mamba block takes the embeddings' output, which needs no gradient under LoRA, yet
    # its adapters' inputs are saved: every block saves something
    assert all(per[i] > 0 for i in range(len(blocks)))


def _HYBRID_CFG():
    return _cfg(_HYBRID)


def test_estimate_counts_traced_blocks_and_names_them():
    ts = _lora_ts(128)
    ms = model_spec_from_hf_config(_HYBRID_CFG())
    traced = with_block_kinds(_HYBRID_CFG(), ms, ts)
    mamba = next(k for k in traced.block_kinds if not k.modelled)
    plain = estimate(ms, ts)
    est = estimate(traced, ts)
    rules_share = plain.breakdown["activations"]
    # three of four blocks leave the rules; their census figure comes in
    assert est.breakdown["activations"] != rules_share
    assert any(n.startswith(f"traced: {mamba.name} x 3") for n in est.notes)
    kinds = est.to_dict()["block_kinds"]
    assert {(k["name"], k["count"], k["counted"]) for k in kinds} == {
        (mamba.name, 3, "traced"), ("GraniteMoeHybridDecoderLayer", 1, "rules")}
    # twice the rows: the traced blocks' share doubles with the rest of the activations
    est2 = estimate(traced, ts.replace(batch_size=2))
    added = 3 * mamba.saved_per_token * ts.seq_length
    assert est2.phase_breakdowns["loss"]["activations"] - est.phase_breakdowns["loss"]["activations"] == \
        pytest.approx(est.phase_breakdowns["loss"]["activations"], rel=0.02)
    assert added > 0


def test_untraced_kind_is_named_not_zero():
    ms = model_spec_from_hf_config(_HYBRID_CFG())
    ts = _lora_ts()
    ms = ms.replace(block_kinds=(BlockKind("SomeMixer", 3, modelled=False), BlockKind("Layer", 1)))
    est = estimate(ms, ts)
    assert est.breakdown == estimate(ms.replace(block_kinds=()), ts).breakdown  # counted as rule blocks
    assert any(n.startswith("not modelled, not traced: SomeMixer x 3") for n in est.notes)


def test_a_figure_counts_only_under_the_framework_that_took_it():
    """A census figure of PyTorch's code is not used under mlx_lm, and an MLX measurement (its
    ``traced_under`` ends in ``mlx``) is not used under PyTorch; each is named where it counts."""
    from memguard_core.estimator.block_terms import block_kind_notes, how_counted

    torch_kind = BlockKind("SomeMixer", 3, modelled=False, saved_per_token=4096.0, traced_under="fp32 lora sdpa cpu")
    mlx_kind = BlockKind("ShortConv", 3, modelled=False, saved_per_token=4096.0, traced_under="fp32 lora mlx")
    torch_ts, mlx_ts = _lora_ts(), TrainSpec(framework="mlx", device="mlx", method="lora", seq_length=64)
    assert how_counted(torch_kind, torch_ts) == "traced" and how_counted(mlx_kind, mlx_ts) == "traced"
    assert how_counted(torch_kind, mlx_ts) == how_counted(mlx_kind, torch_ts) == "rules (not modelled, not traced)"
    assert how_counted(BlockKind("Layer", 1), torch_ts) == "rules"
    ms = model_spec_from_hf_config(_HYBRID_CFG())
    note = block_kind_notes(ms.replace(block_kinds=(mlx_kind,)), mlx_ts)[0]
    assert note.startswith("traced: ShortConv x 3 (4.0 KiB saved per token per block") and "MLX" in note
    note = block_kind_notes(ms.replace(block_kinds=(mlx_kind,)), torch_ts)[0]
    assert note.startswith("not modelled, not traced: ShortConv x 3")
    # under PyTorch the MLX figure leaves the blocks counted by the rules
    ts = _lora_ts()
    assert estimate(ms.replace(block_kinds=(mlx_kind, BlockKind("Layer", 1))), ts).breakdown == \
        estimate(ms.replace(block_kinds=()), ts).breakdown


def test_checkpointing_keeps_block_inputs_and_recomputes_the_largest_block():
    ts = _lora_ts(128).replace(grad_checkpoint=True)
    ms = model_spec_from_hf_config(_HYBRID_CFG())
    big = BlockKind("BigMixer", 3, modelled=False, saved_per_token=1 << 20, traced_under=trace_key(ts))
    est = estimate(ms.replace(block_kinds=(big, BlockKind("Layer", 1))), ts)
    base = estimate(ms, ts)
    # the recomputed block is a traced one (1 MiB per token), the kept inputs are the rules'
    assert est.phases["backward"] - base.phases["backward"] >= (
        (1 << 20) * 128 - base.phase_breakdowns["backward"]["activations"])
    assert any("traced: BigMixer x 3" in n for n in est.notes)


def test_live_module_reading_traces_through_its_config():
    cfg = _HYBRID_CFG()
    model = AutoModelForCausalLM.from_config(cfg)
    from memguard_torch.module_spec import model_spec_from_module

    ms = model_spec_from_module(model)
    ts = _lora_ts()
    out = with_live_block_kinds(model, ms, ts)
    assert {k.name for k in out.block_kinds if k.saved_per_token} == {"GraniteMoeHybridMambaLayer"}
    # a module tree without a config: kinds named, nothing traced
    model.config = None
    out = with_live_block_kinds(model, ms, ts)
    assert [k.saved_per_token for k in out.block_kinds if not k.modelled] == [None]


def test_cli_json_lists_block_kinds(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(dict(_HYBRID, architectures=["GraniteMoeHybridForCausalLM"])))
    r = subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", "--config", str(p), "--method",
                        "lora", "--lora-targets", "all-linear", "--dtype", "fp32", "--seq-length", "64",
                        "--device", "cpu", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    kinds = {k["name"]: k for k in out["block_kinds"]}
    assert kinds["GraniteMoeHybridMambaLayer"]["counted"] == "traced"
    assert kinds["GraniteMoeHybridMambaLayer"]["saved_bytes_per_token"] > 0
    assert any(n.startswith("traced: GraniteMoeHybridMambaLayer x 3") for n in out["notes"])
