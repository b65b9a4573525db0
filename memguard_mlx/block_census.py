"""A measured saved-activation figure for an mlx_lm block kind the rules do not model: the MLX
analogue of the PyTorch census (``memguard_torch.saved_census`` / ``memguard_hf.block_trace``).

MLX has no saved-tensor hooks; what a VJP keeps is whatever the lazy graph still references when the
backward starts (``mlx/transforms.cpp`` ``vjp``). So ONE live block of the model is run on the real
MLX backend, as the training step runs it (``mx.value_and_grad`` over its trainable arrays and its
input), once applied once and once applied twice in a row: the second application's extra peak is
what one block keeps for its backward (its own input included, as the next block of a model keeps
the previous block's output). Two token counts give the per-token slope; evaluation is made
synchronous for the measurement (``mx.set_memory_limit(1)``: the eval loop waits for every task,
``mlx/transforms.cpp`` ``eval_impl``), each reading after a warm-up at the same shape, so the figure does not carry the asynchronous window, which
the estimate counts once for the step. The figure is cached per block class, parameter shapes,
trainable arrays and dtype. docs/mlx.md, "Measured block kinds".

mlx is imported only inside functions.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from memguard_core.errors import ConfigError
from memguard_core.estimator.specs import ModelSpec, TrainSpec, trace_key

logger = logging.getLogger("memguard.mlx")

__all__ = ["CENSUS_TIME_LIMIT_S", "CensusTimeout", "block_saved_per_token", "with_measured_blocks"]

_CACHE: Dict[Tuple, float] = {}

# Wall-clock cap on the whole census of one preflight, seconds. The census runs ahead of the user's
# training and only refines the rules' figure for kinds they do not model, so it must not hold the
# start of a run longer than a small share of loading the model; each kind costs 16 evaluations of
# one block (2 token counts x 2 application counts x (1 warm-up + 3 readings)), which grows with the
# block's width and the token counts, so a cap is kept rather than a count of kinds. Past it the
# remaining kinds are counted by the rules (logged).
CENSUS_TIME_LIMIT_S = 30.0


class CensusTimeout(RuntimeError):
    """The census passed its wall-clock limit (:data:`CENSUS_TIME_LIMIT_S`) before a figure was read."""


def _call(block: Any) -> Callable:
    """The block's forward on a (1, tokens, hidden) input: mlx_lm blocks take ``(x, mask, cache)``
    (a ``None`` mask: the CPU attention fallback's score arrays are those of the causal mask) or
    ``(x)`` alone."""
    def with_mask(x):
        return block(x, None)

    def bare(x):
        return block(x)

    return with_mask, bare


def _key(block: Any, dtype: Any, tokens: Sequence[int]) -> Tuple:
    from mlx.utils import tree_flatten

    shapes = tuple((k, tuple(v.shape), str(v.dtype)) for k, v in tree_flatten(block.parameters()))
    trained = tuple(k for k, _ in tree_flatten(block.trainable_parameters()))
    return type(block).__name__, shapes, trained, str(dtype), tuple(tokens)


def _peak_of(block: Any, fwd: Callable, x: Any, reps: int) -> int:
    """Peak bytes above the arrays held before, of evaluating the loss and the gradients of ``reps``
    applications of ``block`` (its trainable arrays and the input)."""
    import mlx.core as mx

    from mlx.utils import tree_flatten, tree_unflatten

    params = block.trainable_parameters()
    # the block's own arrays, held apart from ``params``: value_and_grad puts its tracers into the
    # tree it is given, and an error inside it need not swap them back
    own = tree_flatten(params)

    def loss(p, inp):
        block.update(p)
        y = inp
        for _ in range(reps):
            y = fwd(y)
        return y.astype(mx.float32).sum()

    gc.collect()
    mx.synchronize()  # the worker thread frees the previous evaluation's arrays as it finishes
    mx.clear_cache()
    base = int(mx.get_active_memory())
    mx.reset_peak_memory()
    try:
        out = mx.value_and_grad(loss, argnums=(0, 1))(params, x)
        mx.eval(out)
        peak = int(mx.get_peak_memory()) - base
        del out
    finally:
        # the traced loss put tracer arrays into the live block: put its own arrays back
        # whether or not the evaluation raised
        block.update(tree_unflatten(own))
    return peak


def _floating_dtype(block: Any) -> Any:
    """The dtype of the block's first floating parameter (a quantized block's linear weights are
    packed ``uint32``; its norm weights and quantization scales carry the compute dtype), fp32 when
    it has none."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, v in tree_flatten(block.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype
    return mx.float32


def block_saved_per_token(block: Any, hidden_size: int, dtype: Any = None,
                          tokens: Sequence[int] = (128, 512), deadline: Optional[float] = None) -> float:
    """Bytes ONE application of ``block`` keeps for its backward per token, measured on the MLX
    backend (see the module docstring): ``(saved(t2) - saved(t1)) / (t2 - t1)`` with
    ``saved(t) = peak(2 applications, t) - peak(1 application, t)``.

    Args:
        block: a live block of an mlx_lm model's ``layers`` (LoRA-wrapped / frozen as it trains).
        hidden_size: the width of its (1, tokens, hidden) input.
        dtype: the input's ``mx.Dtype`` (default: the dtype of the block's first floating
            parameter -- norm weight or quantization scales of a quantized block -- else fp32).
        tokens: two token counts, the smaller first.
        deadline: a ``time.monotonic()`` instant past which no further reading is taken
            (``None``: no limit).

    Returns:
        Bytes per token (float; >= 0). Cached per block class, parameter shapes, trainable arrays,
        dtype and token counts.

    Raises:
        ConfigError: ``tokens`` is not two increasing positive counts, ``hidden_size`` < 1, or the
            block cannot be called as ``block(x, mask)`` or ``block(x)``.
        CensusTimeout: ``deadline`` passed before the figure was read (nothing is cached).
    """
    import mlx.core as mx

    if len(tokens) != 2 or not (0 < int(tokens[0]) < int(tokens[1])):
        raise ConfigError("tokens", "two increasing positive token counts", tokens)
    if int(hidden_size) < 1:
        raise ConfigError("hidden_size", "a positive integer", hidden_size)
    if dtype is None:
        dtype = _floating_dtype(block)
    key = _key(block, dtype, tokens)
    if key in _CACHE:
        return _CACHE[key]
    if deadline is not None and time.monotonic() > deadline:
        raise CensusTimeout(f"over the census limit of {CENSUS_TIME_LIMIT_S:.0f} s")
    fwd = None
    probe = mx.zeros((1, int(tokens[0]), int(hidden_size)), dtype=dtype)
    for f in _call(block):
        try:
            mx.eval(f(probe))
            fwd = f
            break
        except (TypeError, ValueError):
            continue
    if fwd is None:
        raise ConfigError("block", "an mlx_lm block callable as block(x, mask) or block(x)", type(block).__name__)
    old = mx.set_memory_limit(1)  # synchronous evaluation: no asynchronous window in the figure
    try:
        saved = []
        for t in tokens:
            x = mx.random.normal((1, int(t), int(hidden_size))).astype(dtype)
            mx.eval(x)
            # the first evaluation at a shape also allocates what later ones reuse (compiled
            # kernels' buffers), and readings vary by whole arrays either way with the order the
            # CPU backend frees them in: one warm-up, then the median of five
            peaks = {}
            for reps in (1, 2):
                readings = []
                for _ in range(6):  # the first is the warm-up
                    if deadline is not None and time.monotonic() > deadline:
                        raise CensusTimeout(f"over the census limit of {CENSUS_TIME_LIMIT_S:.0f} s")
                    readings.append(_peak_of(block, fwd, x, reps))
                peaks[reps] = sorted(readings[1:])[2]
            saved.append(peaks[2] - peaks[1])
    finally:
        mx.set_memory_limit(old)
    slope = max(0.0, (saved[1] - saved[0]) / float(tokens[1] - tokens[0]))
    _CACHE[key] = slope
    return slope


def with_measured_blocks(model: Any, ms: ModelSpec, ts: TrainSpec, tokens: Sequence[int] = (128, 512)) -> ModelSpec:
    """``ms`` with ``saved_per_token`` / ``traced_under`` set on every block kind the rules do not
    model, measured on the first block of that kind in ``model.layers``
    (:func:`block_saved_per_token`). A kind that cannot be measured keeps ``saved_per_token=None``
    (the failure is logged; never raises: the estimate then counts it as a rule block and says so).
    Each figure is logged with the seconds it took; once the census has run
    :data:`CENSUS_TIME_LIMIT_S` the kinds not yet measured are left to the rules (logged).
    """
    try:
        from .block_kinds import kind_of

        if not any(not k.modelled for k in ms.block_kinds):
            return ms
        first: Dict[str, Any] = {}
        for b in model.layers:
            first.setdefault(kind_of(b), b)
        kinds = []
        start = time.monotonic()
        deadline = start + CENSUS_TIME_LIMIT_S
        for k in ms.block_kinds:
            if k.modelled or k.name not in first:
                kinds.append(k)
                continue
            t0 = time.monotonic()
            try:
                per = block_saved_per_token(first[k.name], ms.hidden_size, tokens=tokens, deadline=deadline)
                kinds.append(dataclasses.replace(k, saved_per_token=per, traced_under=trace_key(ts)))
                logger.info("memguard: measured %s on MLX: %.1f KiB saved per token per block (%.1f s)",
                            k.name, per / 1024, time.monotonic() - t0)
            except CensusTimeout:
                logger.warning("memguard: block kind %s not measured on MLX: the census passed its %.0f s "
                               "limit (%.1f s so far); counted by the rules", k.name, CENSUS_TIME_LIMIT_S,
                               time.monotonic() - start)
                kinds.append(k)
            except Exception:
                logger.warning("memguard: could not measure block kind %s on MLX; counted by the rules",
                               k.name, exc_info=True)
                kinds.append(k)
        return dataclasses.replace(ms, block_kinds=tuple(kinds))
    except Exception:
        logger.warning("memguard: MLX block census failed; block kinds counted by the rules", exc_info=True)
        return ms
