"""Runtime memory monitor: samples memory every training step and in a background thread,
classifies pressure against the budget with hysteresis, and decides what to do.

The monitor decides; the framework adapters act. Decisions escalate with the level
(thresholds from seed 002, "Memory Thresholds": warning 85 %, critical 90 %, emergency 95 %):

* ``warning``   -> ``log``   (an event, nothing else)
* ``critical``  -> ``clean`` (``gc.collect()`` + the device cache: ``torch.cuda.empty_cache`` /
  ``mx.clear_cache``); at a per-step sample the live bytes (``probes.live_bytes``: allocated
  tensors / active arrays / glibc in-use heap) are read around the clean, and when what it freed of
  them does not bring the last peak under the critical line (peak - freed still >= critical) it
  splits at once, so the next micro-batch is already smaller. Only freed *live* memory counts:
  cached blocks and trimmed heap lower RSS or the reserved figure, but the next micro-batch
  allocates them again (measured in ``bench/reaction.py``). A critical level that persists after
  a clean escalates to ``split``
* ``emergency`` -> ``split`` (the adapter doubles the micro-batch split factor k); a split also
  cleans, since it is asked because memory is short

The per-step sample (the peak of the last micro-batch) sets the level, up or down with hysteresis;
the background sample (the current figure, which swings within a step) can only raise it.

Usage is measured as a fraction of the *effective budget*::

    effective_budget = min(budget_bytes, (process_bytes + available_bytes) * safety_ratio)

so memory taken away by a co-tenant (``available`` falls) raises the usage just as the process's
own growth does. The per-step sample uses the peak since the last step (VmHWM on CPU, peak reserved
on CUDA, ``mx.get_peak_memory`` on MLX), reset after each read, so the transient peak of the
backward pass is what is compared, not the quieter figure between steps.

Memory pressure stall information (PSI, kernel Documentation/accounting/psi.rst) is an *early
warning* on top of that, read by the background sample only: the probe's ``pressure`` (``some
avg10``: the share of the last 10 s in which at least one task of the cgroup, or of the host where
the cgroup has no ``memory.pressure``, stalled waiting for memory). Stalls mean the kernel is
already reclaiming to keep the cgroup under its limit, before usage reaches it. One high sample
is not acted on (``avg10`` of a busy host blips); see :class:`PsiPolicy`: pressure that stays at
or above ``threshold`` for ``sustain_s`` seconds (``min_samples`` samples at least) *and* rose over
that window first cleans caches, and if it is still sustained and rising a window later, splits.

Growing back (:class:`GrowPolicy`): a split is not forever. After the per-step usage has stayed
below ``grow.below`` (default 70 % of the effective budget, under ``warning - hysteresis``) for a
sustained stretch (``grow.steps`` consecutive step samples *and* ``grow.seconds`` seconds, with no
PSI episode open), k halves again (``k -> k // 2``), one halving per stretch, never below 1 and
never above ``max_split`` (the micro-batch rows: a chunk never exceeds the user's micro-batch).
Before halving, the peak at the smaller k is *predicted* from measured step peaks (:meth:`MemoryMonitor.predict_peak`):
the peak measured earlier at that k if there is one, else a fit ``peak = base + per_row / k``
through the peaks measured at two k. A grow-back to k' >= ``planned_split`` (the preflight plan's k,
or the starting k) needs a prediction below the warning level of the current effective budget (or
no prediction at all); below the plan's k it needs a *measured* prediction at or below
``grow.below`` (measured peaks must prove that the larger micro-batch fits). The first step sample
after a grow-back measures a micro-batch at the new k: at or above the warning level the grow-back
is undone at once (k restored, a ``split`` event) and the stretch needed for the next attempt is
multiplied by ``grow.backoff`` (2x, 4x, ... up to ``grow.max_backoff``); a split within
``grow.steps`` samples after a grow-back counts as a failed one too, so pressure that returns
cannot make k oscillate. Each grow-back is an event with action ``grow``.

Per-step cost: :meth:`MemoryMonitor.step_sample` reads only cheap counters (``probe(cheap=True)``:
on Linux /proc/self/statm, ``getrusage``, the usage files of the limited cgroup levels through
kept descriptors, /proc/meminfo when its cached reading is over 1 s old; the allocator counters on
CUDA / MLX), resets the peak, and does a few comparisons: no allocation on the device, no
synchronisation, nothing proportional to the model's size. PSI averages and NVML are read by the
background thread only; on Linux CPU, while step samples come twice per ``interval_s`` or more
often, that thread reads PSI alone and a full sample only every :data:`FULL_SAMPLE_MAX_AGE_S`: a full one
would repeat the step path's reads, and each background sample costs the training thread GIL
hand-offs.

Nothing here raises into training: a failing probe or callback is logged once and skipped.
"""

from __future__ import annotations

import enum
import gc
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from .errors import ConfigError, require_fraction

logger = logging.getLogger("memguard.monitor")


#: While step samples come twice per ``interval_s`` or more often, the background thread of a Linux
#: CPU run reads PSI only (:meth:`MemoryMonitor.background_sample`); a full sample still runs this often.
FULL_SAMPLE_MAX_AGE_S = 5.0


class Level(enum.IntEnum):
    """Memory pressure level (ordered)."""

    OK = 0
    WARNING = 1
    CRITICAL = 2
    EMERGENCY = 3


class Action(str, enum.Enum):
    """What the monitor asks for."""

    NONE = "none"
    LOG = "log"
    CLEAN = "clean"
    SPLIT = "split"
    GROW = "grow"


@dataclass(frozen=True)
class Thresholds:
    """Fractions of the effective budget at which each level starts, and the hysteresis band.

    A level is left only when usage falls below ``threshold - hysteresis`` (prevents flapping
    around a threshold). Defaults from seed 002 (85 / 90 / 95 %).

    Raises:
        ConfigError: a value outside (0, 1], or not warning < critical < emergency.
    """

    warning: float = 0.85
    critical: float = 0.90
    emergency: float = 0.95
    hysteresis: float = 0.05

    def __post_init__(self) -> None:
        for name in ("warning", "critical", "emergency"):
            require_fraction(f"thresholds.{name}", getattr(self, name))
        if not (0.0 <= self.hysteresis < self.warning):
            raise ConfigError("thresholds.hysteresis", f"a number in [0, {self.warning})", self.hysteresis)
        if not (self.warning < self.critical < self.emergency):
            raise ConfigError("thresholds", "warning < critical < emergency",
                              (self.warning, self.critical, self.emergency))

    def level_for(self, usage: float, current: Level) -> Level:
        """Level for ``usage`` given the ``current`` level (hysteresis on the way down)."""
        bounds = [(Level.EMERGENCY, self.emergency), (Level.CRITICAL, self.critical),
                  (Level.WARNING, self.warning)]
        for level, bound in bounds:
            if usage >= bound:
                return level
            if current >= level and usage >= bound - self.hysteresis:
                return level
        return Level.OK


@dataclass(frozen=True)
class PsiPolicy:
    """When sustained memory pressure (PSI ``some avg10``, percent) triggers an action.

    An *episode* starts when a background sample's pressure is >= ``threshold`` and ends when it
    falls below ``threshold x release`` (hysteresis). Within an episode the monitor acts when the
    samples since the episode start (or since its last action) span >= ``sustain_s`` seconds,
    number >= ``min_samples``, and the newest pressure is higher than the oldest (rising). The
    first action of an episode is ``clean``; each later one is ``split`` (k doubled). A falling
    or flat window is not acted on: the kernel is recovering on its own.

    Defaults: ``threshold`` 10 % is where the kernel documentation's example trigger for memory
    pressure (``some 150000 1000000`` = 150 ms of stall per 1 s window, i.e. 15 %) and systemd-oomd's
    default ``DefaultMemoryPressureLimit=60%`` bracket "pressure that costs throughput"; we warn
    earlier than oomd acts. ``sustain_s`` 3 s = several 0.5 s samples, shorter than the 10 s
    ``avg10`` window so a rising average is still news.

    Raises:
        ConfigError: ``threshold`` outside (0, 100], ``sustain_s`` < 0, ``min_samples`` < 1,
            ``release`` outside (0, 1].
    """

    threshold: float = 10.0
    sustain_s: float = 3.0
    min_samples: int = 3
    release: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not (0.0 < float(self.threshold) <= 100.0):
            raise ConfigError("psi.threshold", "a percentage in (0, 100]", self.threshold)
        if isinstance(self.sustain_s, bool) or not isinstance(self.sustain_s, (int, float)) \
                or not self.sustain_s >= 0:
            raise ConfigError("psi.sustain_s", "a number of seconds >= 0", self.sustain_s)
        if isinstance(self.min_samples, bool) or not isinstance(self.min_samples, int) or self.min_samples < 1:
            raise ConfigError("psi.min_samples", "an integer >= 1", self.min_samples)
        require_fraction("psi.release", self.release)


@dataclass(frozen=True)
class GrowPolicy:
    """When the split factor k may halve again after pressure has gone (see the module doc).

    Args:
        below: usage (fraction of the effective budget) under which a step sample counts as calm;
            must be <= ``thresholds.warning - thresholds.hysteresis`` (checked by the monitor), so a
            calm sample is always at the OK level. Default 0.70: a halving of k roughly doubles the
            per-row part of the peak, and below 70 % there is room for that before the 85 % warning.
        steps: consecutive calm step samples (micro-batches) needed before a halving (>= 1).
        seconds: and at least this many seconds since the first calm sample of the stretch (>= 0).
            Defaults 16 samples and 30 s: longer than PSI's 10 s average and a few optimizer
            steps, so a co-tenant that pauses briefly does not invite a grow-back.
        backoff: after a grow-back that failed (undone, or followed by a split within ``steps``
            samples), the stretch needed for the next attempt is multiplied by this (> 1, default 2:
            exponential backoff, as in TCP's retransmission timer, RFC 6298 5.5).
        max_backoff: cap of that multiplier (>= 1, default 32).

    Raises:
        ConfigError: a value out of range (the error names ``grow.<field>``).
    """

    below: float = 0.70
    steps: int = 16
    seconds: float = 30.0
    backoff: float = 2.0
    max_backoff: float = 32.0

    def __post_init__(self) -> None:
        require_fraction("grow.below", self.below)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigError("grow.steps", "an integer >= 1", self.steps)
        for name, lo, strict in (("seconds", 0.0, False), ("backoff", 1.0, True), ("max_backoff", 1.0, False)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or (v <= lo if strict else v < lo):
                raise ConfigError(f"grow.{name}", f"a number {'>' if strict else '>='} {lo:g}", v)


@dataclass
class MemoryEvent:
    """One decision of the monitor.

    Attributes:
        step: optimizer step (``None`` from the background thread between steps).
        level: pressure level after this sample.
        action: what was asked for.
        usage: used / effective budget (0..1+).
        used_bytes: the process figure compared (step peak or current).
        budget_bytes: the effective budget at this sample.
        split: the split factor k after this decision.
        source: ``step`` (per-step sample), ``background``, ``psi`` (sustained memory pressure,
            see :class:`PsiPolicy`; ``usage`` is then the latest usage) or ``request``. A
            grow-back (action ``grow``) and its undo (action ``split``) come from ``step``.
        message: one human line.
    """

    step: Optional[int]
    level: Level
    action: Action
    usage: float
    used_bytes: int
    budget_bytes: int
    split: int
    source: str
    message: str
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"step": self.step, "level": self.level.name.lower(), "action": self.action.value,
                "usage": round(self.usage, 4), "used_bytes": self.used_bytes,
                "budget_bytes": self.budget_bytes, "split": self.split, "source": self.source,
                "message": self.message}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class MemoryMonitor:
    """Samples memory, classifies pressure and keeps the current decision (split factor k).

    Args:
        budget_bytes: the memory the training process may use at most (bytes), e.g. from
            ``plan.budget_from_available``. Must be > 0.
        device: probe device (``auto`` | ``cpu`` | ``cuda`` | ``mlx``), see ``memguard_core.probes``.
        safety_ratio: fraction of (process + available) usable when capacity shrinks at runtime.
        thresholds: ``Thresholds``.
        interval_s: background sampling period in seconds; ``0`` disables the thread.
        split: initial split factor k (>= 1), e.g. the planner's ``split_factor``.
        max_split: upper bound for k (the adapter sets it to the micro-batch size: rows cannot be
            split further than one row each).
        clean_fn: callable doing the cache clean (default: ``gc.collect`` + device cache).
        on_event: callable receiving every ``MemoryEvent`` (the adapter forwards to its logger).
        probe_fn: ``probe_fn(cheap: bool) -> MemorySnapshot``; defaults to
            ``memguard_core.probes.probe(device, cheap=cheap)``.
        peak_fn: ``peak_fn() -> Optional[int]``: the process peak since the last call, resetting it
            (default: the probe's ``process_peak_bytes`` followed by ``stats.reset_peak_memory``).
        live_fn: ``live_fn() -> Optional[int]``: bytes held by live allocations, read before and
            after a critical clean at a step sample (default: ``probes.live_bytes(device)``;
            None, e.g. CPU off Linux, credits the clean with nothing: split at once).
        psi: :class:`PsiPolicy` for the pressure early warning (background samples only); ``None``
            turns it off.
        grow: :class:`GrowPolicy` for halving k again once pressure has gone; ``None`` turns
            growing back off (k then only rises, as before).
        planned_split: the k the preflight planned (default: ``split``). k goes below it only when
            measured peaks predict that the larger micro-batch fits (see the module doc).

    Raises:
        ConfigError: invalid budget, device, ratio, thresholds, interval, split, max_split, psi,
            grow (or ``grow.below`` above ``warning - hysteresis``) or planned_split (the error
            names the argument).
    """

    def __init__(self, budget_bytes: int, *, device: str = "auto", safety_ratio: float = 0.8,
                 thresholds: Optional[Thresholds] = None, interval_s: float = 0.5, split: int = 1,
                 max_split: Optional[int] = None, clean_fn: Optional[Callable[[], None]] = None,
                 on_event: Optional[Callable[[MemoryEvent], None]] = None,
                 probe_fn: Optional[Callable[[bool], object]] = None,
                 peak_fn: Optional[Callable[[], Optional[int]]] = None,
                 live_fn: Optional[Callable[[], Optional[int]]] = None,
                 psi: Optional[PsiPolicy] = PsiPolicy(),
                 grow: Optional[GrowPolicy] = GrowPolicy(), planned_split: Optional[int] = None):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError("budget_bytes", "a positive integer number of bytes", budget_bytes)
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or interval_s < 0:
            raise ConfigError("interval_s", "a number of seconds >= 0", interval_s)
        if isinstance(split, bool) or not isinstance(split, int) or split < 1:
            raise ConfigError("split", "an integer >= 1", split)
        if max_split is not None and (isinstance(max_split, bool) or not isinstance(max_split, int)
                                      or max_split < 1):
            raise ConfigError("max_split", "an integer >= 1, or None", max_split)
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise ConfigError("thresholds", "a memguard_core.monitor.Thresholds", thresholds)
        if psi is not None and not isinstance(psi, PsiPolicy):
            raise ConfigError("psi", "a memguard_core.monitor.PsiPolicy, or None", psi)
        if grow is not None and not isinstance(grow, GrowPolicy):
            raise ConfigError("grow", "a memguard_core.monitor.GrowPolicy, or None", grow)
        if planned_split is not None and (isinstance(planned_split, bool) or not isinstance(planned_split, int)
                                          or planned_split < 1):
            raise ConfigError("planned_split", "an integer >= 1, or None", planned_split)
        from .probes import _DEVICE_RE
        if not isinstance(device, str) or _DEVICE_RE.match(device) is None:
            raise ConfigError("device", '"auto", "cpu", "cuda", "cuda:<index>" or "mlx"', device)
        for name, fn in (("clean_fn", clean_fn), ("on_event", on_event), ("probe_fn", probe_fn),
                         ("peak_fn", peak_fn), ("live_fn", live_fn)):
            if fn is not None and not callable(fn):
                raise ConfigError(name, "a callable, or None", fn)
        self.budget_bytes = budget_bytes
        self.device = device
        self.safety_ratio = require_fraction("safety_ratio", safety_ratio)
        self.thresholds = thresholds or Thresholds()
        if grow is not None and grow.below > self.thresholds.warning - self.thresholds.hysteresis + 1e-12:
            raise ConfigError("grow.below", f"a fraction <= warning - hysteresis "
                              f"({self.thresholds.warning - self.thresholds.hysteresis:.2f})", grow.below)
        self.interval_s = float(interval_s)
        self.max_split = max_split
        self._split = split
        self.level = Level.OK
        self.events: List[MemoryEvent] = []
        self.max_usage = 0.0
        self.max_step_peak_bytes = 0
        self.samples = 0
        self._clean_fn = clean_fn or default_clean
        self._on_event = on_event
        self._probe_fn = probe_fn
        self._peak_fn = peak_fn
        self._live_fn = live_fn
        self._live_before_clean: Optional[int] = None
        self._cleaned_at_level = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failed: set = set()
        self._step: Optional[int] = None
        self._step_samples = 0
        self._split_at_sample = -10
        self.psi = psi
        self.last_pressure: Optional[float] = None
        self._psi_window: List[tuple] = []   # (monotonic seconds, pressure %) since episode/action
        self._psi_episode_actions = 0
        # growing back
        self.grow = grow
        self.planned_split = planned_split if planned_split is not None else split
        self.peak_at_split: Dict[int, int] = {}  # k -> largest step peak measured at k (bytes)
        self._k_running = split      # k of the micro-batch whose peak the next step sample reads
        self._calm = 0               # consecutive calm step samples
        self._calm_since: Optional[float] = None
        self._grow_from: Optional[int] = None   # k before the last grow-back, until its probation
        self._grow_sample = -10**9   # step-sample count at the last grow-back
        self._grow_failures = 0
        # hot-path caches (resolved on the first sample)
        self._dev: Optional[str] = None
        self._probe_impl: Optional[Callable[[bool], object]] = None
        self._linux_reset: Optional[Callable[[], bool]] = None
        # the background thread between full samples (Linux CPU: see background_sample)
        self._pressure_fn: Optional[Callable[[], Optional[float]]] = None
        self._step_figures: Optional[Callable[[], Optional[tuple]]] = None
        # the last step sample: (monotonic s, used bytes, budget bytes, seconds since the one before)
        self._last_step: Optional[tuple] = None
        self._last_full = -math.inf               # monotonic s of the last full background sample

    # ----- decisions ---------------------------------------------------------------------------
    @property
    def split(self) -> int:
        """Current split factor k (read on the hot path: a plain attribute read)."""
        return self._split

    def request_split(self, k: int, reason: str, step: Optional[int] = None) -> int:
        """Raise the split factor to at least ``k`` (clamped to ``max_split``); returns the new k."""
        with self._lock:
            new = max(self._split, int(k))
            if self.max_split is not None:
                new = min(new, self.max_split)
            if new != self._split:
                old, self._split = self._split, new
                self._note_split()
                self._emit(MemoryEvent(step, self.level, Action.SPLIT, 0.0, 0, self.budget_bytes,
                                       new, "request", f"split {old} -> {new}: {reason}"))
            return self._split

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
        """Classify one sample and update the decision. Returns the action taken.

        ``used_bytes`` and ``budget_bytes`` in bytes; ``budget_bytes`` > 0. A ``step`` sample's
        ``used_bytes`` is the peak of the micro-batch just run (at the k read after the previous
        step sample); step samples also drive growing back (:class:`GrowPolicy`).
        """
        usage = used_bytes / max(1, budget_bytes)
        msg = ""
        with self._lock:
            self.samples += 1
            if source == "step":
                self._step_samples += 1
                k_ran = self._k_running
                if used_bytes > self.peak_at_split.get(k_ran, 0):
                    self.peak_at_split[k_ran] = int(used_bytes)
            self.max_usage = max(self.max_usage, usage)
            prev = self.level
            level = self.thresholds.level_for(usage, prev)
            if source == "background" and level <= prev:
                # the background thread sees the current figure, which swings within a step: it acts
                # only when it escalates; the per-step peak alone keeps or lowers the level
                return Action.NONE
            self.level = level
            action = Action.NONE
            if level == Level.OK:
                self._cleaned_at_level = False
                if prev != Level.OK:
                    action = Action.LOG
                    msg = f"memory back to normal: {_gib(used_bytes)} of {_gib(budget_bytes)} ({usage:.0%})"
            elif level == Level.WARNING:
                if prev < Level.WARNING:
                    action = Action.LOG
                    msg = (f"memory warning: {_gib(used_bytes)} of {_gib(budget_bytes)} ({usage:.0%} "
                           f">= {self.thresholds.warning:.0%})")
                self._cleaned_at_level = False
            elif level == Level.CRITICAL and not self._cleaned_at_level:
                action = Action.CLEAN
                self._cleaned_at_level = True
                msg = (f"memory critical: {_gib(used_bytes)} of {_gib(budget_bytes)} ({usage:.0%} "
                       f">= {self.thresholds.critical:.0%}): cleaning caches")
            elif self._step_samples - self._split_at_sample < 2:
                # a split acts at the next micro-batch and its peak is read one sample later:
                # wait for that before splitting again (no cascade of splits within one step)
                pass
            else:
                # emergency, or critical that persisted after a clean: split further
                new = self._split * 2
                if self.max_split is not None:
                    new = min(new, self.max_split)
                if new > self._split:
                    action = Action.SPLIT
                    msg = (f"memory {level.name.lower()}: {_gib(used_bytes)} of {_gib(budget_bytes)} "
                           f"({usage:.0%}): splitting micro-batches {self._split} -> {new}")
                    self._split = new
                    self._split_at_sample = self._step_samples
                    self._note_split()
                elif level > prev:
                    action = Action.LOG
                    msg = (f"memory {level.name.lower()}: {_gib(used_bytes)} of {_gib(budget_bytes)} "
                           f"({usage:.0%}) and the micro-batch cannot be split further (k={self._split})")
            if source == "step":
                if self.grow is not None:
                    action, msg = self._grow_decide(usage, int(used_bytes), int(budget_bytes), level,
                                                    action, msg)
                self._k_running = self._split
            elif level > prev:
                self._calm, self._calm_since = 0, None   # a background escalation breaks the calm
            if action is Action.NONE:
                return action
            event = MemoryEvent(step, level, action, usage, int(used_bytes), int(budget_bytes),
                                self._split, source, msg)
        self._emit(event)
        if action in (Action.CLEAN, Action.SPLIT):
            if action is Action.CLEAN and source == "step":
                self._live_before_clean = self._live()   # judged by _split_if_clean_fell_short
            # a split is asked because memory is short: hand back what the allocators keep too
            self._safe(self._clean_fn, "clean")
        return action

    # ----- growing back ------------------------------------------------------------------------
    def _note_split(self) -> None:
        """Bookkeeping of any raise of k (lock held): the calm stretch restarts, and a split soon
        after a grow-back counts as a failed grow-back (backoff)."""
        self._calm, self._calm_since = 0, None
        if self.grow is not None and self._grow_from is None \
                and 0 < self._step_samples - self._grow_sample <= self.grow.steps:
            self._grow_failures += 1
            self._grow_sample = -10**9

    def predict_peak(self, k: int) -> Optional[int]:
        """Predicted step peak (bytes) at split factor ``k``, from measured step peaks only.

        The peak measured at ``k`` itself if any (the largest one); else a least-squares fit of
        ``peak = base + per_row / k`` (weights, gradients and optimizer states do not depend on the
        chunk size, activations and logits grow linearly with the rows of a chunk: the estimator's
        model, ``memguard_core.estimate``) through the peaks measured at two or more k; else None.
        """
        pts = self.peak_at_split
        if k in pts:
            return pts[k]
        if len(pts) < 2:
            return None
        xs = [1.0 / kk for kk in pts]
        ys = [float(v) for v in pts.values()]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0:
            return None
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
        return int(max(my - slope * mx + slope / k, max(ys) if k < min(pts) else 0))

    def _grow_decide(self, usage: float, used: int, budget: int, level: Level, action: Action,
                     msg: str):
        """Grow-back decision of one step sample (lock held). Returns ``(action, message)``."""
        g = self.grow
        n = self._step_samples
        frm = self._grow_from
        if frm is not None:
            # this sample measured the first micro-batch run at the grown-back k: its probation
            self._grow_from = None
            if level >= Level.WARNING:
                self._grow_failures += 1
                self._grow_sample = -10**9
                self._calm, self._calm_since = 0, None
                if self._split < frm:
                    old, self._split = self._split, frm
                    self._split_at_sample = n
                    factor = min(g.max_backoff, g.backoff ** self._grow_failures)
                    return Action.SPLIT, (f"grow-back undone: the micro-batch at k={old} peaked at "
                                          f"{_gib(used)} of {_gib(budget)} ({usage:.0%} >= "
                                          f"{self.thresholds.warning:.0%}); k back to {frm}, next "
                                          f"attempt after {factor:g}x the calm stretch")
                return action, msg
        elif self._grow_failures and n - self._grow_sample > g.steps and self._grow_sample > 0:
            self._grow_failures = 0   # the last grow-back held for a whole stretch
        calm = (usage < g.below and level == Level.OK and action in (Action.NONE, Action.LOG)
                and not self._psi_window)
        if not calm:
            self._calm, self._calm_since = 0, None
            return action, msg
        now = time.monotonic()
        self._calm += 1
        if self._calm_since is None:
            self._calm_since = now
        k = self._split
        if k <= 1 or action is not Action.NONE:
            return action, msg
        factor = min(g.max_backoff, g.backoff ** self._grow_failures)
        if self._calm < g.steps * factor or now - self._calm_since < g.seconds * factor:
            return action, msg
        new = max(1, k // 2)
        pred = self.predict_peak(new)
        if new < self.planned_split:
            ok = pred is not None and pred <= g.below * budget
        else:
            ok = pred is None or pred < self.thresholds.warning * budget
        if not ok:
            # not now: the same prediction would block the next sample too; wait another stretch
            self._calm, self._calm_since = 0, None
            return action, msg
        calm_n, calm_s = self._calm, now - self._calm_since
        self._grow_from, self._split = k, new
        self._grow_sample = n
        self._calm, self._calm_since = 0, None
        ptxt = "no peak measured there yet" if pred is None else \
            f"predicted peak {_gib(pred)} = {pred / max(1, budget):.0%}"
        return Action.GROW, (f"pressure gone: {_gib(used)} of {_gib(budget)} ({usage:.0%} < "
                             f"{g.below:.0%}) for {calm_n} micro-batches / {calm_s:.1f} s; growing "
                             f"micro-batches back {k} -> {new} ({ptxt})")

    # ----- sampling ----------------------------------------------------------------------------
    def _probe(self, cheap: bool):
        if self._probe_fn is not None:
            return self._probe_fn(cheap)
        impl = self._probe_impl
        if impl is None:
            impl = self._probe_impl = self._resolve_probe()
        return impl(cheap)

    def _resolve_probe(self) -> Callable[[bool], object]:
        """The probe for this monitor's device, resolved once (``auto`` looks at the imported
        frameworks: resolving it at every step would query ``torch.cuda.is_available()`` each time).
        On Linux CPU the host probe is called directly, and the peak is reset through
        ``probes.linux.reset_peak`` (a kept ``/proc/self/clear_refs`` descriptor)."""
        from .probes import probe, resolve_device
        dev = self._dev = resolve_device(self.device)
        if dev == "cpu":
            from .probes import host_source
            if host_source() == "linux":
                from .probes import linux
                self._linux_reset = linux.reset_peak
                self._pressure_fn = linux.pressure
                if self._peak_fn is None:
                    self._step_figures = linux.step_figures
                return linux.probe   # probe(cheap)
        return lambda cheap: probe(dev, cheap=cheap)

    def _reset_peak(self) -> None:
        reset = self._linux_reset
        if reset is not None:
            if reset():   # VmHWM := VmRSS (proc.rst, "clear_refs")
                return
            self._linux_reset = self._step_figures = None   # no reset: ru_maxrss is no step peak
        from .stats import reset_peak_memory
        reset_peak_memory(self._dev or self.device)

    def step_sample(self, step: Optional[int] = None) -> Action:
        """Per-training-step check (the hot path): cheap counters only. Never raises.

        Cost on this machine (Linux, cgroup v1, CPU): about 70 us inside a training run, where the
        caches are cold after each step (``python bench/overhead.py``, "per-step check in the run").
        """
        self._step = step
        try:
            now, rss, used, capacity = self._read_step_peak()
            budget = self._budget_for(capacity)
            if self._pressure_fn is not None:
                prev = self._last_step
                self._last_step = (now, used, budget, now - prev[0] if prev is not None else math.inf)
            action = self.observe(used, budget, step=step, source="step")
            if action is Action.CLEAN:
                action = self._split_if_clean_fell_short(rss, used, budget, step)
            return action
        except Exception as exc:  # a probe failure never reaches training
            self._log_failure("step_sample", exc)
            return Action.NONE

    def _split_if_clean_fell_short(self, rss_before: int, used: int, budget: int, step: Optional[int]) -> Action:
        """After a critical clean at a step sample: the next micro-batch's peak is predicted as the
        last peak minus the live memory the clean freed (bounded by the RSS / footprint it freed),
        and when that is still at the critical level, split now rather than one micro-batch later.

        Memory an allocator kept for reuse (CUDA cached blocks, MLX cache, glibc free heap that
        ``malloc_trim`` returned) is not credited: the next micro-batch allocates it again. Where
        no live counter exists (``live_bytes`` None) nothing is credited."""
        before, self._live_before_clean = self._live_before_clean, None
        after = self._probe(True)
        rss_freed = max(0, int(rss_before) - int(after.process_bytes))
        live_after = self._live()
        live_freed = None if before is None or live_after is None else max(0, before - live_after)
        freed = 0 if live_freed is None else min(rss_freed, live_freed)
        predicted = int(used) - freed
        if predicted < self.thresholds.critical * budget:
            return Action.CLEAN
        with self._lock:
            new = self._split * 2
            if self.max_split is not None:
                new = min(new, self.max_split)
            if new <= self._split:
                return Action.CLEAN
            what = ("no live-memory counter here" if live_freed is None else
                    f"{_gib(live_freed)} of live memory")
            msg = (f"memory critical after a clean that freed {_gib(rss_freed)} of RSS ({what}; cached and "
                   f"trimmed memory is allocated again): the next micro-batch's predicted peak "
                   f"{_gib(predicted)} is {predicted / budget:.0%} of {_gib(budget)}: splitting "
                   f"micro-batches {self._split} -> {new}")
            self._split = new
            self._split_at_sample = self._step_samples
            self._k_running = new
            self._note_split()
            event = MemoryEvent(step, self.level, Action.SPLIT, predicted / budget, predicted, int(budget),
                                new, "step", msg)
        self._emit(event)
        return Action.SPLIT

    def _live(self) -> Optional[int]:
        """Live bytes (``live_fn`` or ``probes.live_bytes``), None when unknown. Never raises."""
        try:
            if self._live_fn is not None:
                v = self._live_fn()
            else:
                from .probes import live_bytes, resolve_device
                v = live_bytes(self._dev or resolve_device(self.device))
            return None if v is None else int(v)
        except Exception as exc:
            self._log_failure("live_bytes", exc)
            return None

    def _read_step_peak(self):
        """``(monotonic s, RSS, used, capacity)`` of a step sample, the peak counter reset after: used
        = the peak of the last micro-batch, capacity = process + available (bytes)."""
        figs = self._step_figures() if self._step_figures is not None else None
        if figs is not None:
            # Linux CPU, the common case: no snapshot object (see probes.linux.step_figures)
            now, rss, used, capacity = figs
            self._reset_peak()
        else:
            snap = self._probe(True)
            if self._peak_fn is not None:
                peak = self._peak_fn()
            else:
                peak = snap.process_peak_bytes
                if peak is not None:
                    self._reset_peak()
            now = getattr(snap, "timestamp", None) or time.monotonic()
            rss = int(snap.process_bytes)
            used = max(int(peak or 0), rss)
            capacity = rss + getattr(snap, "available_bytes", 0)
        if used > self.max_step_peak_bytes:
            self.max_step_peak_bytes = used
        return now, rss, used, capacity

    def prime(self) -> None:
        """Reset the peak counter at train start, so the first step's sample measures that step and
        not the model loading before it. Never raises."""
        try:
            if self._peak_fn is not None:
                self._peak_fn()
            else:
                if self._probe_fn is None and self._probe_impl is None:
                    self._probe_impl = self._resolve_probe()
                self._reset_peak()
        except Exception as exc:
            self._log_failure("prime", exc)

    def final_sample(self) -> Optional[int]:
        """Read (and reset) the peak since the last step without deciding anything: the peak of the
        run's last step, at train end. Returns ``max_step_peak_bytes`` (None if never read)."""
        try:
            self._read_step_peak()
        except Exception as exc:
            self._log_failure("final_sample", exc)
        return self.max_step_peak_bytes or None

    def background_sample(self) -> Action:
        """One sample of the background thread (full probe: PSI, NVML). Never raises.

        The usage level is decided first (:meth:`observe`); when that asks for nothing, the
        snapshot's ``pressure`` goes to :meth:`observe_pressure` (the PSI early warning). On
        Linux CPU, while step samples come at least twice per ``interval_s`` (the last two at most
        ``interval_s / 2`` apart, the last one younger than ``interval_s``) and the last full sample
        is younger than :data:`FULL_SAMPLE_MAX_AGE_S`, only PSI is read (see
        :meth:`_pressure_sample`). With longer steps every sample is a full one: it is what sees a
        co-tenant arrive in the middle of a step early (bench/reaction.py).
        """
        last = self._last_step
        if self._pressure_fn is not None and last is not None:
            now = time.monotonic()
            if (last[3] <= self.interval_s / 2 and now - last[0] < self.interval_s
                    and now - self._last_full < FULL_SAMPLE_MAX_AGE_S):
                return self._pressure_sample(now, last)
        try:
            self._last_full = time.monotonic()
            snap = self._probe(False)
            used, budget = int(snap.process_bytes), self.effective_budget(snap)
            action = self.observe(used, budget, step=self._step, source="background")
        except Exception as exc:
            self._log_failure("background_sample", exc)
            return Action.NONE
        try:
            now = getattr(snap, "timestamp", None)
            psi_action = self.observe_pressure(getattr(snap, "pressure", None),
                                               time.monotonic() if now is None else float(now),
                                               used_bytes=used, budget_bytes=budget,
                                               act=action is Action.NONE)
        except Exception as exc:
            self._log_failure("pressure", exc)
            return action
        return action if action is not Action.NONE else psi_action

    def _pressure_sample(self, now: float, last: tuple) -> Action:
        """A background sample that reads PSI only. On Linux CPU the per-step check reads what a
        full probe would (RSS, the micro-batch peak, the limited cgroup levels; MemAvailable when
        its cached reading is over 1 s old), so while step samples come twice per ``interval_s``
        or more often a full probe here repeats them with less news, and costs the training
        thread about 0.7 ms of GIL hand-offs a sample (bench/overhead.py with the interval at
        20 ms). A full sample still runs every ``FULL_SAMPLE_MAX_AGE_S`` (it also refreshes the
        cached cgroup location)."""
        try:
            pressure = self._pressure_fn()
            return self.observe_pressure(pressure, now, used_bytes=last[1], budget_bytes=last[2])
        except Exception as exc:
            self._log_failure("pressure", exc)
            return Action.NONE

    def observe_pressure(self, pressure: Optional[float], now: float, *, used_bytes: int = 0,
                         budget_bytes: int = 0, act: bool = True) -> Action:
        """Feed one PSI reading (``some avg10``, percent) taken at ``now`` (monotonic seconds).

        Implements :class:`PsiPolicy`: returns ``CLEAN`` / ``SPLIT`` when pressure has been
        sustained and rising for a window, else ``NONE``. ``None`` (no PSI on this system) is
        ignored; garbage (not a number in 0..100) is logged once and ignored. With
        ``act=False`` the reading is recorded but nothing is done (the usage check already acted
        on this sample). ``used_bytes`` / ``budget_bytes`` only go into the event.
        """
        policy = self.psi
        if policy is None or pressure is None:
            return Action.NONE
        if isinstance(pressure, bool) or not isinstance(pressure, (int, float)) \
                or not math.isfinite(pressure) or not (0.0 <= pressure <= 100.0):
            self._log_failure("pressure", ValueError(f"PSI reading {pressure!r} is not a percentage"))
            return Action.NONE
        p = float(pressure)
        usage = used_bytes / budget_bytes if budget_bytes > 0 else 0.0
        with self._lock:
            self.last_pressure = p
            win = self._psi_window
            if not win:
                if p >= policy.threshold:
                    win.append((now, p))
                return Action.NONE
            if p < policy.threshold * policy.release:
                win.clear()                      # the episode is over
                self._psi_episode_actions = 0
                return Action.NONE
            win.append((now, p))
            (t0, p0), (t1, p1) = win[0], win[-1]
            span = t1 - t0
            if not (act and len(win) >= policy.min_samples and span >= policy.sustain_s and p1 > p0):
                return Action.NONE
            what = (f"memory pressure: PSI some avg10 {p1:.1f}% (>= {policy.threshold:g}% for "
                    f"{span:.1f} s, rising from {p0:.1f}%)")
            if self._psi_episode_actions == 0:
                action, msg = Action.CLEAN, f"{what}: cleaning caches"
            else:
                new = self._split * 2
                if self.max_split is not None:
                    new = min(new, self.max_split)
                if new > self._split:
                    action = Action.SPLIT
                    msg = f"{what} after a clean: splitting micro-batches {self._split} -> {new}"
                    self._split = new
                    self._split_at_sample = self._step_samples
                    self._note_split()
                else:
                    action = Action.LOG
                    msg = f"{what}; the micro-batch cannot be split further (k={self._split})"
            self._psi_episode_actions += 1
            win[:] = [(t1, p1)]                  # the next action needs a new sustained window
            event = MemoryEvent(self._step, self.level, action, usage, int(used_bytes),
                                int(budget_bytes), self._split, "psi", msg)
        if action in (Action.CLEAN, Action.SPLIT):
            self._safe(self._clean_fn, "clean")
        self._emit(event)
        return action

    # ----- thread ------------------------------------------------------------------------------
    def start(self) -> "MemoryMonitor":
        """Start the background sampler (no-op when ``interval_s`` is 0 or already running)."""
        if self.interval_s <= 0 or (self._thread is not None and self._thread.is_alive()):
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memguard-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the background sampler and wait for it (no thread is left behind)."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.background_sample()

    def __enter__(self) -> "MemoryMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ----- plumbing ----------------------------------------------------------------------------
    def _emit(self, event: MemoryEvent) -> None:
        self.events.append(event)
        log = logger.warning if event.level >= Level.CRITICAL or event.action is Action.SPLIT else logger.info
        log("%s", event.message)
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
            logger.warning("memguard %s failed (%s: %s); skipped, training goes on", what,
                           type(exc).__name__, exc)


def _malloc_trim() -> None:
    """Return the free memory glibc's heap keeps to the kernel (``malloc_trim(0)``, malloc_trim(3)).

    On CPU, torch allocates through ``malloc``; blocks below glibc's dynamic mmap threshold (up to
    32 MiB, mallopt(3) ``M_MMAP_THRESHOLD``) come from the heap, and freed heap stays in the
    process's RSS, still charged to its cgroup. No-op off glibc.
    """
    import sys

    if not sys.platform.startswith("linux"):
        return
    from .probes.linux import libc
    trim = getattr(libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def default_clean() -> None:
    """``gc.collect()``, glibc ``malloc_trim(0)`` on Linux, plus the cache of whichever framework is
    loaded (never imports one)."""
    import sys

    gc.collect()
    try:
        _malloc_trim()
    except Exception:  # pragma: no cover - exotic libc
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover - depends on the device
            pass
        try:
            if hasattr(torch, "mps") and torch.backends.mps.is_available():
                torch.mps.empty_cache()
        except Exception:  # pragma: no cover
            pass
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        try:
            mx.clear_cache()
        except Exception:  # pragma: no cover
            pass
