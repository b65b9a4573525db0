"""``memguard_mlx.train``: a guarded drop-in for ``mlx_lm.tuner.trainer.train``.

Same signature, defaults and behaviour, plus keyword-only guard options (see :class:`MlxGuard`);
it returns the :class:`MlxGuard` holding what happened. The loop is mlx_lm's own
(``memguard_mlx._mlx_lm_loop``); this module changes only what happens to one batch (k
micro-batches weighted by their loss tokens, the window redo after an allocation failure) and runs
the guard's lifecycle around the loop. docs/mlx.md tells how one batch runs, what is exact, and
what happens when memory runs out on Metal and on the CPU backend.
"""

from __future__ import annotations

import gc
import logging
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.tuner.trainer import TrainingArgs, default_loss, iterate_batches

from memguard_core.errors import ConfigError, WindowOOMError
from memguard_core.guard import Guard, GuardAttributes
from memguard_core.monitor import Action, Level, MemoryEvent
from memguard_core.options import APPLY_CHOICES, GuardOptions, option_kwargs, with_guard_options
from memguard_core.preflight import Preflight
from memguard_core.preflight import default_budget as _core_default_budget

from . import _compat
from ._mlx_lm_loop import compile_halves, train_loop
from .memory import LeakDetector, MemoryControls, is_allocation_error
from .resume import guard_state_metadata, restore_guard_state, resume_run, skip_batches
from .eval import GuardedEval, batch_rows, micro_batch_ranges, row_token_counts, slice_batch
from .block_census import with_measured_blocks
from .specs import model_spec_from_mlx_module, train_spec

logger = logging.getLogger("memguard.mlx")

__all__ = ["train", "MlxGuard", "MlxPreflight", "run_preflight", "default_budget", "row_token_counts"]


# ---------------------------------------------------------------------------------------------
# preflight


#: The preflight's outcome: the framework-neutral ``memguard_core.preflight.Preflight``.
MlxPreflight = Preflight


def default_budget(safety_ratio: float = 0.8) -> int:
    """(MLX active memory + memory available) x ``safety_ratio`` (bytes): on Metal the available
    part is bounded by the device's recommended working set (``mx.device_info()``), on CPU by the
    host / container (``memguard_mlx.probes``)."""
    return _core_default_budget("mlx", safety_ratio)


def _reader(model, optimizer, args, train_dataset, seq_length: Optional[int]) -> Callable[[], tuple]:
    def read_specs() -> tuple:
        ms = model_spec_from_mlx_module(model, args)
        ts = train_spec(model, optimizer, args, ms, train_dataset=train_dataset, seq_length=seq_length)
        # block kinds the rules do not model: one block measured on the MLX backend (never raises)
        return with_measured_blocks(model, ms, ts), ts
    return read_specs


def run_preflight(model, optimizer, args, train_dataset=None, *, budget_bytes: Optional[int] = None,
                  safety_ratio: float = 0.8, seq_length: Optional[int] = None,
                  apply: Sequence[str] = APPLY_CHOICES) -> MlxPreflight:
    """Estimate the mlx_lm run and plan it against the budget (``Guard.plan``: below the monitor's
    warning level), applying gradient checkpointing in place when the plan asks for it (mlx_lm's
    own ``grad_checkpoint(model.layers[0])``). The micro-batches per batch are returned in
    ``micro_batches`` for the loop to apply. :func:`train` runs this itself.

    Raises:
        DoesNotFitError: nothing in the search fits.
        ConfigError: bad inputs.
    """
    options = GuardOptions.from_kwargs(budget_bytes=budget_bytes, safety_ratio=safety_ratio, seq_length=seq_length,
                                       apply=apply, device="mlx", micro_batches=1)
    return Guard(options, log=logger).plan(_reader(model, optimizer, args, train_dataset, seq_length),
                                           lambda: _compat.grad_checkpoint(model.layers[0]))


# ---------------------------------------------------------------------------------------------
# batch cutting


def _eval_gradient(rows: int, *arrays: Any) -> None:
    """Evaluate a batch's or a chunk's loss and gradient (``rows``: rows of that forward). MLX is
    lazy: this is where an allocation failure surfaces, before the model or optimizer state is
    touched. (A module-level function so a test can fake the allocator's exception here.)"""
    mx.eval(*arrays)


def _eval_update(*arrays: Any) -> None:
    """Evaluate an optimizer update (the model's and the optimizer's state): where an allocation
    failure in the update surfaces. (A module-level function so a test can fake Metal's exception
    here.)"""
    mx.eval(*arrays)


def _update_oom(guard: "MlxGuard", exc: BaseException, k: int, rows: int) -> WindowOOMError:
    # an update that failed part-way may have replaced some parameters or moments already: never
    # redone here; memguard run restarts the run and it resumes from its last adapter save
    guard.guard.log.error("memguard: out of memory in the optimizer update; it is not redone: %s", exc)
    plan = ["an optimizer with less state per parameter (mlx.optimizers.Adafactor, SGD) or fewer trainable "
            "parameters (LoRA rank / layers)"] + guard.guard.fit_plan()
    return WindowOOMError("optimizer step", k, rows, 0, str(exc), plan)


_batch_rows = batch_rows
_slice = slice_batch


def _mlx_options(options: Dict[str, Any]) -> GuardOptions:
    """The guard options of an MLX run: those that mean nothing on MLX are refused when set, the
    device is MLX's (docs/mlx.md, "Options").

    Raises:
        ConfigError: naming the field.
    """
    if options.get("loss_weighting", "auto") != "auto":
        raise ConfigError("loss_weighting", '"auto" on MLX (a chunk weighs the loss\'s own second output, '
                          'ntoks; a custom weight: chunk_weight)', options["loss_weighting"])
    for name in ("cuda_snapshots", "snapshot_steps"):
        if options.get(name):
            raise ConfigError(name, "not set on MLX (CUDA allocator snapshots)", options[name])
    device = options.pop("device", "auto")
    if device not in ("auto", "mlx"):
        raise ConfigError("device", '"auto" or "mlx" (MlxGuard probes MLX memory)', device)
    # leak_detector=False: MLX's own detector (memory.LeakDetector, on active memory) runs instead
    return GuardOptions.from_kwargs(**options, device="mlx", leak_detector=False)


# ---------------------------------------------------------------------------------------------
# the guard


class MlxGuard(GuardAttributes):
    """Guard settings for :func:`train`, and what happened during the run.

    Args:
        memory_controls: ``True`` (default limits, see :class:`MemoryControls`), ``False`` (leave
            MLX's limits alone; mlx_lm's own wired limit is still set, as ``mlx_lm`` does), or a
            :class:`MemoryControls`.
        leak_detector: ``True`` (default :class:`LeakDetector`, on MLX active memory), ``False``, or
            a detector.
        clear_cache_on_warning: ``mx.clear_cache()`` at the next batch boundary when the monitor
            enters the warning level (the monitor itself cleans at critical).
        chunk_weight: ``fn(chunk, value, weight) -> mx.array``: a chunk's loss weight for a custom
            loss (default: the loss's own second output, ``ntoks`` for ``default_loss``).
        on_event: callable receiving every ``MemoryEvent``.
        **options: the guard options every adapter takes
            (``memguard_core.options.GuardOptions.from_kwargs``: ``budget_bytes`` /
            ``budget_gib`` (``mx.get_peak_memory`` scale; default :func:`default_budget`),
            ``safety_ratio``, ``thresholds``, ``micro_batches``, ``preflight``, ``apply``,
            ``fail_fast``, ``seq_length`` (default: from the data, as ``iterate_batches`` pads
            them), ``monitor_interval_s``, ``grow``, ``log_dir``, ...). On MLX:
            ``eval_micro_batches`` is the k each validation batch starts cut into at least (the
            training k when larger; doubled after an allocation failure there); ``device`` is
            ``"auto"`` or ``"mlx"`` (MLX memory is probed); ``trim_heap`` is taken and does
            nothing (the trim is the torch CPU device's); ``loss_weighting`` other than ``"auto"``
            and ``cuda_snapshots`` / ``snapshot_steps`` are refused (docs/mlx.md, "Options").

    Attributes after a run:
        the guard's (``memguard_core.guard.Guard``): guard, preflight, monitor, events (dicts),
        micro_batch_rows, samples_per_step, oom_retries, budget_bytes, summary; and micro_batches_history
        (``[(iteration, k)]`` whenever k changed, from the first batch), batch_peaks
        (``[(iteration, k, peak_bytes)]``, the ``mx.get_peak_memory()`` of each batch: the peak is
        reset at every batch boundary), optimizer_steps, learning_rates (after each update), leak
        (the detector), limits (what was set), resumed_from (the adapter file a resumed run
        loaded, None otherwise), validation (the
        :class:`memguard_mlx.eval.GuardedEval`: ``history`` ``[(iteration, k)]`` of the
        validation passes and of every validation k raised after an allocation failure; those
        failures count in ``oom_retries`` and never change the training k). Deprecated names: ``chunk_rows``
        (``micro_batch_rows``), ``alloc_retries`` (``oom_retries``), ``updates``
        (``optimizer_steps``).

    Raises:
        ConfigError: invalid settings.
    """

    @with_guard_options
    def __init__(self, *, memory_controls: Any = True, leak_detector: Any = True,
                 clear_cache_on_warning: bool = True, chunk_weight: Optional[Callable] = None,
                 on_event: Optional[Callable[[MemoryEvent], None]] = None, **options: Any):
        own = ("memory_controls", "leak_detector", "clear_cache_on_warning", "chunk_weight", "on_event")
        options = _mlx_options(dict(option_kwargs(options, own=own)))
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
        if on_event is not None and not callable(on_event):
            raise ConfigError("on_event", "a callable, or None", on_event)
        _compat.check_version()
        self.options = options
        self.guard = Guard(options, log=logger, on_event=self._on_event)
        self.controls: Optional[MemoryControls] = memory_controls
        self.leak: Optional[LeakDetector] = leak_detector
        self.clear_cache_on_warning = clear_cache_on_warning
        self.chunk_weight = chunk_weight
        self._user_on_event = on_event

        self.micro_batches_history: List[Tuple[int, int]] = []
        self.batch_peaks: List[Tuple[int, int, int]] = []
        self.optimizer_steps = 0
        self.learning_rates: List[float] = []
        self.limits: Dict[str, int] = {}
        self.max_peak_bytes = 0
        self._clean_pending = False
        self._it = 0
        self._first_iteration = 1
        self._batch_k = 1
        self._rows_this_update = 0
        self.validation: Optional[GuardedEval] = None
        self.resumed_from: Optional[str] = None

    # ----------------------------------------------------------------- monitor plumbing
    def _on_event(self, event: MemoryEvent) -> None:
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
        per batch."""
        p = int(mx.get_peak_memory())
        mx.reset_peak_memory()
        self.max_peak_bytes = max(self.max_peak_bytes, p)
        # a batch of this process ran since the last reading; a second reading of the same
        # iteration (the report's record, then the next boundary) covers no batch
        if self._it >= self._first_iteration and (not self.batch_peaks or self.batch_peaks[-1][0] != self._it):
            self.batch_peaks.append((self._it, self._batch_k, p))
        return p

    def peak_so_far(self) -> int:
        """Peak since the run started (bytes): what mlx_lm's report shows (it never resets)."""
        return max(self.max_peak_bytes, int(mx.get_peak_memory()))

    # ----------------------------------------------------------------- setup / teardown
    def start(self, model, optimizer, args, train_dataset) -> None:
        """The guard's start (``Guard.start``): preflight, budget, MLX memory limits, monitor.

        Raises:
            DoesNotFitError, ConfigError: with ``fail_fast`` (see ``Guard.start``).
        """
        self.guard.start(rows=int(args.batch_size),
                         read_specs=_reader(model, optimizer, args, train_dataset, self.options.seq_length),
                         enable_checkpointing=lambda: _compat.grad_checkpoint(model.layers[0]),
                         before_monitor=self._apply_limits, clean_fn=self._request_clean, peak_fn=self._peak_fn,
                         plan_hint=": set TrainingArgs batch_size and grad_accumulation_steps to these numbers")

    def _apply_limits(self, budget_bytes: int, planned_peak: Optional[int]) -> None:
        if self.controls is not None:
            # sets the wired limit too (on Metal; min(recommended, budget) instead of mlx_lm's
            # recommended size); wired_limit=False leaves it alone
            self.limits = self.controls.apply(budget_bytes, planned_peak)
            return
        try:
            from mlx_lm.utils import maybe_set_recommended_wired_limit

            maybe_set_recommended_wired_limit()
        except Exception as exc:  # pragma: no cover - Metal only
            logger.warning("memguard: mlx_lm's wired limit could not be set: %s", exc)

    def stop(self, iterations: int) -> None:
        """End the run: the guard's summary (same keys as the torch adapters', plus ``iterations``,
        ``micro_batches_history``, ``leaks``, ``limits`` and ``resumed_from``, the adapter file a resumed run
        started from or None) and calibration record; MLX limits restored."""
        self.guard.finish(self.optimizer_steps, measured_bytes=lambda: self.max_peak_bytes,
                          iterations=iterations, micro_batches_history=list(self.micro_batches_history),
                          leaks=len(self.leak.reports) if self.leak else 0, limits=dict(self.limits),
                          resumed_from=self.resumed_from)
        if self.controls is not None:
            self.controls.restore()

    # ----------------------------------------------------------------- per batch
    def split_for_batch(self, it: int, rows: int) -> int:
        """Sample memory at the batch boundary and return k for this batch."""
        self._it = it - 1  # the peak read now belongs to the previous batch
        if self._clean_pending:
            self._clean_pending = False
            mx.clear_cache()
        mon = self.guard.monitor
        # chunks run no collective under mx.distributed: no agreement over ranks needed
        k = self.guard.micro_batches_for_step(it, agree=False, completed=it - 1) if mon is not None else 1
        k = max(1, min(k, rows))
        if not self.micro_batches_history or self.micro_batches_history[-1][1] != k:
            self.micro_batches_history.append((it, k))
        self._it = it
        self._batch_k = k
        return k

    def after_window_oom(self, exc: BaseException, k: int, rows: int, it: int, redos: int) -> int:
        """After an MLX allocation failure while a batch's gradient was evaluated, once the failed
        attempt's arrays are dropped: free MLX's cache, raise k (``Guard.after_window_oom``: doubled,
        at most ``rows``) and return it; the whole batch is then recomputed from its first chunk.

        Args:
            exc: the allocation error (:func:`memguard_mlx.memory.is_allocation_error`).
            k: micro-batches of the failed attempt.
            rows: rows of the batch.
            it: the iteration (mlx_lm's ``it``, 1-based) of the batch.
            redos: redos of this batch already done.

        Raises:
            WindowOOMError: the failed attempt already ran one row per micro-batch (after one redo
                there) or the batch failed ``MAX_WINDOW_REDOS`` times; it names the plan that fits.
        """
        new_k = self.guard.after_window_oom(exc, k, rows, it, redos=redos, phase="forward and backward",
                                            free=_free_mlx)
        if self.micro_batches_history[-1][1] != new_k:
            self.micro_batches_history.append((it, new_k))
        self._batch_k = new_k
        return new_k

    def micro_batch_done(self, rows: int) -> None:
        """Record a micro-batch whose gradient was evaluated (MLX is lazy: an allocation failure
        surfaces at evaluation, so only micro-batches that went through are recorded)."""
        self.guard.micro_batch_rows.append(rows)
        self._rows_this_update += rows

    def after_update(self, it: int, optimizer) -> None:
        """After an optimizer update: count it, note the learning rate, sample the leak detector."""
        self.optimizer_steps += 1
        self.guard.samples_per_step.append(self._rows_this_update)
        self._rows_this_update = 0
        try:
            self.learning_rates.append(float(optimizer.learning_rate.item()))
        except Exception:
            logger.debug("memguard: no learning rate to record", exc_info=True)
        if self.leak is not None:
            self.leak.sample(it)


def _free_mlx() -> None:
    """What an allocation failure left goes back before the retry."""
    gc.collect()
    mx.clear_cache()


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
    resume_from: Any = None,
    **guard_kwargs: Any,
) -> MlxGuard:
    """Train like ``mlx_lm.tuner.trainer.train`` (same arguments and behaviour), guarded.

    Args:
        model, optimizer, train_dataset, val_dataset, args, loss, iterate_batches,
        training_callback: as ``mlx_lm.tuner.trainer.train`` (mlx-lm 0.32).
        guard: an :class:`MlxGuard` (settings; filled with the run's record).
        resume_from: None (default): resume from the adapter file ``memguard run`` names in
            ``MEMGUARD_RESUME_FROM`` after a restart (:func:`memguard_mlx.resume_adapter_file`;
            unset: start from the beginning); a path: resume from that
            ``<adapter_path>/NNNNNNN_adapters.safetensors``; False: never resume. A resume loads
            the adapter weights, sets the optimizer's step and goes on at the iteration after the
            last update saved, skipping the finished iterations' batches (``memguard_mlx.resume``);
            the guard's state saved in its metadata is taken back instead of planning again.
        **guard_kwargs: :class:`MlxGuard` settings when ``guard`` is not given (``budget_bytes``,
            ``micro_batches``, ``memory_controls``, ``leak_detector``, ...).

    Returns:
        the :class:`MlxGuard`.

    Raises:
        ValueError: ``grad_accumulation_steps < 1`` (as mlx_lm).
        DoesNotFitError: with ``fail_fast=True`` when the plan cannot be applied in place.
        ConfigError: bad guard settings; a resume file that is not mlx_lm's numbered save of
            this model's adapters (``resume_from`` or ``MEMGUARD_RESUME_FROM`` named).
    """
    if guard is None:
        guard = MlxGuard(**guard_kwargs)
    elif guard_kwargs:
        raise ConfigError("guard_kwargs", "either guard=MlxGuard(...) or guard settings, not both",
                          sorted(guard_kwargs))

    world = mx.distributed.init()
    grad_accum_steps = args.grad_accumulation_steps
    if grad_accum_steps < 1:
        raise ValueError("grad_accumulation_steps must be at least 1")

    resumed, start = resume_run(model, optimizer, resume_from, grad_accum_steps)
    if resumed:
        guard.resumed_from, guard._it, guard._first_iteration = resumed, start, start + 1
        restore_guard_state(guard.guard, resumed)   # what the guard decided before, saved in the file

    guard.start(model, optimizer, args, train_dataset)  # wired limit: here (mlx_lm sets it first)
    if args.grad_checkpoint:
        _compat.grad_checkpoint(model.layers[0])

    loss_value_and_grad = nn.value_and_grad(model, loss)
    chunk_weight = guard.chunk_weight
    state, grad_step, update_step = compile_halves(model, optimizer, loss_value_and_grad, grad_accum_steps)

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

    def attempt(batch, rows, k):
        # one try at the batch's gradient with k micro-batches: (loss, ntoks, grad, scale, rows of each
        # micro-batch); every array of a failed try dies with this frame
        if k <= 1:
            lvalue, toks, g = grad_step(batch)
            _eval_gradient(rows, lvalue, toks, g)
            return lvalue, toks, g, None, [rows]
        ranges = micro_batch_ranges(batch, rows, k, chunk_weight is None)
        acc = lsum = wsum = tsum = None
        for a, b in ranges:
            lw, w, t, acc = chunk_step(_slice(batch, a, b, rows), acc)
            lsum = lw if lsum is None else lsum + lw
            wsum = w if wsum is None else wsum + w
            tsum = t if tsum is None else tsum + t
            _eval_gradient(b - a, lsum, wsum, tsum, acc)  # one micro-batch's activations at a time
        return lsum / wsum, tsum, acc, wsum, [b - a for a, b in ranges]

    def run_batch(batch, prev_grad, do_update, it):
        rows = _batch_rows(batch)
        k = guard.split_for_batch(it, rows)
        redos = 0
        while True:
            failed = None
            try:
                lvalue, toks, grad, scale, done = attempt(batch, rows, k)
            except Exception as exc:
                if not is_allocation_error(exc):
                    raise
                # the traceback holds the failed try's frame and with it its lazy arrays (the
                # partial gradient sum, the activations): dropped before the cache is cleared
                failed = exc.with_traceback(None)
            if failed is None:
                break
            # window redo: prev_grad (the accumulation window's earlier batches) was evaluated at
            # the end of its batch and update_step has not run, so model, optimizer and prev_grad
            # are untouched; only this batch is recomputed, from its first micro-batch, and the
            # batch is the one already drawn (the iterator is not advanced again)
            k = guard.after_window_oom(failed, k, rows, it, redos)
            redos += 1
        for r in done:
            guard.micro_batch_done(r)
        grad_accum = update_step(grad, scale, prev_grad, do_update)
        if do_update:
            try:
                _eval_update(state)
            except Exception as exc:
                if not is_allocation_error(exc):
                    raise
                raise _update_oom(guard, exc, k, rows) from exc
        return lvalue, toks, grad_accum

    back = guard.guard.restored
    validation = guard.validation = GuardedEval(
        lambda: guard.monitor.micro_batches if guard.monitor is not None else 1, chunk_weight, guard.guard.fit_plan,
        eval_micro_batches=max(guard.options.eval_micro_batches, (back.eval_micro_batches or 1) if back else 1),
        on_redo=lambda message, it, k: guard.guard.recorder.decision(
            "oom_retry", message, it, warn=False, phase="validation", micro_batches=k))

    def evaluate(**kw):
        validation.iteration = guard._it + 1  # validation runs before the iteration's batch
        try:
            return validation.evaluate(**kw)
        finally:
            guard.guard.oom_retries += validation.oom_retries
            validation.oom_retries = 0

    def report_extra(ui, it, rank):
        mon = guard.monitor
        if mon is not None and mon.micro_batches > 1 and rank == 0:
            peak_gb = guard.peak_so_far() / 1e9
            _compat.print_muted(ui, f"memguard: k={mon.micro_batches} chunks per batch, peak {peak_gb:.3f} GB")

    def report_figures():
        # the iteration just run closes its record now, so the report carries its own figures (its
        # boundary is the next batch's, after the report); the monitor's sample keeps the number
        # the next boundary would give it
        guard.guard.end_step(guard._it, step=guard._it + 1)
        return guard.guard.figures

    try:
        batches = skip_batches(iterate_batches, start, val_dataset=val_dataset, args=args, world=world)
        train_loop(model, optimizer, train_dataset, val_dataset, args, loss, batches, training_callback,
                   state=state, run_batch=run_batch, world=world, evaluate=evaluate, first_iteration=start + 1,
                   on_update=lambda it: guard.after_update(it, optimizer), peak_memory=guard.peak_so_far,
                   report_extra=report_extra, report_figures=report_figures,
                   save_metadata=lambda it: guard_state_metadata(guard.guard, it, validation.k))
    finally:
        guard.stop(guard._it)
    return guard
