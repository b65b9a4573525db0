"""The measured saved-activation figure of an mlx_lm block kind the rules do not model
(memguard_mlx.block_census), on real mlx_lm models from small ModelArgs, real MLX (CPU backend):
checked against whole-model value_and_grad peaks and against the Llama rule. These compare peak
readings, which move by whole arrays beside another worker's load, so the file runs in the serial
part (Makefile ``SERIAL``); what reads no figure against another is in test_mlx_census_rules.py."""

from __future__ import annotations

import gc

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from memguard_mlx.block_census import block_saved_per_token  # noqa: E402
from memguard_testing.mlx_tiny import CENSUS_DIMS, lfm2_model as _lfm2, mlx_lm_model as _model  # noqa: E402


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

    m = _model("llama", **dict(CENSUS_DIMS, num_hidden_layers=2))
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
