"""Block kinds of mlx_lm models (memguard_mlx.block_kinds): the families the rules model read as
modelled; a hybrid's short-convolution blocks are named, and the MLX estimate says they were counted
as rule blocks (the census runs PyTorch's code). Real mlx_lm models from tiny ModelArgs."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from memguard_core.estimator.estimate import estimate  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_mlx.block_kinds import block_kinds  # noqa: E402
from memguard_mlx.specs import model_spec_from_mlx_module  # noqa: E402
from memguard_testing.mlx_tiny import CENSUS_DIMS, lfm2_model, mlx_lm_model  # noqa: E402

_BASE = dict(CENSUS_DIMS, num_hidden_layers=4)


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("qwen2", {}),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_rule_families_are_modelled(model_type, extra):
    kinds = block_kinds(mlx_lm_model(model_type, **_BASE, **extra))
    assert len(kinds) == 1 and kinds[0].modelled and kinds[0].count == 4


def test_short_convolution_blocks_are_named_and_not_silent():
    model = lfm2_model(4, attn=(1, 3))
    kinds = {k.name: k for k in block_kinds(model)}
    assert kinds["ShortConv"].count == 2 and not kinds["ShortConv"].modelled
    assert kinds["Lfm2DecoderLayer"].count == 2 and kinds["Lfm2DecoderLayer"].modelled
    ms = model_spec_from_mlx_module(model)
    assert {k.name for k in ms.block_kinds} == {"ShortConv", "Lfm2DecoderLayer"}
    est = estimate(ms, TrainSpec(framework="mlx", device="mlx", method="lora", dtype="fp32", seq_length=64,
                                 lora_targets=("all-linear",)))
    assert any(n.startswith("not modelled, not traced: ShortConv x 2") and "MLX" in n for n in est.notes)
    assert est.to_dict()["block_kinds"][0]["counted"] == "rules (not modelled, not traced)"


def test_a_recorded_mlx_spec_reads_back_to_the_same_estimate():
    """The bench's children record ``dataclasses.asdict`` of the spec they measured and the parent
    scores that record (``memguard_bench.score.model_spec_from_dict``): a live mlx_lm model's
    counts (``MlxParamCounts``, with the norm weights apart) must read back whole."""
    import dataclasses

    from memguard_bench.score import model_spec_from_dict

    ms = model_spec_from_mlx_module(mlx_lm_model("llama", **_BASE))
    back = model_spec_from_dict(dataclasses.asdict(ms))
    assert type(back.params) is type(ms.params) and back.params == ms.params
    ts = TrainSpec(framework="mlx", device="mlx", method="lora", dtype="fp32", seq_length=64,
                   lora_targets=("all-linear",))
    assert estimate(back, ts).peak_bytes == estimate(ms, ts).peak_bytes
