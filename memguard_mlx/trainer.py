"""``memguard_mlx.train``: a guarded drop-in for ``mlx_lm.tuner.trainer.train``.

Usage (one line changes)::

    from memguard_mlx import train          # instead of: from mlx_lm.tuner.trainer import train
    train(model, optimizer, train_set, val_set, args=training_args, training_callback=cb)

Same signature, same defaults, same behaviour (iterations, evaluation, reports, TrainUI output,
adapter files), plus keyword-only guard options (see :class:`MlxGuard`). It returns the
:class:`MlxGuard` holding what happened (mlx_lm's returns None; callers that ignore the value are
unaffected).

Why an own loop that tracks mlx_lm's, and not a wrapper around it
-----------------------------------------------------------------
mlx_lm compiles its ``step(batch, prev_grad, do_update)`` once inside ``train`` with
``grad_accumulation_steps`` captured in the closure, and drives everything -- when the optimizer
updates (``it % grad_accum_steps == 0``), evaluation, reports (``steps_per_report``) and adapter saves
(``steps_per_save``) -- from one counter ``it`` that counts *batches from iterate_batches*. The only
ways into it from outside are ``iterate_batches`` and ``loss``. Cutting batches by wrapping
``iterate_batches`` would make ``it`` count chunks: with k chunks per batch the run would stop after
``iters / k`` real batches, update the optimizer every ``grad_accum_steps`` *chunks*, average the
gradient over the wrong count, and report / save at other points -- and ``range(1, iters + 1)`` and
the compiled ``grad_accum_steps`` are fixed when ``train`` starts, so k could not change mid-run.
So this module keeps mlx_lm's loop line for line (same counters, same conditions, same report
dicts, same ``TrainUI``, mlx_lm's own ``evaluate``, ``grad_checkpoint``, ``iterate_batches`` and
``default_loss``) and changes only what happens to one batch:

* k == 1: ``grad_step`` computes the batch's ``(loss, ntoks), grad`` exactly as mlx_lm's ``step``
  does; ``update_step`` adds the previous accumulated gradient and, on update iterations, averages
  over ranks, divides by ``grad_accum_steps`` and calls ``optimizer.update`` -- mlx_lm's ``step``
  cut in two compiled halves, so an allocation failure in the (large) gradient half is caught
  before the model or the optimizer state is touched.
* k > 1: the batch's rows are cut into k contiguous chunks of near-equal *token* count
  (``memguard_core.microbatch.split_count``; rows with no loss tokens merged into a neighbour).
  ``chunk_step`` runs forward+backward on one chunk and adds ``w_i * grad_i`` to a running sum,
  where ``w_i`` is the chunk's loss weight -- by default the ``ntoks`` that the loss itself returns
  (``default_loss`` returns ``(ce_sum / ntoks, ntoks)`` with mlx_lm's length/offset mask) -- and
  each chunk is evaluated before the next one starts, so only one chunk's activations are live.
  Then ``grad = sum_i w_i grad_i / sum_i w_i`` and ``loss = sum_i w_i loss_i / sum_i w_i``, which are
  the unsplit batch's ``grad(ce_sum / ntoks)`` and ``ce_sum / ntoks`` up to float rounding, and
  ``ntoks = sum_i ntoks_i``. The result enters ``update_step`` like an unsplit batch's.

Hence ``it`` still counts batches; the number of optimizer updates, the LR schedule (it follows
``optimizer.step``), the reported ``train_loss`` (mlx_lm reports the mean over the report window of
each batch's token-mean loss), ``trained_tokens``, evaluation and adapter-saving cadence are those of
the unguarded run whatever k is, and k may change at any batch boundary. Random draws inside the
loss (dropout) differ when a batch is cut (the generator advances per chunk). A custom loss must
return ``(value, weight)`` with ``value = sum_over_units / weight`` (as mlx_lm requires
``(loss, ntoks)``); a loss whose value is a mean of a different kind passes
``chunk_weight=fn(chunk, value, weight) -> mx.array`` giving each chunk's share.

Under ``mx.distributed`` no rank agreement on k is needed: chunks run no collective; gradients are
averaged across ranks only in ``update_step``, which every rank reaches once per update as before.

Allocation failures: an MLX allocation error (:func:`memguard_mlx.memory.is_allocation_error`) while
a batch's gradient is computed frees the cache, doubles k and redoes the whole batch from the
previous accumulated gradient (nothing of the failed attempt is kept). On MLX's Linux CPU backend a
failed ``malloc`` is a SIGSEGV rather than an exception (see ``memory.py``), so there the guard's
per-batch monitor (split at critical/emergency pressure) is what keeps the run inside the budget.
"""

from __future__ import annotations

import gc
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.utils import average_gradients
from mlx.utils import tree_flatten, tree_map
from mlx_lm.tuner import trainer as _mlt
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, iterate_batches

from memguard_core.errors import ConfigError, DoesNotFitError, require_fraction
from memguard_core.microbatch import _merge_empty, split_count
from memguard_core.monitor import Action, Level, MemoryEvent, MemoryMonitor, Thresholds
from memguard_core.preflight import Preflight, plan_in_place
from memguard_core.preflight import default_budget as _core_default_budget

from .memory import LeakDetector, MemoryControls, is_allocation_error
from .spec import model_spec_from_mlx_module, train_spec_from_args

logger = logging.getLogger("memguard.mlx")

__all__ = ["train", "MlxGuard", "MlxPreflight", "run_preflight", "default_budget", "row_token_counts"]

from memguard_core.options import APPLY_CHOICES as _APPLY_CHOICES  # noqa: E402
from memguard_core.options import GuardOptions  # noqa: E402


# ---------------------------------------------------------------------------------------------
# preflight


#: The preflight's outcome: the framework-neutral ``memguard_core.preflight.Preflight``.
MlxPreflight = Preflight


def default_budget(safety_ratio: float = 0.8) -> int:
    """(MLX active memory + memory available) x ``safety_ratio`` (bytes): on Metal the available
    part is bounded by the device's recommended working set (``mx.device_info()``), on CPU by the
    host / container (``memguard_core.probes.mlx``)."""
    return _core_default_budget("mlx", safety_ratio)


def run_preflight(model, optimizer, args, train_dataset=None, *, budget_bytes: Optional[int] = None,
                  safety_ratio: float = 0.8, seq_length: Optional[int] = None,
                  apply: Sequence[str] = _APPLY_CHOICES, plan_fraction: float = 0.85) -> MlxPreflight:
    """Estimate the mlx_lm run, plan against the budget and apply gradient checkpointing in place
    when the plan asks for it (mlx_lm's own ``grad_checkpoint(model.layers[0])``, which patches the
    block class as ``TrainingArgs.grad_checkpoint`` does). The micro-batch split is returned in
    ``split_factor`` for the loop to apply.

    The plan targets ``plan_fraction x budget`` (the guard passes its warning threshold, as the HF
    adapter does): a run planned right up to the budget would sit at the monitor's critical level
    from its first batch and be split further for nothing.

    Raises:
        DoesNotFitError: nothing in the search fits.
        ConfigError: bad inputs.
    """
    ms = model_spec_from_mlx_module(model, args)
    ts = train_spec_from_args(model, optimizer, args, ms, train_dataset=train_dataset, seq_length=seq_length)
    if budget_bytes is None:
        budget_bytes = default_budget(safety_ratio)
    pf = plan_in_place(ms, ts, int(budget_bytes * require_fraction("plan_fraction", plan_fraction)),
                       apply=apply)
    pf.budget_bytes = int(budget_bytes)
    if pf.checkpointing_planned:
        _mlt.grad_checkpoint(model.layers[0])
    return pf


# ---------------------------------------------------------------------------------------------
# batch cutting


def row_token_counts(batch: Any) -> Optional[np.ndarray]:
    """Loss tokens per row of an mlx_lm batch ``(tokens (B, L), lengths (B, 2))`` as
    ``default_loss`` masks them: targets are positions ``1..L-1`` and a row counts positions ``s``
    with ``offset <= s <= length``, i.e. ``max(0, min(length, L-1) - max(offset, 1) + 1)``.
    None for another batch layout."""
    try:
        toks, lengths = batch
        if toks.ndim != 2 or lengths.ndim != 2 or lengths.shape != (toks.shape[0], 2):
            return None
        lo = np.asarray(lengths)
        T = int(toks.shape[1]) - 1
        return np.maximum(0, np.minimum(lo[:, 1], T) - np.maximum(lo[:, 0], 1) + 1)
    except Exception:
        return None


def _eval_gradient(rows: int, *arrays: Any) -> None:
    """Evaluate a batch's or a chunk's loss and gradient (``rows``: rows of that forward). MLX is
    lazy: this is where an allocation failure surfaces, before the model or optimizer state is
    touched. (A module-level function so a test can fake the allocator's exception here.)"""
    mx.eval(*arrays)


def _batch_rows(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0])


def _slice(batch: Any, a: int, b: int, rows: int) -> Any:
    if isinstance(batch, (tuple, list)):
        return type(batch)(x[a:b] if isinstance(x, mx.array) and x.ndim > 0 and x.shape[0] == rows else x
                           for x in batch)
    return batch[a:b]


# ---------------------------------------------------------------------------------------------
# the guard


class MlxGuard:
    """Guard settings for :func:`train`, and what happened during the run.

    Args:
        budget_bytes: bytes the run may use (``mx.get_peak_memory`` scale); default
            :func:`default_budget` (``safety_ratio`` of MLX active + available).
        safety_ratio: fraction of the available memory the default budget takes (0.8).
        thresholds: ``memguard_core.monitor.Thresholds`` (warning 85 %, critical 90 %, emergency 95 %).
        split: starting split factor k (>= 1); also ``MEMGUARD_SPLIT`` in the environment.
        preflight: estimate and plan at the start (default True).
        apply: what the preflight may change in place: ``grad_checkpoint``, ``micro_batch``.
        fail_fast: raise ``DoesNotFitError`` at the start when the plan needs a change that cannot
            be applied in place (sequence length, LoRA rank / layers) or nothing fits.
        seq_length: tokens per row for the preflight (default: from the data, as
            ``iterate_batches`` pads them).
        memory_controls: ``True`` (default limits, see :class:`MemoryControls`), ``False`` (leave
            MLX's limits alone; mlx_lm's own wired limit is still set, as ``mlx_lm`` does), or a
            :class:`MemoryControls`.
        leak_detector: ``True`` (default :class:`LeakDetector`), ``False``, or a detector.
        monitor_interval_s: background sampling period (0: no thread).
        clear_cache_on_warning: ``mx.clear_cache()`` at the next batch boundary when the monitor
            enters the warning level (seed 001; the monitor itself cleans at critical).
        chunk_weight: ``fn(chunk, value, weight) -> mx.array``: a chunk's loss weight for a custom
            loss (default: the loss's own second output, ``ntoks`` for ``default_loss``).
        on_event: callable receiving every ``MemoryEvent``.

    Attributes after a run:
        preflight (``memguard_core.preflight.Preflight`` or None), monitor, events (dicts), split_history
        (``[(iteration, k)]`` whenever k changed, from the first batch), batch_peaks
        (``[(iteration, k, peak_bytes)]``, the ``mx.get_peak_memory()`` of each batch: the peak is
        reset at every batch boundary), updates (optimizer updates done), learning_rates (after
        each update), alloc_retries, leak (the detector), limits (what was set), summary.

    Raises:
        ConfigError: invalid settings.
    """

    def __init__(self, *, budget_bytes: Optional[int] = None, safety_ratio: float = 0.8,
                 thresholds: Optional[Thresholds] = None, split: Optional[int] = None,
                 preflight: bool = True, apply: Sequence[str] = _APPLY_CHOICES, fail_fast: bool = False,
                 seq_length: Optional[int] = None, memory_controls: Any = True, leak_detector: Any = True,
                 monitor_interval_s: float = 0.5, clear_cache_on_warning: bool = True,
                 chunk_weight: Optional[Callable] = None,
                 on_event: Optional[Callable[[MemoryEvent], None]] = None):
        opts = GuardOptions.from_kwargs(
            budget_bytes=budget_bytes, safety_ratio=safety_ratio, thresholds=thresholds, seq_length=seq_length,
            apply=apply, fail_fast=fail_fast, split=split, monitor_interval_s=monitor_interval_s,
            device="mlx", preflight=preflight)
        if not isinstance(clear_cache_on_warning, bool):
            raise ConfigError("clear_cache_on_warning", "True or False", clear_cache_on_warning)
        if memory_controls is True:
            memory_controls = MemoryControls()
        elif memory_controls in (False, None):
            memory_controls = None
        elif not isinstance(memory_controls, MemoryControls):
            raise ConfigError("memory_controls", "True, False or a MemoryControls", memory_controls)
        if leak_detector is True:
            leak_detector = LeakDetector()
        elif leak_detector in (False, None):
            leak_detector = None
        elif not isinstance(leak_detector, LeakDetector):
            raise ConfigError("leak_detector", "True, False or a LeakDetector", leak_detector)
        if chunk_weight is not None and not callable(chunk_weight):
            raise ConfigError("chunk_weight", "a callable fn(chunk, value, weight) or None", chunk_weight)
        opts.set_on(self, skip=("loss_weighting", "device"))  # budget_bytes, ..., initial_split, do_preflight
        self.controls: Optional[MemoryControls] = memory_controls
        self.leak: Optional[LeakDetector] = leak_detector
        self.clear_cache_on_warning = clear_cache_on_warning
        self.chunk_weight = chunk_weight
        self._user_on_event = on_event

        self.preflight: Optional[MlxPreflight] = None
        self.monitor: Optional[MemoryMonitor] = None
        self.events: List[Dict[str, Any]] = []
        self.split_history: List[Tuple[int, int]] = []
        self.batch_peaks: List[Tuple[int, int, int]] = []
        self.chunk_rows: List[int] = []
        self.updates = 0
        self.learning_rates: List[float] = []
        self.alloc_retries = 0
        self.limits: Dict[str, int] = {}
        self.summary: Dict[str, Any] = {}
        self.max_peak_bytes = 0
        self._clean_pending = False
        self._it = 0
        self._k = 1
        self._batch_k = 1

    # ----------------------------------------------------------------- monitor plumbing
    def _on_event(self, event: MemoryEvent) -> None:
        self.events.append(event.to_dict())
        if self.clear_cache_on_warning and event.level == Level.WARNING and event.action is Action.LOG:
            self._clean_pending = True
        if self._user_on_event is not None:
            self._user_on_event(event)

    def _request_clean(self) -> None:
        # called by the monitor, possibly from its thread: MLX arrays are evaluated on the main
        # thread, so the cache is cleared there, at the next batch boundary
        gc.collect()
        self._clean_pending = True

    def _peak_fn(self) -> int:
        """The peak of the batch just finished (``mx.get_peak_memory``), then reset: one peak window
        per batch (seed 001, "reset_peak_memory ... before profiling specific code sections")."""
        p = int(mx.get_peak_memory())
        mx.reset_peak_memory()
        self.max_peak_bytes = max(self.max_peak_bytes, p)
        if self._it > 0:
            self.batch_peaks.append((self._it, self._batch_k, p))
        return p

    def peak_so_far(self) -> int:
        """Peak since the run started (bytes): what mlx_lm's report shows (it never resets)."""
        return max(self.max_peak_bytes, int(mx.get_peak_memory()))

    # ----------------------------------------------------------------- setup / teardown
    def start(self, model, optimizer, args, train_dataset) -> None:
        budget = self.budget_bytes
        split = self.initial_split
        planned_peak = None
        if self.do_preflight:
            try:
                self.preflight = run_preflight(model, optimizer, args, train_dataset, budget_bytes=budget,
                                               safety_ratio=self.safety_ratio, seq_length=self.seq_length,
                                               apply=self.apply, plan_fraction=self.thresholds.warning)
            except DoesNotFitError:
                if self.fail_fast:
                    raise
                logger.error("memguard preflight: nothing fits the budget; training goes on with the "
                             "runtime guard watching", exc_info=True)
            except ConfigError:
                raise
            except Exception:
                logger.warning("memguard preflight failed; the runtime guard still runs", exc_info=True)
        pf = self.preflight
        if pf is not None:
            budget = pf.budget_bytes
            split = max(split, pf.split_factor)
            planned_peak = pf.best_peak_bytes
            for line in pf.report_lines():
                logger.info("%s", line)
            if pf.not_applied and self.fail_fast:
                raise DoesNotFitError(max(0, pf.best_peak_bytes - pf.budget_bytes), pf.budget_bytes,
                                      pf.best_peak_bytes, [c.reason for c in pf.not_applied])
        if budget is None:
            budget = default_budget(self.safety_ratio)
        self.budget_bytes = int(budget)
        if self.controls is not None:
            # sets the wired limit too (on Metal; min(recommended, budget) instead of mlx_lm's
            # recommended size); wired_limit=False leaves it alone
            self.limits = self.controls.apply(self.budget_bytes, planned_peak)
        else:
            self._mlx_lm_wired_limit()
        rows = int(args.batch_size)
        self.monitor = MemoryMonitor(self.budget_bytes, device="mlx", safety_ratio=self.safety_ratio,
                                     thresholds=self.thresholds, interval_s=self.monitor_interval_s,
                                     split=max(1, min(split, rows)), max_split=rows, on_event=self._on_event,
                                     clean_fn=self._request_clean, peak_fn=self._peak_fn)
        self.monitor.prime()
        self.monitor.start()

    @staticmethod
    def _mlx_lm_wired_limit() -> None:
        try:
            from mlx_lm.utils import maybe_set_recommended_wired_limit

            maybe_set_recommended_wired_limit()
        except Exception as exc:  # pragma: no cover - Metal only
            logger.warning("memguard: mlx_lm's wired limit could not be set: %s", exc)

    def stop(self, iterations: int) -> None:
        mon = self.monitor
        if mon is not None:
            mon.stop()
            mon.final_sample()
        if self.controls is not None:
            self.controls.restore()
        pf = self.preflight
        self.summary = {
            "iterations": iterations,
            "optimizer_updates": self.updates,
            "split": mon.split if mon else None,
            "split_history": list(self.split_history),
            "budget_bytes": self.budget_bytes,
            "measured_peak_bytes": self.max_peak_bytes,
            "estimated_peak_bytes": pf.best_peak_bytes if pf else None,
            "requested_peak_bytes": int(pf.estimate.peak_bytes) if pf else None,
            "max_usage": round(mon.max_usage, 4) if mon else None,
            "alloc_retries": self.alloc_retries,
            "leaks": len(self.leak.reports) if self.leak else 0,
            "limits": dict(self.limits),
            "events": len(self.events),
        }
        logger.info("memguard summary: %s", self.summary)
        # calibration (issue #6): record estimate vs measured peak; logs, never raises
        from memguard_core.calibration import record_preflight
        if mon is not None and not self.alloc_retries:
            record_preflight(pf, self.max_peak_bytes, split=mon.split)

    # ----------------------------------------------------------------- per batch
    def split_for_batch(self, it: int, rows: int) -> int:
        """Sample memory at the batch boundary and return k for this batch."""
        self._it = it - 1  # the peak read now belongs to the previous batch
        if self._clean_pending:
            self._clean_pending = False
            mx.clear_cache()
        mon = self.monitor
        if mon is not None:
            mon.step_sample(it)
        k = max(1, min(mon.split if mon else 1, rows))
        if not self.split_history or self.split_history[-1][1] != k:
            self.split_history.append((it, k))
        self._it = it
        self._batch_k = k
        return k

    def after_alloc_failure(self, exc: BaseException, k: int, rows: int, it: int) -> int:
        """Free memory after an allocation failure and return the doubled k; re-raise when a batch
        of one row per chunk already failed."""
        if k >= rows:
            logger.error("memguard: allocation failed with one row per chunk; cannot split further (%s)", exc)
            raise exc
        self.alloc_retries += 1
        new_k = min(max(2, 2 * k), rows)
        if self.monitor is not None:
            new_k = max(new_k, self.monitor.request_split(
                new_k, f"allocation failed ({exc}); redoing the batch in smaller chunks", it))
        gc.collect()
        mx.clear_cache()
        self.split_history.append((it, new_k))
        self._batch_k = new_k
        return new_k

    def after_update(self, it: int, optimizer) -> None:
        self.updates += 1
        try:
            self.learning_rates.append(float(optimizer.learning_rate.item()))
        except Exception:
            pass
        if self.leak is not None:
            self.leak.sample(it)


# ---------------------------------------------------------------------------------------------
# train


def train(
    model,
    optimizer,
    train_dataset,
    val_dataset=None,
    args: TrainingArgs = TrainingArgs(),
    loss: callable = default_loss,
    iterate_batches: callable = iterate_batches,
    training_callback=None,
    *,
    guard: Optional[MlxGuard] = None,
    **guard_kwargs: Any,
) -> MlxGuard:
    """Train like ``mlx_lm.tuner.trainer.train`` (same arguments and behaviour), guarded.

    Args:
        model, optimizer, train_dataset, val_dataset, args, loss, iterate_batches,
        training_callback: as ``mlx_lm.tuner.trainer.train`` (mlx-lm 0.32).
        guard: an :class:`MlxGuard` (settings; filled with the run's record).
        **guard_kwargs: :class:`MlxGuard` settings when ``guard`` is not given (``budget_bytes``,
            ``split``, ``memory_controls``, ``leak_detector``, ...).

    Returns:
        the :class:`MlxGuard`.

    Raises:
        ValueError: ``grad_accumulation_steps < 1`` (as mlx_lm).
        DoesNotFitError: with ``fail_fast=True`` when the plan cannot be applied in place.
        ConfigError: bad guard settings.
    """
    if guard is None:
        guard = MlxGuard(**guard_kwargs)
    elif guard_kwargs:
        raise ConfigError("guard_kwargs", "either guard=MlxGuard(...) or guard settings, not both",
                          sorted(guard_kwargs))

    world = mx.distributed.init()
    world_size = world.size()
    rank = world.rank()

    grad_accum_steps = args.grad_accumulation_steps
    if grad_accum_steps < 1:
        raise ValueError("grad_accumulation_steps must be at least 1")

    guard.start(model, optimizer, args, train_dataset)  # wired limit: here (mlx_lm sets it first)

    if args.grad_checkpoint:
        _mlt.grad_checkpoint(model.layers[0])

    loss_value_and_grad = nn.value_and_grad(model, loss)
    chunk_weight = guard.chunk_weight
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def grad_step(batch):
        # the first half of mlx_lm's `step`: the whole batch's loss, token count and gradient
        (lvalue, toks), grad = loss_value_and_grad(model, *batch)
        return lvalue, toks, grad

    @partial(mx.compile, inputs=state, outputs=state)
    def chunk_step(chunk, acc):
        # one chunk: add w * grad to the running sum; w = the chunk's loss weight (ntoks)
        (lvalue, toks), grad = loss_value_and_grad(model, *chunk)
        w = toks if chunk_weight is None else chunk_weight(chunk, lvalue, toks)
        w = (w if isinstance(w, mx.array) else mx.array(w)).astype(mx.float32)
        ok = w > 0  # a chunk without loss tokens adds nothing (its ce/0 would be nan)
        grad = tree_map(lambda g: mx.where(ok, g * w.astype(g.dtype), mx.zeros_like(g)), grad)
        if acc is not None:
            grad = tree_map(lambda x, y: x + y, grad, acc)
        lw = mx.where(ok, lvalue.astype(mx.float32) * w, mx.array(0.0, mx.float32))
        return lw, w, toks, grad

    @partial(mx.compile, inputs=state, outputs=state)
    def update_step(grad, scale, prev_grad, do_update):
        # the second half of mlx_lm's `step` (same operations, same order)
        if scale is not None:
            grad = tree_map(lambda g: g / scale.astype(g.dtype), grad)
        if prev_grad is not None:
            grad = tree_map(lambda x, y: x + y, grad, prev_grad)
        if do_update:
            grad = average_gradients(grad)
            if grad_accum_steps > 1:
                grad = tree_map(lambda x: x / grad_accum_steps, grad)
            optimizer.update(model, grad)
            grad = None
        return grad

    def run_batch(batch, prev_grad, do_update, it):
        rows = _batch_rows(batch)
        k = guard.split_for_batch(it, rows)
        if k <= 1:
            try:
                lvalue, toks, g = grad_step(batch)
                _eval_gradient(rows, lvalue, toks, g)
                guard.chunk_rows.append(rows)
                return lvalue, toks, update_step(g, None, prev_grad, do_update)
            except Exception as exc:
                if not is_allocation_error(exc):
                    raise
                k = guard.after_alloc_failure(exc, 1, rows, it)
        counts = row_token_counts(batch) if chunk_weight is None else None
        while True:
            ranges = split_count(list(counts) if counts is not None else [1] * rows, k)
            if counts is not None:
                sums = [int(counts[a:b].sum()) for a, b in ranges]
                ranges, _ = _merge_empty(ranges, sums)
            acc = None
            lsum = wsum = tsum = None
            try:
                for a, b in ranges:
                    lw, w, t, acc = chunk_step(_slice(batch, a, b, rows), acc)
                    lsum = lw if lsum is None else lsum + lw
                    wsum = w if wsum is None else wsum + w
                    tsum = t if tsum is None else tsum + t
                    _eval_gradient(b - a, lsum, wsum, tsum, acc)  # one chunk's activations at a time
                    guard.chunk_rows.append(b - a)
                break
            except Exception as exc:
                if not is_allocation_error(exc):
                    raise
                del acc
                k = guard.after_alloc_failure(exc, k, rows, it)
        return lsum / wsum, tsum, update_step(acc, wsum, prev_grad, do_update)

    model.train()
    losses = 0
    n_tokens = 0
    steps = 0
    trained_tokens = 0
    train_time = 0
    grad_accum = None
    it = 0

    ui = _mlt.TrainUI(args.iters, rank=rank)
    try:
        with ui:
            for it, batch in zip(
                range(1, args.iters + 1),
                iterate_batches(
                    dataset=train_dataset,
                    batch_size=args.batch_size,
                    max_seq_length=args.max_seq_length,
                    loop=True,
                    comm_group=world,
                ),
            ):
                tic = time.perf_counter()
                if val_dataset and (it == 1 or it % args.steps_per_eval == 0 or it == args.iters):
                    if args.val_batches == -1:
                        val_total = len(val_dataset) // args.batch_size
                    else:
                        val_total = min(len(val_dataset) // args.batch_size, args.val_batches)
                    tic = time.perf_counter()
                    with ui.val_task(val_total) as advance_val:
                        val_loss = _mlt.evaluate(
                            model=model,
                            dataset=val_dataset,
                            loss=loss,
                            batch_size=args.batch_size,
                            num_batches=args.val_batches,
                            max_seq_length=args.max_seq_length,
                            iterate_batches=iterate_batches,
                            progress_callback=advance_val,
                        )
                    model.train()
                    val_time = time.perf_counter() - tic
                    ui.report_val(it, val_loss, val_time)
                    if training_callback is not None:
                        training_callback.on_val_loss_report(
                            {"iteration": it - 1, "val_loss": val_loss, "val_time": val_time})
                    tic = time.perf_counter()

                do_update = it % grad_accum_steps == 0
                lvalue, toks, grad_accum = run_batch(batch, grad_accum, do_update, it)

                losses += lvalue
                n_tokens += toks
                steps += 1
                mx.eval(state, losses, n_tokens, grad_accum)
                _mlt._clear_cache(args.clear_cache_threshold)
                train_time += time.perf_counter() - tic
                if do_update:
                    guard.after_update(it, optimizer)

                ui.advance()

                if it % args.steps_per_report == 0 or it == args.iters:
                    train_loss = mx.distributed.all_sum(losses, stream=mx.cpu).item()
                    train_loss /= steps * world_size
                    n_tokens = mx.distributed.all_sum(n_tokens, stream=mx.cpu).item()
                    learning_rate = optimizer.learning_rate.item()
                    it_sec = args.steps_per_report / train_time
                    tokens_sec = float(n_tokens) / train_time
                    trained_tokens += n_tokens
                    peak_mem = guard.peak_so_far() / 1e9
                    ui.report_train(it, train_loss, tokens_sec, trained_tokens)
                    if guard.monitor is not None and guard.monitor.split > 1 and rank == 0:
                        ui._console.print(f"  [ui.muted]memguard: k={guard.monitor.split} chunks per batch, "
                                          f"peak {peak_mem:.3f} GB[/ui.muted]")
                    if training_callback is not None:
                        training_callback.on_train_loss_report(
                            {
                                "iteration": it,
                                "train_loss": train_loss,
                                "learning_rate": learning_rate,
                                "iterations_per_second": it_sec,
                                "tokens_per_second": tokens_sec,
                                "trained_tokens": trained_tokens,
                                "peak_memory": peak_mem,
                            }
                        )
                    losses = 0
                    n_tokens = 0
                    steps = 0
                    train_time = 0

                if it % args.steps_per_save == 0 and rank == 0:
                    adapter_weights = dict(tree_flatten(model.trainable_parameters()))
                    mx.save_safetensors(str(args.adapter_file), adapter_weights)
                    checkpoint = Path(args.adapter_file).parent / f"{it:07d}_adapters.safetensors"
                    mx.save_safetensors(str(checkpoint), adapter_weights)
                    ui.report_save(checkpoint)

        if rank == 0:
            adapter_weights = dict(tree_flatten(model.trainable_parameters()))
            mx.save_safetensors(str(args.adapter_file), adapter_weights)
    finally:
        guard.stop(it)
    return guard
