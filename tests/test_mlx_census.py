"""The measured saved-activation figure of an mlx_lm block kind the rules do not model
(memguard_mlx.block_census), on real mlx_lm models from small ModelArgs, real MLX (CPU backend):
checked against whole-model value_and_grad peaks and against the Llama rule; and the MLX estimate
counting the measured kind in place of the rules' figure."""

from __future__ import annotations

import gc
import importlib

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_core.estimator import mlx as mlx_rules  # noqa: E402
from memguard_core.estimator.specs import TrainSpec  # noqa: E402
from memguard_mlx.block_census import block_saved_per_token, with_measured_blocks  # noqa: E402
from memguard_mlx.specs import model_spec_from_mlx_module  # noqa: E402

_BASE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, rms_norm_eps=1e-5)


def _model(model_type: str, **kw):
    mod = importlib.import_module(f"mlx_lm.models.{model_type}")
    mx.random.seed(0)
    m = mod.Model(mod.ModelArgs.from_dict(dict(model_type=model_type, **kw)))
    mx.eval(m.parameters())
    return m


def _lfm2(layers: int, attn=(0,)):
    return _model("lfm2", **dict(_BASE, num_hidden_layers=layers, max_position_embeddings=512, norm_eps=1e-5,
                                 conv_bias=False, conv_L_cache=3, block_dim=128, block_ff_dim=256,
                                 block_multiple_of=32, block_ffn_dim_multiplier=1.0,
                                 block_auto_adjust_ff_dim=False, full_attn_idxs=list(attn), rope_theta=10000.0,
                                 tie_embedding=True))


def _model_peak(model, tokens: int) -> int:
    """Synchronous peak (bytes above what was held) of the model's loss and gradients over its
    trainable arrays, at 1 x ``tokens``: the median of three readings after a warm-up."""
    import mlx.nn as nn

    x = mx.random.randint(0, 256, (1, tokens + 1))
    mx.eval(x)

    def loss(m, batch):
        logits = m(batch[:, :-1])
        return nn.losses.cross_entropy(logits, batch[:, 1:]).mean()

    def once() -> int:
        gc.collect()
        mx.synchronize()  # the worker thread frees the previous evaluation's arrays as it finishes
        mx.clear_cache()
        base = int(mx.get_active_memory())
        mx.reset_peak_memory()
        out = nn.value_and_grad(model, loss)(model, x)
        mx.eval(out)
        peak = int(mx.get_peak_memory()) - base
        del out
        return peak

    old = mx.set_memory_limit(1)
    try:
        # readings vary by whole arrays with the order the CPU backend frees them in (more so on a
        # loaded host): a warm-up at the shape, then the median of three, as the census reads its own
        return sorted([once() for _ in range(4)][1:])[1]
    finally:
        mx.set_memory_limit(old)


def test_measured_short_convolution_block_matches_whole_model_peaks():
    """The census of one ShortConv block (128 / 512 tokens) against the per-block, per-token slope of
    whole lfm2 models (one attention block and 2 / 4 conv blocks, 192 / 384 tokens): the extra
    blocks' parameters and gradients do not depend on the tokens, so the slope difference is 2
    blocks' saved arrays."""
    small, large = _lfm2(3), _lfm2(5)
    for m in (small, large):
        m.freeze()
        for layer in m.layers:
            layer.unfreeze()
    per = block_saved_per_token(large.layers[1], 128)
    t1, t2 = 192, 384
    slope = ((_model_peak(large, t2) - _model_peak(small, t2)) - (_model_peak(large, t1) - _model_peak(small, t1)))
    per_model = slope / (t2 - t1) / 2
    assert per > 0
    assert per == pytest.approx(per_model, rel=0.15), (per, per_model)


def test_measured_llama_block_agrees_with_the_llama_rule():
    """The rules' per-block saved arrays of an mlx_lm Llama block (fp32: 4 (4h + 2q + 2kv + 5i) +
    softmax output) were fitted on whole runs; the census of one block measures the same set."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    m = _model("llama", **dict(_BASE, num_hidden_layers=2))
    m.freeze()
    linear_to_lora_layers(m, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    h, i, hd = 128, 256, 32
    t1, t2 = 128, 512
    per = block_saved_per_token(m.layers[0], h, tokens=(t1, t2))
    rule = 4 * (4 * h + 2 * 4 * hd + 2 * 2 * hd + 5 * i)
    # the softmax output (heads x t x t x 4 bytes) is quadratic in the tokens: its slope between t1
    # and t2 is heads x 4 x (t1 + t2) per token
    scores = 4 * 4 * (t1 + t2)
    assert per == pytest.approx(rule + scores, rel=0.2), (per, rule + scores)


def test_census_bad_tokens_is_a_config_error():
    m = _lfm2(2)
    with pytest.raises(ConfigError, match="tokens"):
        block_saved_per_token(m.layers[1], 128, tokens=(64, 32))


def test_estimate_counts_the_measured_kind_in_place_of_the_rules():
    """A hybrid (ShortConv blocks and attention blocks): with the census the MLX estimate's blocks
    term holds the rule blocks' share plus the measured ShortConv blocks; a PyTorch census figure
    (traced under another device) is not used under MLX."""
    import dataclasses

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
    m = _model("llama", **dict(_BASE, num_hidden_layers=2))
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

    m = _model("llama", **dict(_BASE, num_hidden_layers=1))
    m.set_dtype(mx.float16)
    nn.quantize(m, group_size=64, bits=4)
    block = m.layers[0]
    dtypes = [v.dtype for _, v in tree_flatten(block.parameters())]
    assert mx.uint32 in dtypes and dtypes[0] == mx.uint32  # the case the fall-back got wrong
    assert _floating_dtype(block) == mx.float16
