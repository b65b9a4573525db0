"""The census of mlx_lm block kinds the rules do not model (memguard_mlx.block_census), on real
mlx_lm models from small ModelArgs, real MLX (CPU backend): how the MLX estimate counts a measured
kind in place of the rules' figure, the census's time limit, its bad input, the live block left
intact after an error, the dtype of a quantized block, and which norms count. Nothing here compares
one peak reading with another, so it runs beside the other worker (test_mlx_census.py's
comparisons run in the serial part)."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.estimator import mlx as mlx_rules  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_mlx.block_census import block_saved_per_token, with_measured_blocks  # noqa: E402
from memguard_mlx.specs import model_spec_from_mlx_module  # noqa: E402
from memguard_testing.mlx_tiny import CENSUS_DIMS, lfm2_model as _lfm2, mlx_lm_model as _model  # noqa: E402


def test_census_bad_tokens_is_a_config_error():
    m = _lfm2(2)
    with pytest.raises(ConfigError, match="tokens"):
        block_saved_per_token(m.layers[1], 128, tokens=(64, 32))


def test_estimate_counts_the_measured_kind_in_place_of_the_rules(monkeypatch):
    """A hybrid (ShortConv blocks and attention blocks): with the census the MLX estimate's blocks
    term holds the rule blocks' share plus the measured ShortConv blocks; a PyTorch census figure
    (traced under another device) is not used under MLX. The census's time limit is raised here: the
    census's wall time follows the host's load, and the limit is the subject of
    test_census_past_its_time_limit_leaves_kinds_to_the_rules, not of this test."""
    import dataclasses

    from memguard_mlx import block_census

    monkeypatch.setattr(block_census, "CENSUS_TIME_LIMIT_S", 600.0)

    m = _lfm2(4, attn=(1, 3))
    m.freeze()
    for layer in m.layers:
        layer.unfreeze()
    ms = model_spec_from_mlx_module(m)
    ts = TrainSpec(framework="mlx", device="mlx", method="full", dtype="fp32", seq_length=128, batch_size=2,
                   optimizer="adamw")
    measured = with_measured_blocks(m, ms, ts)
    kinds = {k.name: k for k in measured.block_kinds}
    conv = kinds["ShortConv"]
    assert conv.saved_per_token and conv.saved_per_token > 0 and conv.traced_under.endswith(" mlx")
    assert kinds["Lfm2DecoderLayer"].saved_per_token is None  # modelled: the rules count it
    rule_blocks, rule_scores = mlx_rules.mlx_activations(ms, ts)[:2]
    blocks, scores = mlx_rules.mlx_activations(measured, ts)[:2]
    tokens = 2 * 128
    assert blocks == pytest.approx(rule_blocks / 2 + 2 * conv.saved_per_token * tokens, rel=1e-6)
    one_block_probs = 4 * 4 * 128 * tokens  # e x heads x seq per token: the rules' softmax output of a block
    assert scores == rule_scores - 2 * one_block_probs  # the measured blocks' own scores are in their figure
    torch_traced = dataclasses.replace(ms, block_kinds=tuple(
        dataclasses.replace(k, saved_per_token=1e6, traced_under="fp32 full sdpa cuda") if not k.modelled else k
        for k in ms.block_kinds))
    assert mlx_rules.mlx_activations(torch_traced, ts)[:2] == (rule_blocks, rule_scores)


def test_all_modelled_model_is_left_as_is():
    m = _model("llama", **dict(CENSUS_DIMS, num_hidden_layers=2))
    ms = model_spec_from_mlx_module(m)
    ts = TrainSpec(framework="mlx", device="mlx", method="full", dtype="fp32", seq_length=64)
    assert with_measured_blocks(m, ms, ts) is ms


def test_layernorm_biases_are_not_counted_as_extra_norm_inputs():
    """StarCoder2 and StableLM blocks hold two LayerNorms with a bias each: the biases are
    parameters of the same two norms, not further norm inputs, so nothing is added to the Llama
    layout there (and the parameter count still holds them); Gemma-3's sandwich norms and q/k norms
    are."""
    h, layers = 128, 2
    sc2 = model_spec_from_mlx_module(_model("starcoder2", hidden_size=h, num_hidden_layers=layers,
                                            intermediate_size=256, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=256))
    slm = model_spec_from_mlx_module(_model("stablelm", vocab_size=256, hidden_size=h, num_attention_heads=4,
                                            num_hidden_layers=layers, num_key_value_heads=2,
                                            intermediate_size=256, rope_theta=10000.0, use_qkv_bias=False,
                                            partial_rotary_factor=0.25, layer_norm_eps=1e-5))
    for ms in (sc2, slm):
        assert ms.params.norms_in_blocks == layers * 2 * 2 * h  # two norms, weight and bias each
        assert mlx_rules.extra_norm_inputs(ms) == 0, ms.model_type
    g3 = model_spec_from_mlx_module(_model("gemma3_text", hidden_size=h, num_hidden_layers=layers,
                                           intermediate_size=256, num_attention_heads=4, head_dim=32,
                                           num_key_value_heads=2, vocab_size=256, sliding_window=64))
    # two sandwich norms beyond the Llama pair, plus q (4 x 32) and k (2 x 32) ahead of q/k norms
    assert mlx_rules.extra_norm_inputs(g3) == 2 * h + 4 * 32 + 2 * 32


def test_census_past_its_time_limit_leaves_kinds_to_the_rules(monkeypatch, caplog):
    """With the limit already spent the ShortConv kind is not measured (counted by the rules, a
    warning says why); within it the figure is logged with the seconds it took."""
    import logging

    from memguard_mlx import block_census

    m = _lfm2(4, attn=(1, 3))
    ms = model_spec_from_mlx_module(m)
    ts = TrainSpec(framework="mlx", device="mlx", method="full", dtype="fp32", seq_length=64)
    monkeypatch.setattr(block_census, "_CACHE", {})
    monkeypatch.setattr(block_census, "CENSUS_TIME_LIMIT_S", 0.0)
    with caplog.at_level(logging.INFO, logger="memguard.mlx"):
        out = with_measured_blocks(m, ms, ts, tokens=(32, 64))
    assert all(k.saved_per_token is None for k in out.block_kinds)
    assert any("limit" in r.getMessage() and "ShortConv" in r.getMessage() for r in caplog.records)
    with pytest.raises(block_census.CensusTimeout):
        block_saved_per_token(m.layers[0], 128, tokens=(32, 64), deadline=0.0)
    monkeypatch.setattr(block_census, "CENSUS_TIME_LIMIT_S", 30.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memguard.mlx"):
        out = with_measured_blocks(m, ms, ts, tokens=(32, 64))
    conv = {k.name: k for k in out.block_kinds}["ShortConv"]
    assert conv.saved_per_token is not None and conv.traced_under.endswith(" mlx")
    msgs = [r.getMessage() for r in caplog.records if "measured ShortConv" in r.getMessage()]
    assert msgs and msgs[0].rstrip().endswith(" s)")


def test_peak_reading_restores_the_live_block_on_an_error():
    """An error inside value_and_grad leaves the live block holding its own arrays, not the
    tracers the loss put into it."""
    from mlx.utils import tree_flatten

    from memguard_mlx.block_census import _peak_of

    block = _lfm2(2).layers[0]
    before = {k: id(v) for k, v in tree_flatten(block.trainable_parameters())}

    def failing(y):
        block(y, None)
        raise ValueError("boom")

    x = mx.zeros((1, 8, 128))
    with pytest.raises(ValueError, match="boom"):
        _peak_of(block, failing, x, 1)
    after = {k: id(v) for k, v in tree_flatten(block.trainable_parameters())}
    assert after == before
    mx.eval(block(x, None))  # still usable outside a transform


def test_quantized_block_is_measured_at_its_floating_dtype():
    """A quantized block's first parameter is a packed uint32 weight: the input dtype comes from
    its floating arrays (fp16 here: norm weights, scales), not a fall-back to fp32."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from memguard_mlx.block_census import _floating_dtype

    m = _model("llama", **dict(CENSUS_DIMS, num_hidden_layers=1))
    m.set_dtype(mx.float16)
    nn.quantize(m, group_size=64, bits=4)
    block = m.layers[0]
    dtypes = [v.dtype for _, v in tree_flatten(block.parameters())]
    assert mx.uint32 in dtypes and dtypes[0] == mx.uint32  # the case the fall-back got wrong
    assert _floating_dtype(block) == mx.float16
