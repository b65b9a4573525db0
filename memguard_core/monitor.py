"""Runtime memory monitor: samples memory at every training step and in a background thread,
and keeps the run under its budget by asking for a clean or a finer split of each batch.

:class:`MemoryMonitor` is what the adapters use. It is built from two parts:

* the decisions, pure (:mod:`memguard_core.monitor_policy`): levels 85 / 90 / 95 % with
  hysteresis, PSI episodes, growing back, and the one way k rises;
* the reads (:mod:`memguard_core.monitor_sampler`): the device's step reader from
  :mod:`memguard_core.probes` and the background thread.

The monitor decides when to read what, hands the figures to the decisions, and acts on what they
return: it cleans caches (:func:`default_clean` unless given another), records and logs the
events, and forwards them to the adapter. The adapters read :attr:`MemoryMonitor.micro_batches` and
split their batches. Nothing here raises into training: a failing probe or callback is logged once
and skipped. The design, its rules and their reasons: docs/monitor.md.
"""

from __future__ import annotations

import gc
import logging
import math
from typing import Callable, List, Optional

from . import frameworks
from .errors import ConfigError, require_fraction, require_int, require_number
from .monitor_policy import MicroBatchPolicy
from .monitor_pressure import (AllocRetryEpisodes, AllocRetryPolicy, MemorystatusEpisodes, MemorystatusPolicy,
                               PressureEpisodes, PsiPolicy)
from .monitor_types import Action, GrowPolicy, Level, MemoryEvent, Thresholds
from .monitor_sampler import SamplerThread, StepSampler
from .monitor_signals import FULL_SAMPLE_MAX_AGE_S, PressureSignals, pressure_kind

__all__ = ["MemoryMonitor", "Level", "Action", "Thresholds", "PsiPolicy", "GrowPolicy",
           "MemoryEvent", "MicroBatchPolicy", "PressureEpisodes", "StepSampler", "SamplerThread",
           "default_clean", "FULL_SAMPLE_MAX_AGE_S", "MemorystatusPolicy", "MemorystatusEpisodes",
           "pressure_kind", "AllocRetryPolicy", "AllocRetryEpisodes"]

logger = logging.getLogger("memguard.monitor")


def _on(part: str, name: str, doc: str) -> property:
    """A monitor attribute kept by one of its parts (``policy`` or ``sampler``), read and set there."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


def _check_args(*, budget_bytes, device, interval_s, micro_batches, max_micro_batches, thresholds, psi, memorystatus,
                alloc_retries, grow, planned_micro_batches, clean_fn, on_event, probe_fn, peak_fn, live_fn,
                reset_peak_rss=True) -> None:
    """:class:`MemoryMonitor`'s arguments checked; a ConfigError names the first bad one."""
    if not isinstance(reset_peak_rss, bool):
        raise ConfigError("reset_peak_rss", "True or False", reset_peak_rss)
    require_int("budget_bytes", budget_bytes, "a positive integer number of bytes")
    require_number("interval_s", interval_s, "a number of seconds >= 0", lo=0.0)
    require_int("micro_batches", micro_batches, "an integer >= 1")
    require_int("max_micro_batches", max_micro_batches, "an integer >= 1, or None", allow_none=True)
    if thresholds is not None and not isinstance(thresholds, Thresholds):
        raise ConfigError("thresholds", "a memguard_core.monitor.Thresholds", thresholds)
    if psi is not None and not isinstance(psi, PsiPolicy):
        raise ConfigError("psi", "a memguard_core.monitor.PsiPolicy, or None", psi)
    if memorystatus is not None and not isinstance(memorystatus, MemorystatusPolicy):
        raise ConfigError("memorystatus", "a memguard_core.monitor.MemorystatusPolicy, or None",
                          memorystatus)
    if alloc_retries is not None and not isinstance(alloc_retries, AllocRetryPolicy):
        raise ConfigError("alloc_retries", "a memguard_core.monitor.AllocRetryPolicy, or None", alloc_retries)
    if grow is not None and not isinstance(grow, GrowPolicy):
        raise ConfigError("grow", "a memguard_core.monitor.GrowPolicy, or None", grow)
    require_int("planned_micro_batches", planned_micro_batches, "an integer >= 1, or None", allow_none=True)
    from .probes import DEVICE_CHOICES, DEVICE_RE
    if not isinstance(device, str) or DEVICE_RE.match(device) is None:
        raise ConfigError("device", DEVICE_CHOICES, device)
    for name, fn in (("clean_fn", clean_fn), ("on_event", on_event), ("probe_fn", probe_fn),
                     ("peak_fn", peak_fn), ("live_fn", live_fn)):
        if fn is not None and not callable(fn):
            raise ConfigError(name, "a callable, or None", fn)


class MemoryMonitor(PressureSignals):
    """Samples memory, classifies pressure and keeps the current decision (micro-batches per batch k).

    Args:
        budget_bytes: the memory the training process may use at most (bytes), e.g. from
            ``plan.budget_from_available``. Must be > 0.
        device: probe device (``auto`` | ``cpu`` | ``cuda`` | ``cuda:<index>`` | ``mlx`` | ``mps``),
            see ``memguard_core.probes``.
        safety_ratio: fraction of (process + available) usable when capacity shrinks at runtime.
        thresholds: ``Thresholds``.
        interval_s: background sampling period in seconds; ``0`` disables the thread.
        micro_batches: the initial micro-batches per batch k (>= 1), e.g. the plan's ``micro_batches``.
        max_micro_batches: upper bound for k (the adapter sets it to the micro-batch size: rows cannot be
            split further than one row each).
        clean_fn: callable doing the cache clean (default: :func:`default_clean`).
        on_event: callable receiving every ``MemoryEvent`` (the adapter forwards to its logger).
        probe_fn: ``probe_fn(cheap: bool) -> MemorySnapshot``; defaults to the device's step
            reader (``memguard_core.probes.step_reader(device)``).
        peak_fn: ``peak_fn() -> Optional[int]``: the process peak since the last call, resetting it
            (default: the probe's ``process_peak_bytes`` followed by the reader's peak reset).
        live_fn: ``live_fn() -> Optional[int]``: bytes held by live allocations, read before and
            after a critical clean at a step sample (default: the reader's, ``probes.live_bytes``;
            None, e.g. CPU off Linux, credits the clean with nothing: split at once).
        psi: :class:`PsiPolicy` for the pressure early warning on Linux (PSI stall shares,
            background samples only); ``None`` turns it off.
        memorystatus: :class:`MemorystatusPolicy`, the same early warning on macOS (share of
            memory in use, the kernel's pressure level, swap activity); ``None`` turns it off.
            Each snapshot's pressure goes to its own platform's policy (:func:`pressure_kind`).
        grow: :class:`GrowPolicy` for halving k again once pressure has gone; ``None`` turns
            growing back off (k then only rises).
        planned_micro_batches: the k the preflight planned (default: ``micro_batches``). k goes below it only when
            measured peaks predict that the larger micro-batch fits (see :class:`MicroBatchPolicy`).
        alloc_retries: :class:`AllocRetryPolicy`: on a CUDA device, the caching allocator's
            ``num_alloc_retries`` rising over consecutive optimizer steps cleans, then splits
            (read from the step sample's counters, once per optimizer step); ``None`` turns it off.
        reset_peak_rss: restart VmHWM at every CPU step sample (default); False keeps it (``StepSampler``).

    Raises:
        ConfigError: invalid budget, device, ratio, thresholds, interval, micro_batches, max_micro_batches, psi,
            memorystatus, alloc_retries, grow (or ``grow.below`` above ``warning - hysteresis``), planned_micro_batches,
            reset_peak_rss (the error names the argument).
    """

    def __init__(self, budget_bytes: int, *, device: str = "auto", safety_ratio: float = 0.8,
                 thresholds: Optional[Thresholds] = None, interval_s: float = 0.5, micro_batches: int = 1,
                 max_micro_batches: Optional[int] = None, clean_fn: Optional[Callable[[], None]] = None,
                 on_event: Optional[Callable[[MemoryEvent], None]] = None,
                 probe_fn: Optional[Callable[[bool], object]] = None,
                 peak_fn: Optional[Callable[[], Optional[int]]] = None,
                 live_fn: Optional[Callable[[], Optional[int]]] = None,
                 psi: Optional[PsiPolicy] = PsiPolicy(),
                 grow: Optional[GrowPolicy] = GrowPolicy(), planned_micro_batches: Optional[int] = None,
                 memorystatus: Optional[MemorystatusPolicy] = MemorystatusPolicy(),
                 alloc_retries: Optional[AllocRetryPolicy] = AllocRetryPolicy(), reset_peak_rss: bool = True):
        _check_args(budget_bytes=budget_bytes, device=device, interval_s=interval_s, micro_batches=micro_batches,
                    max_micro_batches=max_micro_batches, thresholds=thresholds, psi=psi, memorystatus=memorystatus,
                    alloc_retries=alloc_retries, grow=grow, planned_micro_batches=planned_micro_batches, clean_fn=clean_fn,
                    on_event=on_event, probe_fn=probe_fn, peak_fn=peak_fn, live_fn=live_fn,
                    reset_peak_rss=reset_peak_rss)
        self.budget_bytes = budget_bytes
        self.device = device
        self.safety_ratio = require_fraction("safety_ratio", safety_ratio)
        self.interval_s = float(interval_s)
        #: the decisions (levels, k, PSI episodes, growing back)
        self.policy = MicroBatchPolicy(thresholds or Thresholds(), micro_batches=micro_batches, max_micro_batches=max_micro_batches,
                                  psi=psi, grow=grow, planned_micro_batches=planned_micro_batches,
                                  memorystatus=memorystatus, alloc_retries=alloc_retries)
        #: the reads of the device
        self.sampler = StepSampler(device, probe_fn=probe_fn, peak_fn=peak_fn, live_fn=live_fn,
                                   reset_rss_peak=reset_peak_rss)
        self.events: List[MemoryEvent] = []
        self.max_step_peak_bytes = 0
        self._clean_fn = clean_fn or default_clean
        self._on_event = on_event
        self._live_before_clean: Optional[int] = None
        self._failed: set = set()
        self._step: Optional[int] = None
        # the last step sample: (monotonic s, used bytes, budget bytes, seconds since the one before)
        self._last_step: Optional[tuple] = None
        #: the last step sample's figures, bytes: ``peak`` (of the step before it), ``current`` (the
        #: process figure at the sample: RSS on CPU), ``budget`` (effective); on CUDA also
        #: ``reserved_peak`` / ``allocated_peak`` (the allocator's peaks over the same window); None
        #: before the first
        self.last_step_figures: Optional[dict] = None
        # the CUDA counters read as the last step sample's window closed (None elsewhere)
        self._window = None
        self._retries_step: object = object()    # the optimizer step whose allocator counts were fed
        # the peak a record_sample read for the step it closed, which the next step_sample (the
        # decision before the next batch) still has to weigh: its own window starts after it
        self._carried_peak: Optional[int] = None
        self._last_full = -math.inf               # monotonic s of the last full background sample
        self._thread = SamplerThread(lambda: self.background_sample(),
                                     lambda exc: self._log_failure("background thread", exc))

    # the decision state, kept by the policy
    thresholds = _on("policy", "thresholds", "The level thresholds (:class:`Thresholds`).")
    max_micro_batches = _on("policy", "max_micro_batches", "Upper bound of k, or None.")
    psi = _on("policy", "psi", "The :class:`PsiPolicy`, or None.")
    memorystatus = _on("policy", "memorystatus", "The :class:`MemorystatusPolicy`, or None.")
    alloc_retries = _on("policy", "alloc_retries", "The :class:`AllocRetryPolicy`, or None.")
    grow = _on("policy", "grow", "The :class:`GrowPolicy`, or None.")
    planned_micro_batches = _on("policy", "planned_micro_batches", "The preflight plan's k.")
    level = _on("policy", "level", "The current :class:`Level`.")
    samples = _on("policy", "samples", "Samples classified so far (step and background).")
    max_usage = _on("policy", "max_usage", "The largest usage seen (fraction of the effective budget).")
    last_pressure = _on("policy", "last_pressure", "The last valid pressure reading (percent: PSI, "
                        "or the share in use on macOS), or None.")
    peak_at_micro_batches = _on("policy", "peak_at_micro_batches", "k -> the largest step peak measured at k (bytes).")
    _micro_batches = _on("policy", "_micro_batches", "k, set directly (tests set it to go back down).")
    _grow_failures = _on("policy", "_grow_failures", "Failed grow-backs in a row.")
    # the functions the reads go through, kept by the sampler (replaceable while running)
    _probe_fn = _on("sampler", "probe_fn", "``probe_fn(cheap)``, or None: the device's reader.")
    _peak_fn = _on("sampler", "peak_fn", "``peak_fn()``, or None.")
    _live_fn = _on("sampler", "live_fn", "``live_fn()``, or None.")

    # ----- decisions -----------------------------------------------------------------------------
    @property
    def micro_batches(self) -> int:
        """The current micro-batches per batch k (read on the hot path: one attribute read further)."""
        return self.policy._micro_batches

    def request_micro_batches(self, k: int, reason: str, step: Optional[int] = None) -> int:
        """Raise the micro-batches per batch to at least ``k`` (clamped to ``max_micro_batches``); returns the new k."""
        event = self.policy.request_micro_batches(k, reason, step=step, budget_bytes=self.budget_bytes)
        if event is not None:
            self._emit(event)
        return self.policy.micro_batches

    def effective_budget(self, snapshot) -> int:
        """min(budget, (process + available) x safety_ratio), in bytes."""
        return self._budget_for(getattr(snapshot, "process_bytes", 0) + getattr(snapshot, "available_bytes", 0))

    def _budget_for(self, capacity: int) -> int:
        """min(budget, capacity x safety_ratio); the budget itself when ``capacity`` (process +
        available, bytes) is unknown (<= 0)."""
        if capacity <= 0:
            return self.budget_bytes
        return int(min(self.budget_bytes, capacity * self.safety_ratio))

    def observe(self, used_bytes: int, budget_bytes: int, *, step: Optional[int], source: str) -> Action:
        """Classify one sample, update the decision and act on it. Returns the action taken.

        ``used_bytes`` and ``budget_bytes`` in bytes; ``budget_bytes`` > 0. A ``step`` sample's
        ``used_bytes`` is the peak of the micro-batch just run (at the k read after the previous
        step sample); step samples also drive growing back (:class:`GrowPolicy`). A clean or a
        split cleans caches (a split is asked because memory is short: what the allocators keep
        is handed back too).
        """
        event = self.policy.observe(used_bytes, budget_bytes, step=step, source=source)
        if event is None:
            return Action.NONE
        self._emit(event)
        if event.action in (Action.CLEAN, Action.SPLIT):
            if event.action is Action.CLEAN and source == "step":
                self._live_before_clean = self._live()   # judged by _more_micro_batches_if_clean_fell_short
            self._safe(self._clean_fn, "clean")
        return event.action

    def predict_peak(self, k: int) -> Optional[int]:
        """Predicted step peak (bytes) at ``k`` micro-batches per batch (:meth:`MicroBatchPolicy.predict_peak`)."""
        return self.policy.predict_peak(k)

    # ----- step samples --------------------------------------------------------------------------
    def step_sample(self, step: Optional[int] = None) -> Action:
        """Per-training-step check (the hot path): cheap counters only, no allocation on the
        device, no synchronisation, nothing proportional to the model's size. Never raises."""
        self._step = step
        try:
            now, rss, used, capacity = self._read_step()
            if self._carried_peak is not None:
                used, self._carried_peak = max(used, self._carried_peak), None
            budget = self._budget_for(capacity)
            prev = self._last_step
            self._last_step = (now, used, budget, now - prev[0] if prev is not None else math.inf)
            self.last_step_figures = self._figures(used, rss, budget)
            action = self.observe(used, budget, step=step, source="step")
            if action is Action.CLEAN:
                action = self._more_micro_batches_if_clean_fell_short(rss, used, budget, step)
            retry_action = self._step_alloc_retries(step, used, budget, action is Action.NONE)
            return action if action is not Action.NONE else retry_action
        except Exception as exc:  # a probe failure never reaches training
            self._log_failure("step_sample", exc)
            return Action.NONE

    def _read_step(self):
        """The sampler's step figures, the largest peak kept (and, on CUDA, the counters read as
        the window closed)."""
        figs = self.sampler.read_step()
        self._window = self.sampler.take_window()
        if figs[2] > self.max_step_peak_bytes:
            self.max_step_peak_bytes = figs[2]
        return figs

    def _figures(self, used: int, rss: int, budget: int) -> dict:
        """:attr:`last_step_figures` of a sample (bytes): with the CUDA window's peaks where read."""
        out = {"peak": int(used), "current": int(rss), "budget": int(budget)}
        w = self._window
        if w is not None:
            out["reserved_peak"], out["allocated_peak"] = int(w.peak_reserved), int(w.peak_allocated)
        return out

    def _more_micro_batches_if_clean_fell_short(self, rss_before: int, used: int, budget: int, step: Optional[int]) -> Action:
        """After a critical clean at a step sample: the live bytes and the RSS are read again, and
        the policy splits now when the next micro-batch's predicted peak is still critical
        (:meth:`MicroBatchPolicy.micro_batches_after_clean`). Only freed *live* memory is credited: cached
        blocks and trimmed heap lower the RSS, but the next micro-batch allocates them again."""
        before, self._live_before_clean = self._live_before_clean, None
        after = self.sampler.probe(True)
        rss_freed = max(0, int(rss_before) - int(after.process_bytes))
        live_after = self._live()
        live_freed = None if before is None or live_after is None else max(0, before - live_after)
        freed = 0 if live_freed is None else min(rss_freed, live_freed)
        event = self.policy.micro_batches_after_clean(int(used) - freed, budget, step=step, rss_freed=rss_freed,
                                              live_freed=live_freed)
        if event is None:
            return Action.CLEAN
        self._emit(event)
        return Action.SPLIT

    def _live(self) -> Optional[int]:
        """Live bytes, None when unknown. Never raises."""
        try:
            return self.sampler.live()
        except Exception as exc:
            self._log_failure("live_bytes", exc)
            return None

    def prime(self) -> None:
        """Reset the peak counter at train start, so the first step's sample measures that step and
        not the model loading before it. Never raises."""
        try:
            self.sampler.prime()
        except Exception as exc:
            self._log_failure("prime", exc)

    def record_sample(self) -> None:
        """Read (and reset) the peak of the step that just ended, for its record
        (:attr:`last_step_figures`), without deciding anything. The decision stays with the next
        :meth:`step_sample`, right before the next batch, which weighs this peak too (it predicts
        the next batch's) against the budget as it is then: a co-tenant that arrives between the
        two is seen before the next forward. Never raises."""
        try:
            _, rss, used, capacity = self._read_step()
            self.last_step_figures = self._figures(used, rss, self._budget_for(capacity))
            self._carried_peak = int(used) if self._carried_peak is None else max(self._carried_peak, int(used))
        except Exception as exc:
            self._log_failure("record_sample", exc)

    def final_sample(self) -> Optional[int]:
        """Read (and reset) the peak since the last step without deciding anything: the peak of the
        run's last step, at train end. Returns ``max_step_peak_bytes`` (None if never read)."""
        try:
            _, rss, used, capacity = self._read_step()
            self.last_step_figures = self._figures(used, rss, self._budget_for(capacity))
        except Exception as exc:
            self._log_failure("final_sample", exc)
        return self.max_step_peak_bytes or None

    # ----- thread --------------------------------------------------------------------------------
    def start(self) -> "MemoryMonitor":
        """Start the background sampler (no-op when ``interval_s`` is 0 or already running)."""
        if self.interval_s > 0:
            self._thread.start(self.interval_s)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the background sampler and wait for it (no thread is left behind)."""
        self._thread.stop(timeout)

    @property
    def running(self) -> bool:
        """True while the background sampler runs."""
        return self._thread.running

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- acting ------------------------------------------------------------------------------
    def _emit(self, event: MemoryEvent) -> None:
        self.events.append(event)
        log = logger.warning if event.level >= Level.CRITICAL or event.action is Action.SPLIT else logger.info
        log("memguard: %s", event.message)   # every decision line starts so, like the adapters' own
        if self._on_event is not None:
            self._safe(lambda: self._on_event(event), "on_event")

    def _safe(self, fn: Callable[[], None], what: str) -> None:
        try:
            fn()
        except Exception as exc:
            self._log_failure(what, exc)

    def _log_failure(self, what: str, exc: BaseException) -> None:
        key = (what, type(exc).__name__)
        if key not in self._failed:
            self._failed.add(key)
            logger.warning("memguard: %s failed (%s: %s); skipped, training goes on", what,
                           type(exc).__name__, exc)


def default_clean() -> None:
    """``gc.collect()``, the free heap handed back to the OS where the host can
    (``probes.trim_heap``: glibc ``malloc_trim(0)`` on Linux), plus every registered framework's
    cache (:func:`memguard_core.frameworks.clean_caches`: ``torch.cuda.empty_cache()`` where CUDA is
    initialised, ``torch.mps.empty_cache()`` where MPS is available, ``mx.clear_cache()`` under
    MLX). Never raises."""
    from .probes import trim_heap

    gc.collect()
    trim_heap()
    frameworks.clean_caches()
