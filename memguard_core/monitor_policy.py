"""The runtime monitor's decisions, pure: levels with hysteresis, PSI episodes, growing back, and
the one way k rises (:meth:`MicroBatchPolicy.raise_micro_batches`).

Numbers in, decisions out: nothing here reads memory, starts a thread or cleans a cache, so every
rule can be tested by feeding samples (``tests/test_monitor_policy.py``). The sampling side (the
per-step check, the background thread, the device readers) and the actions (cleaning, logging,
the adapters' callbacks) are :class:`memguard_core.monitor.MemoryMonitor`'s. The design story is
in docs/monitor.md.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Tuple

from .errors import ConfigError
from .monitor_pressure import (AllocRetryEpisodes, AllocRetryPolicy, MemorystatusEpisodes, MemorystatusPolicy,
                               PressureEpisodes, PsiPolicy)
from .monitor_types import Action, GrowPolicy, Level, MemoryEvent, Thresholds
from .policy_pressure import PressureDecisions

__all__ = ["MicroBatchPolicy"]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _share(used: float, budget: float, usage: float) -> str:
    """``"<used> of <budget> (<usage>%"``, the start of a level message (closed by the caller)."""
    return f"{_gib(used)} of {_gib(budget)} ({usage:.0%}"



class MicroBatchPolicy(PressureDecisions):
    """The monitor's decision state: the level, the micro-batches per batch k, PSI episodes and growing back.

    Each ``observe*`` method takes one sample's numbers and returns the :class:`MemoryEvent` it
    decided (its ``action``), or None when nothing is to be done; the caller acts on it (cleans,
    logs, forwards). Thread-safe: the per-step sample and the background thread feed one policy.

    Levels (``thresholds``): ``warning`` logs; ``critical`` asks for a clean once per stay at that
    level and splits when it persists; ``emergency`` splits. A step sample (the peak of the last
    micro-batch) moves the level up or down with hysteresis; a background sample (a current
    figure, which swings within a step) can only raise it. After a split, no further split until
    the next micro-batch's peak has been read (two step samples).

    Growing back (``grow``): after ``grow.steps`` calm step samples (usage < ``grow.below``, OK
    level, no PSI, macOS pressure or allocator-retry episode open) lasting ``grow.seconds``, k halves, if the peak predicted at the
    halved k (:meth:`predict_peak`) allows: below the warning level (or nothing known) down to
    ``planned_micro_batches``; below it only with a measured prediction at or below ``grow.below``. The
    next step sample at or above warning undoes it; that, or a split within ``grow.steps``
    samples, is a failed grow-back and multiplies the stretch by ``grow.backoff`` (up to
    ``grow.max_backoff``).

    Args:
        thresholds: :class:`Thresholds`.
        micro_batches: the starting k (>= 1).
        max_micro_batches: upper bound of k (None: none).
        psi: :class:`PsiPolicy`, or None to ignore pressure readings.
        grow: :class:`GrowPolicy`, or None: k never falls.
        planned_micro_batches: the preflight plan's k (default ``micro_batches``).
        memorystatus: :class:`MemorystatusPolicy` for macOS pressure readings
            (:meth:`observe_memorystatus`), or None to ignore them.
        alloc_retries: :class:`AllocRetryPolicy` for the CUDA allocator's retries
            (:meth:`observe_alloc_retries`), or None to ignore them.

    Raises:
        ConfigError: ``grow.below`` above ``thresholds.warning - thresholds.hysteresis``.
    """

    def __init__(self, thresholds: Thresholds, *, micro_batches: int = 1, max_micro_batches: Optional[int] = None,
                 psi: Optional[PsiPolicy] = None, grow: Optional[GrowPolicy] = None,
                 planned_micro_batches: Optional[int] = None,
                 memorystatus: Optional[MemorystatusPolicy] = None,
                 alloc_retries: Optional[AllocRetryPolicy] = None):
        if grow is not None and grow.below > thresholds.warning - thresholds.hysteresis + 1e-12:
            raise ConfigError("grow.below", f"a fraction <= warning - hysteresis "
                              f"({thresholds.warning - thresholds.hysteresis:.2f})", grow.below)
        self.thresholds = thresholds
        self.max_micro_batches = max_micro_batches
        self.psi = psi
        self.grow = grow
        self.planned_micro_batches = planned_micro_batches if planned_micro_batches is not None else micro_batches
        self.level = Level.OK
        self.samples = 0
        self.max_usage = 0.0
        self.last_pressure: Optional[float] = None
        self.peak_at_micro_batches: Dict[int, int] = {}  # k -> largest step peak measured at k (bytes)
        self._micro_batches = micro_batches
        self._lock = threading.RLock()
        self._cleaned_at_level = False
        self._step_samples = 0
        self._micro_batches_at_sample = -10
        self._episodes = PressureEpisodes(psi) if psi is not None else None
        self.memorystatus = memorystatus
        self._mac_episodes = MemorystatusEpisodes(memorystatus) if memorystatus is not None else None
        self.alloc_retries = alloc_retries
        self._retry_episodes = AllocRetryEpisodes(alloc_retries) if alloc_retries is not None else None
        self._k_running = micro_batches   # k of the micro-batch whose peak the next step sample reads
        self._calm = 0               # consecutive calm step samples
        self._calm_since: Optional[float] = None
        self._grow_from: Optional[int] = None   # k before the last grow-back, until its probation
        self._grow_sample = -10**9   # step-sample count at the last grow-back
        self._grow_failures = 0

    @property
    def micro_batches(self) -> int:
        """The current micro-batches per batch k."""
        return self._micro_batches

    # ----- k ------------------------------------------------------------------------------------
    def raise_micro_batches(self) -> Optional[int]:
        """Double k, clamped to ``max_micro_batches``, and note the split (the calm stretch restarts; soon
        after a grow-back it counts as a failed one; no further split until the next micro-batch's
        peak is read). Returns the k before, or None when k is at ``max_micro_batches`` already."""
        with self._lock:
            new = self._micro_batches * 2
            if self.max_micro_batches is not None:
                new = min(new, self.max_micro_batches)
            if new <= self._micro_batches:
                return None
            old, self._micro_batches = self._micro_batches, new
            self._micro_batches_at_sample = self._step_samples
            self._note_micro_batches()
            return old

    def request_micro_batches(self, k: int, reason: str, *, step: Optional[int] = None,
                      budget_bytes: int = 0) -> Optional[MemoryEvent]:
        """Set k to at least ``k``, clamped to ``max_micro_batches`` (e.g. after an out-of-memory error).
        Returns the ``split`` event (source ``request``), or None when k stays."""
        with self._lock:
            new = max(self._micro_batches, int(k))
            if self.max_micro_batches is not None:
                new = min(new, self.max_micro_batches)
            if new == self._micro_batches:
                return None
            old, self._micro_batches = self._micro_batches, new
            self._note_micro_batches()
            return MemoryEvent(step, self.level, Action.SPLIT, 0.0, 0, int(budget_bytes), new,
                               "request", f"split {old} -> {new}: {reason}")

    def _note_micro_batches(self) -> None:
        """Bookkeeping of any raise of k (lock held): the calm stretch restarts, and a split soon
        after a grow-back counts as a failed grow-back (backoff)."""
        self._calm, self._calm_since = 0, None
        if self.grow is not None and self._grow_from is None \
                and 0 < self._step_samples - self._grow_sample <= self.grow.steps:
            self._grow_failures += 1
            self._grow_sample = -10**9

    # ----- samples ------------------------------------------------------------------------------
    def observe(self, used_bytes: int, budget_bytes: int, *, step: Optional[int], source: str,
                now: Optional[float] = None) -> Optional[MemoryEvent]:
        """Classify one usage sample (bytes; ``budget_bytes`` the effective budget, > 0) and update
        the decision. ``source`` ``"step"``: ``used_bytes`` is the peak of the micro-batch just run
        (at the k of the previous step sample), which also drives growing back; ``"background"``:
        a current figure, acted on only when it raises the level. ``now`` (monotonic s) times the
        calm stretch (default ``time.monotonic()``, read only when needed).

        Returns the event decided (action ``log``, ``clean``, ``split`` or ``grow``), or None.
        """
        usage = used_bytes / max(1, budget_bytes)
        msg = ""
        with self._lock:
            self.samples += 1
            if source == "step":
                self._step_samples += 1
                k_ran = self._k_running
                if used_bytes > self.peak_at_micro_batches.get(k_ran, 0):
                    self.peak_at_micro_batches[k_ran] = int(used_bytes)
            self.max_usage = max(self.max_usage, usage)
            prev = self.level
            level = self.thresholds.level_for(usage, prev)
            if source == "background" and level <= prev:
                # the background thread sees the current figure, which swings within a step: it acts
                # only when it escalates; the per-step peak alone keeps or lowers the level
                return None
            self.level = level
            action = Action.NONE
            if level == Level.OK:
                self._cleaned_at_level = False
                if prev != Level.OK:
                    action = Action.LOG
                    msg = f"memory back to normal: {_share(used_bytes, budget_bytes, usage)})"
            elif level == Level.WARNING:
                if prev < Level.WARNING:
                    action = Action.LOG
                    msg = (f"memory warning: {_share(used_bytes, budget_bytes, usage)} "
                           f">= {self.thresholds.warning:.0%})")
                self._cleaned_at_level = False
            elif level == Level.CRITICAL and not self._cleaned_at_level:
                action = Action.CLEAN
                self._cleaned_at_level = True
                msg = (f"memory critical: {_share(used_bytes, budget_bytes, usage)} "
                       f">= {self.thresholds.critical:.0%}): cleaning caches")
            elif self._step_samples - self._micro_batches_at_sample < 2:
                # a split acts at the next micro-batch and its peak is read one sample later:
                # wait for that before splitting again (no cascade of splits within one step)
                pass
            else:
                # emergency, or critical that persisted after a clean: split further
                old = self.raise_micro_batches()
                what = f"memory {level.name.lower()}: {_share(used_bytes, budget_bytes, usage)})"
                if old is not None:
                    action = Action.SPLIT
                    msg = f"{what}: splitting micro-batches {old} -> {self._micro_batches}"
                elif level > prev:
                    action = Action.LOG
                    msg = f"{what} and the micro-batch cannot be split further (k={self._micro_batches})"
            if source == "step":
                if self.grow is not None:
                    action, msg = self._grow_decide(usage, int(used_bytes), int(budget_bytes), level,
                                                    action, msg, now)
                self._k_running = self._micro_batches
            elif level > prev:
                self._calm, self._calm_since = 0, None   # a background escalation breaks the calm
            if action is Action.NONE:
                return None
            return MemoryEvent(step, level, action, usage, int(used_bytes), int(budget_bytes),
                               self._micro_batches, source, msg)

    def micro_batches_after_clean(self, predicted_bytes: int, budget_bytes: int, *, step: Optional[int],
                          rss_freed: int, live_freed: Optional[int]) -> Optional[MemoryEvent]:
        """After a critical clean at a step sample: ``predicted_bytes`` is the next micro-batch's
        peak (the last peak minus the live memory the clean freed, bounded by the RSS it freed:
        ``rss_freed``, ``live_freed`` in bytes, ``live_freed`` None where no live counter exists).
        At or above the critical level, split now rather than one micro-batch later.

        Returns the ``split`` event, or None (the clean was enough, or k is at ``max_micro_batches``).
        """
        budget = max(1, int(budget_bytes))
        predicted = int(predicted_bytes)
        if predicted < self.thresholds.critical * budget:
            return None
        with self._lock:
            old = self.raise_micro_batches()
            if old is None:
                return None
            self._k_running = self._micro_batches   # the next micro-batch already runs at the new k
            what = ("no live-memory counter here" if live_freed is None else
                    f"{_gib(live_freed)} of live memory")
            msg = (f"memory critical after a clean that freed {_gib(rss_freed)} of RSS ({what}; cached and "
                   f"trimmed memory is allocated again): the next micro-batch's predicted peak "
                   f"{_gib(predicted)} is {predicted / budget:.0%} of {_gib(budget)}: splitting "
                   f"micro-batches {old} -> {self._micro_batches}")
            return MemoryEvent(step, self.level, Action.SPLIT, predicted / budget, predicted, budget,
                               self._micro_batches, "step", msg)

    # ----- growing back -------------------------------------------------------------------------
    def predict_peak(self, k: int) -> Optional[int]:
        """Predicted step peak (bytes) at ``k`` micro-batches per batch, from measured step peaks only.

        The peak measured at ``k`` itself if any (the largest one); else a least-squares fit of
        ``peak = base + per_row / k`` (weights, gradients and optimizer states do not depend on the
        chunk size, activations and logits grow linearly with the rows of a chunk: the estimator's
        model, ``memguard_core.estimator``) through the peaks measured at two or more k; else None.
        """
        pts = self.peak_at_micro_batches
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
                     msg: str, now: Optional[float]) -> Tuple[Action, str]:
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
                if self._micro_batches < frm:
                    old, self._micro_batches = self._micro_batches, frm
                    self._micro_batches_at_sample = n
                    factor = min(g.max_backoff, g.backoff ** self._grow_failures)
                    return Action.SPLIT, (f"grow-back undone: the micro-batch at k={old} peaked at "
                                          f"{_gib(used)} of {_gib(budget)} ({usage:.0%} >= "
                                          f"{self.thresholds.warning:.0%}); k back to {frm}, next "
                                          f"attempt after {factor:g}x the calm stretch")
                return action, msg
        elif self._grow_failures and n - self._grow_sample > g.steps and self._grow_sample > 0:
            self._grow_failures = 0   # the last grow-back held for a whole stretch
        calm = (usage < g.below and level == Level.OK and action in (Action.NONE, Action.LOG)
                and not (self._episodes is not None and self._episodes.open)
                and not (self._mac_episodes is not None and self._mac_episodes.open)
                and not (self._retry_episodes is not None and self._retry_episodes.open))
        if not calm:
            self._calm, self._calm_since = 0, None
            return action, msg
        if now is None:
            now = time.monotonic()
        self._calm += 1
        if self._calm_since is None:
            self._calm_since = now
        k = self._micro_batches
        if k <= 1 or action is not Action.NONE:
            return action, msg
        factor = min(g.max_backoff, g.backoff ** self._grow_failures)
        if self._calm < g.steps * factor or now - self._calm_since < g.seconds * factor:
            return action, msg
        new = max(1, k // 2)
        pred = self.predict_peak(new)
        if new < self.planned_micro_batches:
            ok = pred is not None and pred <= g.below * budget
        else:
            ok = pred is None or pred < self.thresholds.warning * budget
        if not ok:
            # not now: the same prediction would block the next sample too; wait another stretch
            self._calm, self._calm_since = 0, None
            return action, msg
        calm_n, calm_s = self._calm, now - self._calm_since
        self._grow_from, self._micro_batches = k, new
        self._grow_sample = n
        self._calm, self._calm_since = 0, None
        ptxt = "no peak measured there yet" if pred is None else \
            f"predicted peak {_gib(pred)} = {pred / max(1, budget):.0%}"
        return Action.GROW, (f"pressure gone: {_gib(used)} of {_gib(budget)} ({usage:.0%} < "
                             f"{g.below:.0%}) for {calm_n} micro-batches / {calm_s:.1f} s; growing "
                             f"micro-batches back {k} -> {new} ({ptxt})")
