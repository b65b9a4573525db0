"""mlx_lm's validation, cut into micro-batches: :func:`evaluate` is ``mlx_lm.tuner.trainer.evaluate``
(mlx-lm 0.32) with each validation batch run as k micro-batches, k the guard's current training k or
the validation k when larger (``eval_micro_batches``, raised after an allocation failure caught
here). docs/mlx.md, "Validation cut into micro-batches".

Why: ``train()`` calls ``evaluate`` every ``steps_per_eval`` iterations on batches of the training
``batch_size``; a run whose training batches only fit cut into k micro-batches would run its
validation forward on the whole batch. The forward alone needs less than forward + backward, so the
training k is enough.

The reported loss is the unsplit one: upstream adds ``loss * ntoks`` of every batch and divides by
the summed ``ntoks``; here a batch's ``loss`` is rebuilt from its micro-batches as ``sum_i w_i l_i /
sum_i w_i`` (``w_i`` the micro-batch's weight: its ``ntoks``, or ``chunk_weight``) and its ``ntoks``
as ``sum_i ntoks_i`` -- for ``default_loss`` that is the batch's summed cross-entropy, as upstream,
up to float32 rounding. With k = 1 the arithmetic is upstream's, operation for operation.

An allocation failure (Metal; see ``memguard_mlx.trainer``) while a validation micro-batch is
evaluated drops the attempt, clears the cache, doubles the validation k and recomputes that batch;
the training k is never changed by it (a validation failure says nothing the training step has not
already survived, and changing it would change nothing about validation). One row per micro-batch
that still fails after the free, or :data:`memguard_core.oom_recovery.MAX_WINDOW_REDOS` redos of one batch,
raises ``WindowOOMError`` (phase ``validation``).
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.tuner.trainer import default_loss, iterate_batches as _iterate_batches

from memguard_core.errors import WindowOOMError
from memguard_core.microbatch import merge_empty, split_count
from memguard_core.oom_recovery import MAX_WINDOW_REDOS

from . import _compat
from .memory import is_allocation_error

logger = logging.getLogger("memguard.mlx")

__all__ = ["evaluate", "row_token_counts", "batch_rows", "slice_batch"]


def row_token_counts(batch: Any) -> Optional[Any]:
    """Loss tokens per row of an mlx_lm batch ``(tokens (B, L), lengths (B, 2))`` as
    ``default_loss`` masks them: targets are positions ``1..L-1`` and a row counts positions ``s``
    with ``offset <= s <= length``, i.e. ``max(0, min(length, L-1) - max(offset, 1) + 1)``
    (a numpy array of B ints). None for another batch layout."""
    import numpy as np

    try:
        toks, lengths = batch
        if toks.ndim != 2 or lengths.ndim != 2 or lengths.shape != (toks.shape[0], 2):
            return None
        lo = np.asarray(lengths)
        T = int(toks.shape[1]) - 1
        return np.maximum(0, np.minimum(lo[:, 1], T) - np.maximum(lo[:, 0], 1) + 1)
    except Exception:
        return None


def batch_rows(batch: Any) -> int:
    """Rows of a batch (the first dimension of its first array)."""
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0])


def slice_batch(batch: Any, a: int, b: int, rows: int) -> Any:
    """Rows ``a:b`` of every array of ``batch`` whose first dimension is ``rows``."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(x[a:b] if isinstance(x, mx.array) and x.ndim > 0 and x.shape[0] == rows else x
                           for x in batch)
    return batch[a:b]


def micro_batch_ranges(batch: Any, rows: int, k: int, by_tokens: bool) -> List[Tuple[int, int]]:
    """``[(a, b)]``: the batch's rows cut into k contiguous ranges of near-equal loss-token count
    (``by_tokens`` and an mlx_lm batch layout; else near-equal rows), ranges without loss tokens
    merged into a neighbour."""
    counts = row_token_counts(batch) if by_tokens else None
    ranges = split_count(list(counts) if counts is not None else [1] * rows, k)
    if counts is not None:
        ranges, _ = merge_empty(ranges, [int(counts[a:b].sum()) for a, b in ranges])
    return ranges


def _eval_validation(rows: int, *arrays: Any) -> None:
    """Evaluate a validation batch's or micro-batch's loss sums (``rows``: rows of that forward):
    where MLX allocates, so where an allocation failure surfaces. (A module-level function so a test
    can fake Metal's exception here.)"""
    mx.eval(*arrays)


class GuardedEval:
    """The validation k of a run and what happened to it.

    Args:
        training_k: ``() -> int``, the guard's current micro-batches per training batch.
        chunk_weight: a micro-batch's loss weight ``fn(chunk, value, weight)`` for a custom loss
            (None: the loss's own second output, ``ntoks`` for ``default_loss``).
        plan: ``() -> [str]``: the plan that would fit, for ``WindowOOMError``.
        on_redo: ``fn(message, iteration, k)`` after each allocation failure recovered here (the
            guard records it in its event log); its own failure is logged, never raised.
        eval_micro_batches: the validation k before any allocation failure (``MlxGuard``'s
            ``eval_micro_batches``; a batch is cut into the training k when that is larger).

    Attributes:
        k: the validation k (``eval_micro_batches``, raised by an allocation failure).
        history: ``[(iteration, k)]``: the k each validation pass started with, and every raise.
        oom_retries: allocation failures recovered here.
        iteration: the training iteration the next pass belongs to (set by the caller).
    """

    def __init__(self, training_k: Callable[[], int], chunk_weight: Optional[Callable] = None,
                 plan: Callable[[], List[str]] = lambda: [],
                 on_redo: Optional[Callable[[str, Optional[int], int], None]] = None,
                 eval_micro_batches: int = 1):
        self.training_k = training_k
        self.on_redo = on_redo
        self.chunk_weight = chunk_weight
        self.plan = plan
        self.k = eval_micro_batches
        self.history: List[Tuple[int, int]] = []
        self.oom_retries = 0
        self.iteration: Optional[int] = None

    def _batch_sums(self, model, batch, loss, k: int):
        # (sum of loss*ntoks contribution, ntoks) of one batch with k micro-batches, evaluated
        rows = batch_rows(batch)
        if k <= 1:
            losses, toks = loss(model, *batch)
            contrib = losses * toks
            _eval_validation(rows, contrib, toks)
            return contrib, toks
        lsum = wsum = tsum = None
        for a, b in micro_batch_ranges(batch, rows, k, self.chunk_weight is None):
            chunk = slice_batch(batch, a, b, rows)
            value, toks = loss(model, *chunk)
            w = toks if self.chunk_weight is None else self.chunk_weight(chunk, value, toks)
            w = (w if isinstance(w, mx.array) else mx.array(w)).astype(mx.float32)
            lw = mx.where(w > 0, value.astype(mx.float32) * w, mx.array(0.0, mx.float32))
            lsum = lw if lsum is None else lsum + lw
            wsum = w if wsum is None else wsum + w
            tsum = toks if tsum is None else tsum + toks
            _eval_validation(b - a, lsum, wsum, tsum)  # one micro-batch's activations at a time
        return (lsum / wsum) * tsum, tsum

    def _redo(self, exc: BaseException, k: int, rows: int, redos: int, floor_redone: bool) -> Tuple[int, bool]:
        at_floor = k >= rows
        if (at_floor and floor_redone) or redos >= MAX_WINDOW_REDOS:
            reason = ("it failed at one row per forward, also after freeing memory" if at_floor
                      else f"it failed {redos + 1} times in a row")
            logger.error("memguard: out of memory in the validation forward; %s: %s", reason, exc)
            raise WindowOOMError("validation", k, rows, redos, f"{reason}; last error: {exc}", self.plan()) from exc
        new_k = min(max(2, 2 * k), rows)
        gc.collect()
        mx.clear_cache()
        self.k = max(self.k, new_k)
        self.oom_retries += 1
        self.history.append((self.iteration, new_k))
        message = (f"out of memory in the validation forward ({type(exc).__name__}); redoing the batch with "
                   f"{new_k} micro-batches (the training micro-batches are unchanged)")
        logger.warning("memguard: %s", message)
        if self.on_redo is not None:
            try:
                self.on_redo(message, self.iteration, new_k)
            except Exception:
                logger.debug("memguard: validation redo not recorded", exc_info=True)
        return new_k, floor_redone or at_floor

    def evaluate(self, model, dataset, batch_size, num_batches, max_seq_length=2048,
                 loss: Callable = default_loss, iterate_batches: Callable = _iterate_batches,
                 clear_cache_threshold: int = 0, progress_callback: Optional[Callable] = None) -> float:
        """``mlx_lm.tuner.trainer.evaluate`` (same arguments, same batches, same result up to float32
        rounding), each batch cut into ``max(training k, validation k)`` micro-batches.

        Returns:
            the token-weighted mean validation loss over ``num_batches`` batches (-1: all).

        Raises:
            WindowOOMError: a validation batch still fails at one row per micro-batch.
        """
        model.eval()
        all_losses = mx.array(0.0)
        ntokens = mx.array(0)
        k_start = max(1, int(self.training_k()), self.k)
        self.history.append((self.iteration, k_start))

        index_iterator = iter(range(num_batches)) if num_batches != -1 else iter(int, 1)
        batch_iter = zip(index_iterator, iterate_batches(dataset=dataset, batch_size=batch_size,
                                                         max_seq_length=max_seq_length,
                                                         comm_group=mx.distributed.init()))
        for _, batch in batch_iter:
            rows = batch_rows(batch)
            k = min(max(k_start, self.k), rows)
            redos, floor_redone = 0, False
            while True:
                failed = None
                try:
                    contrib, toks = self._batch_sums(model, batch, loss, k)
                except Exception as exc:
                    if not is_allocation_error(exc):
                        raise
                    failed = exc.with_traceback(None)  # the failed try's arrays go with its frame
                if failed is None:
                    break
                k, floor_redone = self._redo(failed, k, rows, redos, floor_redone)
                redos += 1
            all_losses += contrib
            ntokens += toks
            mx.eval(all_losses, ntokens)
            _compat.clear_cache(clear_cache_threshold)
            if progress_callback is not None:
                progress_callback()

        all_losses = mx.distributed.all_sum(all_losses, stream=mx.cpu)
        ntokens = mx.distributed.all_sum(ntokens, stream=mx.cpu)
        return (all_losses / ntokens).item()


def evaluate(model, dataset, batch_size, num_batches, max_seq_length=2048, loss: Callable = default_loss,
             iterate_batches: Callable = _iterate_batches, clear_cache_threshold: int = 0,
             progress_callback: Optional[Callable] = None, *, micro_batches: int = 1,
             chunk_weight: Optional[Callable] = None) -> float:
    """``mlx_lm.tuner.trainer.evaluate`` with every validation batch cut into ``micro_batches``
    micro-batches (more after an allocation failure); see the module doc. Same arguments and result
    (up to float32 rounding) as upstream.

    Raises:
        ConfigError: ``micro_batches`` not an integer >= 1.
        WindowOOMError: a batch still fails at one row per micro-batch.
    """
    from memguard_core.errors import require_int

    require_int("micro_batches", micro_batches, "an integer >= 1", lo=1)
    return GuardedEval(lambda: micro_batches, chunk_weight).evaluate(
        model, dataset, batch_size, num_batches, max_seq_length, loss, iterate_batches, clear_cache_threshold,
        progress_callback)
