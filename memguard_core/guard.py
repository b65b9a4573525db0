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

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .errors import ConfigError
from .guard_preflight import PreflightMoment, SpecReader
from .probe_policy import Measure
from .monitor import MemoryEvent, MemoryMonitor
from .observe import RunRecorder
from .oom_recovery import OomRecovery
from .options import GuardOptions
from .preflight import Preflight, default_budget
from .process_peak import restore_process_peak
from .step_heap import StepHeap

__all__ = ["Guard", "GuardAttributes"]

class Guard(PreflightMoment, StepHeap, OomRecovery):
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
        restored, restored_from: the ``GuardState`` a resumed start took back instead of deciding
            again (:meth:`restore_state`, :meth:`export_state`; docs/lifecycle.md, "What a resume
            restores") and where it was read; None when the start decided afresh.
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
              plan_hint: str = "", measure: Optional[Measure] = None) -> MemoryMonitor:
        """Preflight, budget, plan applied, monitor started. Call once, before the first forward.
        After :meth:`restore_state` (a resumed run) the saved micro-batches, budget and activation
        checkpointing are taken back instead of running the preflight.

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
            measure: the adapter's in-process measurement (``memguard_core.probe_policy.Measure``),
                run by the preflight as ``preflight_probe`` says; None: the estimate alone.

        Returns:
            the started monitor.

        Raises:
            DoesNotFitError: with ``fail_fast``, when nothing fits or the plan needs a change that
                cannot be applied in place.
            ConfigError: with ``fail_fast``, when the preflight cannot read the run.
        """
        opts = self.options
        self.start_time = time.time()
        # a new start (Lightning: a second fit) reads the budget and plans afresh, unless a resume
        # handed it the state saved with its checkpoint (restore_state)
        self.budget_bytes, self.preflight, self._nothing_fits_line = opts.budget_bytes, None, None
        self._specs, self.restored, self.restored_from, self._checkpointing_on = None, None, None, False
        rows = self._rows = max(1, int(rows))
        k = opts.micro_batches
        restored = self._take_restored(rows)
        if restored is not None:
            k = max(k, self._apply_restored(restored, read_specs, enable_checkpointing))
        elif opts.preflight and read_specs is not None:
            k = max(k, self._run_preflight(read_specs, enable_checkpointing, rows, plan_hint, measure))
        if restored is None:
            self._planned_k = min(k, rows)
        self._pin_mmap_threshold()
        budget = self.budget_bytes
        if budget is None:
            budget = default_budget(opts.device, opts.safety_ratio)
        self.budget_bytes = int(budget)
        if before_monitor is not None:
            planned_peak = (self.preflight.best_peak_bytes if self.preflight
                            else restored.planned_peak_bytes if restored else None)
            before_monitor(self.budget_bytes, planned_peak)
        k = min(k, rows)
        self.monitor = MemoryMonitor(self.budget_bytes, device=opts.device, safety_ratio=opts.safety_ratio,
                                     thresholds=opts.thresholds, interval_s=opts.monitor_interval_s, micro_batches=k,
                                     max_micro_batches=rows, on_event=self._on_event, grow=self.grow,
                                     clean_fn=clean_fn, peak_fn=peak_fn,
                                     planned_micro_batches=min(self._planned_k, k),
                                     reset_peak_rss=opts.reset_peak_rss)
        if restored is not None:   # the step peaks measured at each k: what growing back predicts from
            self.monitor.peak_at_micro_batches.update(restored.peak_at_micro_batches)
        if k > 1:
            self.log.info("memguard: %d micro-batches per batch (batch of %d rows -> %d-row micro-batches; "
                          "effective batch unchanged)", k, rows, -(-rows // k))
        self._record_start(k)
        self.monitor.prime()
        self.monitor.start()
        return self.monitor

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
        at the next batch boundary, after the log line. With a monitor, ``memguard_max_usage`` too:
        the largest usage of the run so far, this step's included (the monitor's own maximum is
        updated at the next decision, one step later)."""
        figs = dict(self.recorder.last_figures)
        if figs and self.monitor is not None:
            figs["memguard_max_usage"] = round(max(self.monitor.max_usage, self.recorder.max_usage), 4)
        return figs

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
                self.recorder.next_micro_batches(mon.micro_batches)
            else:
                self.recorder.step(done, mon.last_step_figures, mon.micro_batches, mon.level.name.lower())
        except Exception:
            self.log.debug("memguard: step not recorded", exc_info=True)
        k = mon.micro_batches
        if agree:
            k = self.agreed(k)
            if k > mon.micro_batches:
                mon.request_micro_batches(k, "another rank asked for it", step)
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
            self.recorder.step(completed, mon.last_step_figures, mon.micro_batches, mon.level.name.lower())
            self._ended_step = completed
        except Exception:
            self.log.debug("memguard: step end not recorded", exc_info=True)
        self._trim_step_heap()

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
            the summary (None when no monitor ran): ``micro_batches`` (final micro-batches per batch),
            ``max_usage`` (fraction of the budget), ``budget_bytes``, ``measured_peak_bytes``,
            ``process_peak_rss_bytes`` (the process's peak resident set over its life, what
            ``ru_maxrss`` would read without the per-step resets; docs/monitor.md),
            ``estimated_peak_bytes`` (planned settings; None without a preflight),
            ``requested_peak_bytes`` (the requested settings; both include what the process already
            held at train start beyond the estimate, so they compare), ``optimizer_steps``, ``samples_per_step`` (distinct values),
            ``oom_retries``, ``events`` (how many decisions: the preflight's change and the monitor's),
            ``event_log`` (the JSONL path, None without
            one), then ``extra``.
        """
        mon, pf, log = self.monitor, self.preflight, self.recorder.events
        if mon is None:
            return None
        try:
            mon.stop()
            # the last batch's peak: already read where end_step closed the last step
            measured = mon.final_sample() if self._ended_step is None else (mon.max_step_peak_bytes or None)
            if measured_bytes is not None:
                measured = measured_bytes()
            process_peak = restore_process_peak()   # after the last reset: VmHWM back to the run's peak
            self.summary = {
                "micro_batches": mon.micro_batches,
                "max_usage": round(max(mon.max_usage, self.recorder.max_usage), 4),
                "budget_bytes": mon.budget_bytes,
                "measured_peak_bytes": measured,
                "process_peak_rss_bytes": process_peak,
                "estimated_peak_bytes": pf.best_peak_bytes if pf else None,
                "requested_peak_bytes": pf.requested_peak_bytes if pf else None,
                "optimizer_steps": int(optimizer_steps),
                "samples_per_step": sorted({int(s) for s in self.samples_per_step}),
                "oom_retries": self.oom_retries,
                "events": len(self.events) + int(self.preflight_decided),
                "event_log": log.path if log is not None and log.enabled else None,
                **extra,
            }
            self.log.info("memguard summary: %s", self.summary)
            last = dict(mon.last_step_figures or {"current": None, "budget": mon.budget_bytes})
            if measured_bytes is not None:
                last["peak"] = measured
            self.recorder.step(int(optimizer_steps), last, mon.micro_batches, mon.level.name.lower())
            self.recorder.finish(self.summary)
            # a recovered OOM (training or evaluation) makes the measured peak a failed attempt's
            # ... and a lower bound (reset_peak_rss off, no step past the peak before the start) is none
            if (not self.oom_retries and not extra.get("eval_oom_retries")
                    and (measured_bytes is not None or mon.sampler.peaks_exact)):
                from .calibration import record_preflight

                record_preflight(pf, measured, micro_batches=mon.micro_batches)
        except Exception:
            self.log.warning("memguard: could not finish the run summary", exc_info=True)
        return self.summary

    def stop(self) -> None:
        """Stop the monitor's thread (the run is leaving training without :meth:`finish`; VmHWM is
        not raised back then: no memory is written on the way out of a failed run)."""
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
