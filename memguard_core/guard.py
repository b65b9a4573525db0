"""One guarded training run's lifecycle, the same for every adapter (HF ``Trainer``, Lightning,
mlx_lm) and usable from a plain training loop: options -> preflight -> budget -> apply the plan ->
monitor -> OOM re-split -> run summary and calibration record. One rule per moment, written down in
docs/lifecycle.md.

An adapter gives the guard what only it knows -- how to read the run's ``ModelSpec`` /
``TrainSpec``, how to turn activation checkpointing on, the rows of a batch -- and keeps its
framework's hooks: where a batch comes from, how one micro-batch's forward and backward run there,
how figures reach its logger.

Imports no framework: the adapters pass callables.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import frameworks
from .errors import ConfigError, DoesNotFitError
from .microbatch import free_caches, split_after_oom
from .monitor import MemoryEvent, MemoryMonitor
from .observe import RunRecorder
from .options import GuardOptions
from .preflight import Preflight, default_budget, plan_in_place, resident_bytes_for
from .window import MAX_WINDOW_REDOS, WindowRedo  # noqa: F401  (MAX_WINDOW_REDOS: public here too)

__all__ = ["Guard", "GuardAttributes", "RunSummary", "SpecReader", "MAX_WINDOW_REDOS", "fix_mmap_threshold"]

#: ``read_specs() -> (ModelSpec, TrainSpec)``: the adapter's reading of the run it guards.
SpecReader = Callable[[], Tuple[Any, Any]]


#: glibc's mmap threshold was fixed in this process (:func:`fix_mmap_threshold`): it cannot be
#: undone, so a second start (Lightning's second ``fit``) neither sets nor logs it again.
_MMAP_THRESHOLD_PINNED = False


def fix_mmap_threshold(model_spec: Any, train_spec: Any) -> bool:
    """For a run :func:`memguard_core.estimator.trainable.routed_half_precision_on_cpu` names (a mixture-of-experts
    model computing in bf16 / fp16 on a CPU), fix glibc's mmap threshold at
    ``probes.MOE_MMAP_THRESHOLD_BYTES`` for the rest of the process (``probes.pin_mmap_threshold``),
    once per process. What the guard does at train start under ``GuardOptions.trim_heap``; the
    bench's training children call it to measure a guarded run.

    Returns:
        True when this call fixed it; False for other runs, when it was fixed before, or where
        the C library cannot (``probes.pin_mmap_threshold`` never raises).
    """
    global _MMAP_THRESHOLD_PINNED
    from .probes import pin_mmap_threshold
    from .estimator.trainable import routed_half_precision_on_cpu

    if _MMAP_THRESHOLD_PINNED or not routed_half_precision_on_cpu(model_spec, train_spec):
        return False
    _MMAP_THRESHOLD_PINNED = pin_mmap_threshold()
    return _MMAP_THRESHOLD_PINNED


class RunSummary(dict):
    """The run summary (a dict). The MLX adapter's old key names still read, with a
    ``DeprecationWarning``: ``optimizer_updates`` (``optimizer_steps``), ``alloc_retries``
    (``oom_retries``); they are not among the keys."""

    RENAMED = {"optimizer_updates": "optimizer_steps", "alloc_retries": "oom_retries"}

    def __missing__(self, key: str) -> Any:
        if key in self.RENAMED:
            from ._deprecation import warn_renamed

            warn_renamed(key, self.RENAMED[key])
            return self[self.RENAMED[key]]
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        """``dict.get``, old key names included."""
        try:
            return self[key]
        except KeyError:
            return default


class Guard(WindowRedo):
    """The lifecycle of one guarded run (see the module doc and docs/lifecycle.md).

    Args:
        options: the validated :class:`memguard_core.options.GuardOptions`.
        log: where the guard's lines go (the adapter's logger, e.g. ``memguard.hf``).
        on_event: called with every ``MemoryEvent`` after it is recorded in ``events`` (may run on
            the monitor's thread).

    Attributes:
        options: the options.
        grow: the ``GrowPolicy`` the monitor gets (from ``options.grow``; settable before start).
        budget_bytes: the budget in bytes (``options.budget_bytes`` until :meth:`start` resolves it).
        preflight: the ``Preflight`` (None without one, or when it failed).
        monitor: the ``MemoryMonitor`` once started.
        events: every ``MemoryEvent`` as a dict.
        micro_batch_rows: rows (packed batches: sequences) of every micro-batch forward that ran
            (torch adapters: a failed one included; MLX, whose failures surface when the gradient
            is evaluated: the micro-batches that went through).
        samples_per_step: rows per optimizer step.
        oom_retries: out-of-memory errors recovered by a re-split.
        split_disabled_reason: why the adapter cannot cut batches in place (None: it can).
        summary: the run summary after :meth:`finish`.
    """

    def __init__(self, options: GuardOptions, *, log: Optional[logging.Logger] = None,
                 on_event: Optional[Callable[[MemoryEvent], None]] = None):
        if not isinstance(options, GuardOptions):
            raise ConfigError("options", "a memguard_core.options.GuardOptions", options)
        if on_event is not None and not callable(on_event):
            raise ConfigError("on_event", "a callable, or None", on_event)
        self.options = options
        self.log = log or logging.getLogger("memguard")
        self.grow = options.grow
        self.budget_bytes: Optional[int] = options.budget_bytes
        self.preflight: Optional[Preflight] = None
        self._nothing_fits_line: Optional[str] = None   # the preflight's decision when nothing fits
        self._plan_budget: Optional[int] = None         # the budget plan() planned against, bytes
        self.monitor: Optional[MemoryMonitor] = None
        self.events: List[Dict[str, Any]] = []
        self.micro_batch_rows: List[Any] = []
        self.samples_per_step: List[int] = []
        self.oom_retries = 0
        self.split_disabled_reason: Optional[str] = None
        self.start_time: Optional[float] = None
        self.summary: Optional[Dict[str, Any]] = None
        self.recorder = RunRecorder(options, self.log)
        self._on_event_cb = on_event
        self._floor_redone = False   # this window already redone at one row per forward
        self._boundaries = 0         # micro_batches_for_step calls: the step records' path is in use
        self._ended_step: Optional[int] = None   # end_step sampled this step's last batch already
        self._trim_device: Optional[bool] = None   # trim_heap applies here (resolved at the first step end)
        self._specs: Optional[Tuple[Any, Any]] = None   # (ModelSpec, TrainSpec) the last plan() read
        self._unrecorded_end = 0   # end_step without batch boundaries: the last step count it trimmed at

    # ------------------------------------------------------------------ start
    def start(self, *, rows: int, read_specs: Optional[SpecReader] = None,
              enable_checkpointing: Optional[Callable[[], None]] = None,
              before_monitor: Optional[Callable[[int, Optional[int]], None]] = None,
              clean_fn: Optional[Callable[[], None]] = None,
              peak_fn: Optional[Callable[[], Optional[int]]] = None,
              plan_hint: str = "") -> MemoryMonitor:
        """Preflight, budget, plan applied, monitor started. Call once, before the first forward.

        Args:
            rows: rows of a batch (the micro-batches per batch never exceed it).
            read_specs: the adapter's ``() -> (ModelSpec, TrainSpec)``; None: no preflight.
            enable_checkpointing: turns activation checkpointing on in place; None: the model
                cannot (the planner then does not choose it).
            before_monitor: ``fn(budget_bytes, planned_peak_bytes or None)`` run after the budget
                is known and before the monitor starts (MLX memory limits).
            clean_fn, peak_fn: passed to ``MemoryMonitor`` (None: its defaults).
            plan_hint: how the user applies a planned micro-batch change where the adapter cannot
                split in place (e.g. Lightning's ``accumulate_grad_batches``), for the warning.

        Returns:
            the started monitor.

        Raises:
            DoesNotFitError: with ``fail_fast``, when nothing fits or the plan needs a change that
                cannot be applied in place.
            ConfigError: with ``fail_fast``, when the preflight cannot read the run.
        """
        opts = self.options
        self.start_time = time.time()
        # a new start (Lightning: a second fit) reads the budget and plans afresh
        self.budget_bytes, self.preflight, self._nothing_fits_line = opts.budget_bytes, None, None
        self._specs = None
        rows = max(1, int(rows))
        k = opts.micro_batches
        if opts.preflight and read_specs is not None:
            k = max(k, self._run_preflight(read_specs, enable_checkpointing, rows, plan_hint))
        self._pin_mmap_threshold()
        budget = self.budget_bytes
        if budget is None:
            budget = default_budget(opts.device, opts.safety_ratio)
        self.budget_bytes = int(budget)
        if before_monitor is not None:
            before_monitor(self.budget_bytes, self.preflight.best_peak_bytes if self.preflight else None)
        k = min(k, rows)
        self.monitor = MemoryMonitor(self.budget_bytes, device=opts.device, safety_ratio=opts.safety_ratio,
                                     thresholds=opts.thresholds, interval_s=opts.monitor_interval_s, split=k,
                                     max_split=rows, on_event=self._on_event, grow=self.grow,
                                     clean_fn=clean_fn, peak_fn=peak_fn)
        if k > 1:
            self.log.info("memguard: %d micro-batches per batch (batch of %d rows -> %d-row micro-batches; "
                          "effective batch unchanged)", k, rows, -(-rows // k))
        self._record_start(k)
        self.monitor.prime()
        self.monitor.start()
        return self.monitor

    def _record_start(self, k: int) -> None:
        """Open the run's records (event log, leak check, CUDA snapshots) and record the preflight's
        changes: one WARNING line and a ``preflight`` decision. Never raises."""
        try:
            from .probes import resolve_device

            self.recorder.start(resolve_device(self.options.device), self.budget_bytes)
            pf = self.preflight
            if self._nothing_fits_line is not None:   # _nothing_fits logged it at ERROR already
                self.recorder.decision("preflight", self._nothing_fits_line, step=0, warn=False, micro_batches=k)
            elif pf is not None and (pf.applied or pf.not_applied):
                done = sorted({c.reason for c in pf.applied})
                todo = sorted({c.reason for c in pf.not_applied})
                self.recorder.decision("preflight", "preflight changed the run: " + "; ".join(done)
                                       + (("; NOT applied (change it yourself): " + "; ".join(todo)) if todo else "")
                                       + f" (estimate {pf.estimate.peak_bytes / 2**30:.2f} GiB -> "
                                       f"{pf.best_peak_bytes / 2**30:.2f} GiB, budget {pf.budget_bytes / 2**30:.2f} GiB)",
                                       step=0, micro_batches=k)
        except Exception:
            self.log.warning("memguard: could not open the run records", exc_info=True)

    def _run_preflight(self, read_specs: SpecReader, enable_checkpointing: Optional[Callable[[], None]],
                       rows: int, plan_hint: str) -> int:
        """The preflight moment: returns the micro-batches per batch it asks for (1: none)."""
        opts = self.options
        try:
            self.preflight = pf = self.plan(read_specs, enable_checkpointing)
        except DoesNotFitError as exc:
            if opts.fail_fast:
                raise
            return self._nothing_fits(exc, enable_checkpointing, rows)
        except ConfigError as exc:
            if opts.fail_fast:
                raise
            self.log.warning("memguard: preflight skipped: %s; the runtime guard still runs", exc)
            return 1
        except Exception:
            self.log.warning("memguard: preflight failed; the runtime guard still runs", exc_info=True)
            return 1
        for line in pf.report_lines():
            self.log.info("%s", line)
        if pf.split_factor > 1 and self.split_disabled_reason is not None:
            ts = pf.plan.train_spec
            self.log.warning("memguard: the plan needs micro-batch %d x accumulation %d, which cannot be applied "
                             "in place here (%s)%s", ts.batch_size, ts.grad_accum,
                             self.split_disabled_reason.split(":")[0], plan_hint)
        if pf.not_applied and opts.fail_fast:
            raise DoesNotFitError(pf.shortfall_bytes, pf.budget_bytes, pf.best_peak_bytes,
                                  [c.reason for c in pf.not_applied])
        self.budget_bytes = pf.budget_bytes
        return pf.split_factor

    def plan(self, read_specs: SpecReader, enable_checkpointing: Optional[Callable[[], None]] = None) -> Preflight:
        """Estimate the run ``read_specs()`` describes, plan it against the budget (the option, else
        the default budget of its device) below the monitor's warning level, with what this
        process already holds counted, and turn activation checkpointing on when the plan asks
        for it. Starts nothing; :meth:`start` calls it for its preflight.

        Raises:
            ConfigError: the run cannot be read or a setting is invalid.
            DoesNotFitError: nothing in the allowed search fits.
        """
        opts = self.options
        model_spec, train_spec = read_specs()
        # the estimate is of the run as guarded: with or without the step-end heap trim
        train_spec = train_spec.replace(heap_trim=bool(opts.trim_heap))
        self._specs = (model_spec, train_spec)   # read even when nothing fits (the mmap threshold needs them)
        budget = opts.budget_bytes
        if budget is None:
            budget = default_budget(train_spec.device if opts.device == "auto" else opts.device, opts.safety_ratio)
        self._plan_budget = int(budget)   # what a nothing-fits line names (the error has the target)
        apply = tuple(a for a in opts.apply if a != "grad_checkpoint" or enable_checkpointing is not None)
        # plan below the warning level: a run planned up to the budget would sit at the critical level
        # from its first step and be split further for nothing
        pf = plan_in_place(model_spec, train_spec, budget, apply=apply, plan_fraction=opts.thresholds.warning,
                           resident_bytes=resident_bytes_for(train_spec))
        if pf.checkpointing_planned and enable_checkpointing is not None:
            enable_checkpointing()
        return pf

    def _nothing_fits(self, exc: DoesNotFitError, enable_checkpointing: Optional[Callable[[], None]],
                      rows: int) -> int:
        """Nothing fits: the closest the allowed in-place steps get (one-row micro-batches,
        checkpointing on), the runtime guard watching."""
        apply = self.options.apply
        k = rows if "micro_batch" in apply else 1
        checkpointing = "grad_checkpoint" in apply and enable_checkpointing is not None
        if checkpointing:
            try:
                enable_checkpointing()
            except Exception:
                checkpointing = False
                self.log.warning("memguard: could not enable activation checkpointing", exc_info=True)
        budget = self._plan_budget or exc.budget_bytes
        self._nothing_fits_line = (
            f"preflight: nothing fits the budget of {budget / 2**30:.2f} GiB: the smallest plan is "
            f"{exc.shortfall_bytes / 2**30:.2f} GiB over the planning target ("
            f"{self.options.thresholds.warning:.0%} of the budget, the monitor's warning level, less what the "
            f"process already holds). Training continues with {k} micro-batches per batch"
            + (" and activation checkpointing" if checkpointing else "") + ", the runtime guard watching. Try: "
            + "; ".join(exc.suggestions))
        self.log.error("memguard: %s", self._nothing_fits_line)
        return k

    def _on_event(self, event: MemoryEvent) -> None:
        self.events.append(event.to_dict())  # may run on the monitor's thread: only appends here
        try:
            self.recorder.event(event)
        except Exception:
            self.log.debug("memguard: event not recorded", exc_info=True)
        if self._on_event_cb is not None:
            self._on_event_cb(event)

    @property
    def figures(self) -> Dict[str, Any]:
        """The last closed optimizer step's figures under the standard names
        (:data:`memguard_core.observe.FIGURE_NAMES`), for the adapter's logger; {} before one. An
        adapter calls :meth:`end_step` before its log hook reads them: a step is otherwise closed
        at the next batch boundary, after the log line."""
        return dict(self.recorder.last_figures)

    # ------------------------------------------------------------------ per step
    def micro_batches_for_step(self, step: Optional[int], *, agree: bool = True,
                               completed: Optional[int] = None) -> int:
        """Sample memory at a step (batch) boundary and return the micro-batches for this batch:
        the monitor's k, with ``agree`` the MAX over ranks (:meth:`agreed`; the monitor is raised to
        it). 1 without a monitor. ``completed``: the optimizer steps (MLX: iterations) done before
        this batch, for the run records (default ``step``). Every boundary decides on a fresh
        sample (the budget as it is now, a co-tenant included); after :meth:`end_step` the step's
        record is already written, and the peak it read is weighed again here. Never raises."""
        mon = self.monitor
        if mon is None:
            return 1
        self._boundaries += 1
        done = step if completed is None else completed
        recorded = self._ended_step is not None and done == self._ended_step
        self._ended_step = None
        mon.step_sample(step)
        try:
            if recorded:
                self.recorder.next_micro_batches(mon.split)
            else:
                self.recorder.step(done, mon.last_step_figures, mon.split, mon.level.name.lower())
        except Exception:
            self.log.debug("memguard: step not recorded", exc_info=True)
        k = mon.split
        if agree:
            k = self.agreed(k)
            if k > mon.split:
                mon.request_split(k, "another rank asked for it", step)
        return k

    def end_step(self, completed: Optional[int], *, step: Optional[int] = None) -> None:
        """The optimizer step (MLX: iteration) ``completed`` has just finished (``completed`` =
        steps done, as :meth:`micro_batches_for_step` counts them): read the step's peak now
        (:meth:`MemoryMonitor.record_sample`, no decision) and close the step's record, so that
        :attr:`figures`, read by the adapter's log hook next, are this step's and not the one
        before. The decision stays at the next batch boundary, once per batch as without this
        call, on the budget as it is then and this peak. ``step``: accepted for the adapters'
        calls (MLX passes the next iteration's); the decision's step number is the boundary's.
        When the adapter samples outside :meth:`micro_batches_for_step` (no batch boundary:
        nothing would be recorded) only the heap trim runs, once per new ``completed``; a no-op
        when ``completed`` was already closed (Lightning's hook after a batch inside an
        accumulation window). Never raises."""
        mon = self.monitor
        if mon is None or completed is None:
            return
        if not self._boundaries:
            # the adapter samples outside micro_batches_for_step (Lightning's non-splitting paths):
            # nothing to record, but an optimizer step that ended still trims the heap, as the
            # preflight's estimate of a guarded run assumes (TrainSpec.heap_trim)
            if completed != self._unrecorded_end:
                self._unrecorded_end = completed
                self._trim_step_heap()
            return
        try:
            if self._ended_step == completed or completed == self.recorder.closed_step:
                return
            mon.record_sample()
            self.recorder.step(completed, mon.last_step_figures, mon.split, mon.level.name.lower())
            self._ended_step = completed
        except Exception:
            self.log.debug("memguard: step end not recorded", exc_info=True)
        self._trim_step_heap()

    def _pin_mmap_threshold(self) -> None:
        """``trim_heap``: :func:`fix_mmap_threshold` for the specs the preflight read (whether or
        not a plan fitted), before the first forward, logged when it fixes the threshold. The
        step-end trim returns what a step left; within a step, a bf16 MoE run's freed tensors would
        otherwise stay resident beside oneDNN's cache entries (docs/monitor.md, "The CPU heap
        between steps"). Without a preflight (``preflight=False``, or specs that could not be read)
        nothing is fixed. Never raises."""
        try:
            if not (self.options.trim_heap and self._specs is not None):
                return
            if fix_mmap_threshold(*self._specs):
                from .probes import MOE_MMAP_THRESHOLD_BYTES

                mib = MOE_MMAP_THRESHOLD_BYTES / 2**20
                self.log.info("memguard: glibc's mmap threshold fixed at %g MiB for this process (a mixture-of-"
                              "experts model in %s on the CPU: tensors of %g MiB and more go back to the kernel "
                              "when freed instead of staying in the heap as holes; GuardOptions(trim_heap=False) "
                              "leaves malloc alone)", mib, self._specs[1].dtype, mib)
        except Exception:
            self.log.debug("memguard: mmap threshold left alone", exc_info=True)

    def _trim_step_heap(self) -> None:
        """``trim_heap``: after the step's peak was read, glibc's free heap goes back to the kernel
        on a CPU device (``probes.trim_heap``). The sizes a step allocates change from step to step
        (mixture-of-experts routing, ragged batches): new sizes do not fit the holes the last step
        left, the heap grows, and the holes stay resident and count in RSS until trimmed
        (docs/monitor.md, "The CPU heap between steps"). Never raises."""
        try:
            if self._trim_device is None:
                from .probes import resolve_device

                # probes.trim_heap itself does nothing off glibc / Linux
                self._trim_device = bool(self.options.trim_heap and resolve_device(self.options.device) == "cpu")
            if self._trim_device:
                from .probes import trim_heap

                trim_heap()
        except Exception:
            self._trim_device = False
            self.log.debug("memguard: heap trim off", exc_info=True)

    def agreed(self, k: int) -> int:
        """The MAX of ``k`` over ``torch.distributed`` ranks (every rank must cut alike: FSDP /
        ZeRO-3 gathers would hang otherwise); ``k`` itself outside a process group, or with a
        warning when the all-reduce fails. Never raises."""
        try:
            return frameworks.agree_max(k)
        except Exception:
            self.log.warning("memguard: micro-batch all-reduce failed; using the local k", exc_info=True)
            return k

    def after_oom(self, exc: BaseException, k: int, units_left: int, step: Optional[int],
                  free: Callable[[], None] = free_caches) -> int:
        """After an out-of-memory error in a micro-batch's forward (nothing of it kept): the CUDA
        snapshot of the moment (:meth:`snapshot_oom`, with ``cuda_snapshots``), then double the
        micro-batches for the ``units_left`` rows (sequences) not yet processed, free memory with
        ``free`` and return the new k; counts ``oom_retries``.

        Raises:
            ``exc`` itself when a single row already failed (no split can help).
        """
        self.snapshot_oom(step)   # before anything is freed: the moment a user wants to see
        self._oom_snapshot_taken = False
        if self.monitor is not None:
            k_new = split_after_oom(self.monitor, exc, k, units_left, step, self.log, free=free)
        else:
            if units_left <= 1 or k >= units_left:
                raise exc
            k_new = min(max(2, 2 * k), units_left)
            gc.collect()
            free()
        self.oom_retries += 1
        return k_new

    _oom_snapshot_taken = False

    def snapshot_oom(self, step: Optional[int], *, peer: bool = False) -> None:
        """An out-of-memory error was caught: with ``cuda_snapshots`` on, dump this rank's allocator
        snapshot (``rank{r}_step{n}_oom.pickle``, n = optimizer steps completed, as the event
        log's ``oom_retry`` record) before anything is freed. :meth:`after_oom` and
        :meth:`after_window_oom` call it first; an adapter may call it earlier, where the failed
        step's tensors are still referenced (its ``except`` block), and the guard's own call for
        that failure then dumps nothing. ``peer``: another rank failed (``_peer-oom``). Never
        raises."""
        if self._oom_snapshot_taken:
            return
        self._oom_snapshot_taken = True
        try:
            self.recorder.oom(step, peer=peer)
        except Exception:
            self.log.debug("memguard: OOM snapshot failed", exc_info=True)

    def oom_handled(self) -> None:
        """The caught out-of-memory error has been dealt with (an adapter's own handling, e.g. an
        evaluation re-split): the next one dumps its snapshot again (:meth:`snapshot_oom`)."""
        self._oom_snapshot_taken = False

    # ------------------------------------------------------------------ end
    def finish(self, optimizer_steps: int, *, measured_bytes: Optional[Callable[[], Optional[int]]] = None,
               **extra: Any) -> Optional[Dict[str, Any]]:
        """End the run: stop the monitor, take the final sample (the last micro-batch's peak), log the
        summary and record the preflight's estimate against the measured peak in the calibration
        store (only for a run that ran the planned settings: ended at the planned micro-batches and
        had no OOM retry, whose measured peak is the limit's, not the settings'). Never raises.

        Args:
            optimizer_steps: optimizer steps done.
            measured_bytes: the adapter's peak counter (default: the monitor's step peaks).
            extra: more summary keys.

        Returns:
            the summary (None when no monitor ran): ``split`` (final micro-batches per batch),
            ``max_usage`` (fraction of the budget), ``budget_bytes``, ``measured_peak_bytes``,
            ``estimated_peak_bytes`` (planned settings; None without a preflight),
            ``requested_peak_bytes`` (the requested settings; both include what the process already
            held at train start beyond the estimate, so they compare), ``optimizer_steps``, ``samples_per_step`` (distinct values),
            ``oom_retries``, ``events`` (how many), ``event_log`` (the JSONL path, None without
            one), then ``extra``.
        """
        mon, pf = self.monitor, self.preflight
        if mon is None:
            return None
        try:
            mon.stop()
            # the last batch's peak: already read where end_step closed the last step
            measured = mon.final_sample() if self._ended_step is None else (mon.max_step_peak_bytes or None)
            if measured_bytes is not None:
                measured = measured_bytes()
            self.summary = RunSummary({
                "split": mon.split,
                "max_usage": round(mon.max_usage, 4),
                "budget_bytes": mon.budget_bytes,
                "measured_peak_bytes": measured,
                "estimated_peak_bytes": pf.best_peak_bytes if pf else None,
                "requested_peak_bytes": int(pf.estimate.peak_bytes) + pf.resident_extra_bytes if pf else None,
                "optimizer_steps": int(optimizer_steps),
                "samples_per_step": sorted({int(s) for s in self.samples_per_step}),
                "oom_retries": self.oom_retries,
                "events": len(self.events),
                "event_log": self.recorder.events.path if self.recorder.events is not None else None,
                **extra,
            })
            self.log.info("memguard summary: %s", self.summary)
            last = dict(mon.last_step_figures or {"current": None, "budget": mon.budget_bytes})
            if measured_bytes is not None:
                last["peak"] = measured
            self.recorder.step(int(optimizer_steps), last, mon.split, mon.level.name.lower())
            self.recorder.finish(self.summary)
            # a recovered OOM (training or evaluation) makes the measured peak a failed attempt's
            if not self.oom_retries and not extra.get("eval_oom_retries"):
                from .calibration import record_preflight

                record_preflight(pf, measured, split=mon.split)
        except Exception:
            self.log.warning("memguard: could not finish the run summary", exc_info=True)
        return self.summary

    def stop(self) -> None:
        """Stop the monitor's thread (the run is leaving training without :meth:`finish`)."""
        if self.monitor is not None:
            self.monitor.stop()


def _from_guard(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.guard, name), doc=doc)


class GuardAttributes:
    """The guard's state under the same names on every adapter (HF and Lightning
    ``MemGuardCallback``, ``MlxGuard``), read through the adapter's ``guard`` attribute."""

    guard: Guard
    monitor = _from_guard("monitor", "The run's ``MemoryMonitor`` (None before the start).")
    preflight = _from_guard("preflight", "The ``Preflight`` (None without one, or when it failed).")
    events = _from_guard("events", "Every ``MemoryEvent`` of the run, as dicts.")
    micro_batch_rows = _from_guard("micro_batch_rows", "Rows (packed: sequences) of each micro-batch forward.")
    samples_per_step = _from_guard("samples_per_step", "Rows per optimizer step.")
    oom_retries = _from_guard("oom_retries", "Out-of-memory errors recovered by a re-split.")
    split_disabled_reason = _from_guard("split_disabled_reason", "Why batches are not cut in place (None: they are).")
    summary = _from_guard("summary", "The run summary (``Guard.finish``), None before the end.")
    budget_bytes = _from_guard("budget_bytes", "The budget in bytes (resolved at the start).")
    grow = property(lambda self: self.guard.grow, lambda self, value: setattr(self.guard, "grow", value),
                    doc="The monitor's ``GrowPolicy`` (None: never grow back); set it before training starts.")
