"""The pressure signals of the runtime monitor: the early warnings read beside the usage level (Linux
PSI, macOS memorystatus, CUDA allocator retries), routed to their policies
(:mod:`memguard_core.monitor_pressure`), and the background thread's samples that read them. A mixin
of :class:`memguard_core.monitor.MemoryMonitor` (it uses ``policy``, ``sampler``, ``observe``,
``_emit``, ``_safe``, ``_clean_fn``, ``_log_failure`` and the step-sample state); the rules:
docs/monitor.md.
"""

from __future__ import annotations

import time
from typing import Optional

from .monitor_types import Action, MemoryEvent

__all__ = ["PressureSignals", "pressure_kind", "FULL_SAMPLE_MAX_AGE_S"]

#: While step samples come twice per ``interval_s`` or more often, the background thread reads the
#: pressure signal alone where the device's reader can (:meth:`PressureSignals.background_sample`);
#: a full sample still runs this often (seconds).
FULL_SAMPLE_MAX_AGE_S = 5.0


def pressure_kind(snapshot) -> Optional[str]:
    """Which pressure model a snapshot's ``pressure`` belongs to: its ``pressure_kind`` where set;
    else by its ``source`` (``"darwin"``: ``"memorystatus"``; ``"mlx"``: the host's model;
    ``"linux"`` or no source, as custom probes give: ``"psi"``, what ``pressure`` meant before
    snapshots named their kind); None for any other source (its figure is read by no policy)."""
    kind = getattr(snapshot, "pressure_kind", None)
    if kind is not None:
        return kind
    source = getattr(snapshot, "source", None)
    if source == "darwin":
        return "memorystatus"
    if source == "mlx":
        from .probes.host import host_source
        return "memorystatus" if host_source() == "darwin" else "psi"
    if source in (None, "linux"):
        return "psi"
    return None


class PressureSignals:
    """The pressure moments of :class:`memguard_core.monitor.MemoryMonitor` (see the module doc)."""

    def observe_pressure(self, pressure: Optional[float], now: float, *, used_bytes: int = 0,
                         budget_bytes: int = 0, act: bool = True) -> Action:
        """Feed one PSI reading (``some avg10``, percent) taken at ``now`` (monotonic seconds).

        Implements :class:`PsiPolicy` (:meth:`MicroBatchPolicy.observe_pressure`): returns ``CLEAN`` /
        ``SPLIT`` when pressure has been sustained and rising for a window, else ``NONE``.
        ``None`` (no PSI on this system) is ignored; garbage (not a number in 0..100) is logged
        once and ignored. With ``act=False`` the reading is recorded but nothing is done (the
        usage check already acted on this sample). ``used_bytes`` / ``budget_bytes`` only go
        into the event.
        """
        try:
            event = self.policy.observe_pressure(pressure, now, step=self._step, used_bytes=used_bytes,
                                                 budget_bytes=budget_bytes, act=act)
        except ValueError as exc:
            self._log_failure("pressure", exc)
            return Action.NONE
        return self._act_on_pressure(event)

    def observe_memorystatus(self, used_percent: Optional[float], now: float, *,
                             kernel_level: Optional[str] = None, swap_used_bytes: Optional[int] = None,
                             used_bytes: int = 0, budget_bytes: int = 0, act: bool = True) -> Action:
        """Feed one macOS pressure reading taken at ``now`` (monotonic seconds): ``used_percent`` =
        100 - ``kern.memorystatus_level``, the kernel's level, swap in use (bytes); see
        :class:`MemorystatusPolicy` (:meth:`MicroBatchPolicy.observe_memorystatus`). Returns ``CLEAN`` /
        ``SPLIT`` when the pressure has been sustained and not easing for a window, else ``NONE``.
        Garbage is logged once and ignored; ``act=False`` records only."""
        try:
            event = self.policy.observe_memorystatus(used_percent, now, kernel_level=kernel_level,
                                                     swap_used_bytes=swap_used_bytes, step=self._step,
                                                     used_bytes=used_bytes, budget_bytes=budget_bytes,
                                                     act=act)
        except ValueError as exc:
            self._log_failure("pressure", exc)
            return Action.NONE
        return self._act_on_pressure(event)

    def observe_alloc_retries(self, retries: Optional[int], *, ooms: Optional[int] = None,
                              step: Optional[int] = None, used_bytes: int = 0, budget_bytes: int = 0,
                              act: bool = True) -> Action:
        """Feed one optimizer step's CUDA allocator counts (``num_alloc_retries``, ``num_ooms``:
        cumulative), see :class:`AllocRetryPolicy` (:meth:`MicroBatchPolicy.observe_alloc_retries`).
        Returns ``CLEAN`` / ``SPLIT`` when the retries rose on enough optimizer steps in a row,
        else ``NONE``. :meth:`step_sample` feeds it on CUDA devices; garbage is logged once and
        ignored; ``act=False`` records only. ``used_bytes`` / ``budget_bytes`` only go into the
        event (source ``"alloc_retries"``)."""
        try:
            event = self.policy.observe_alloc_retries(retries, ooms=ooms, step=step, used_bytes=used_bytes,
                                                      budget_bytes=budget_bytes, act=act)
        except ValueError as exc:
            self._log_failure("alloc_retries", exc)
            return Action.NONE
        return self._act_on_pressure(event)

    def _step_alloc_retries(self, step: Optional[int], used: int, budget: int, act: bool) -> Action:
        """The allocator-retry signal of a step sample (CUDA: its window's counters): fed once per
        optimizer step, at the first sample that shows a new ``step`` (every sample where the
        adapter gives none). Never raises."""
        w, self._window = self._window, None
        if w is None or getattr(w, "alloc_retries", None) is None:
            return Action.NONE
        if step is not None and step == self._retries_step:
            return Action.NONE
        self._retries_step = step
        return self.observe_alloc_retries(w.alloc_retries, ooms=w.ooms, step=step, used_bytes=used,
                                          budget_bytes=budget, act=act)

    def _act_on_pressure(self, event: Optional[MemoryEvent]) -> Action:
        """A pressure policy's decision: clean before a clean or a split, then record and log it."""
        if event is None:
            return Action.NONE
        if event.action in (Action.CLEAN, Action.SPLIT):
            self._safe(self._clean_fn, "clean")
        self._emit(event)
        return event.action

    def _observe_snapshot_pressure(self, snap, now: float, used: int, budget: int, act: bool) -> Action:
        """Route a snapshot's pressure to its own platform's policy (:func:`pressure_kind`)."""
        kind = pressure_kind(snap)
        if kind == "psi":
            return self.observe_pressure(getattr(snap, "pressure", None), now, used_bytes=used,
                                         budget_bytes=budget, act=act)
        if kind == "memorystatus":
            return self.observe_memorystatus(getattr(snap, "pressure", None), now,
                                             kernel_level=getattr(snap, "kernel_pressure", None),
                                             swap_used_bytes=getattr(snap, "swap_used_bytes", None),
                                             used_bytes=used, budget_bytes=budget, act=act)
        return Action.NONE

    def background_sample(self) -> Action:
        """One sample of the background thread (full probe: PSI, NVML). Never raises.

        The usage level is decided first (:meth:`observe`); when that asks for nothing, the
        snapshot's pressure goes to its own platform's early warning: PSI to
        :meth:`observe_pressure`, macOS memorystatus to :meth:`observe_memorystatus`
        (:func:`pressure_kind`). Where the
        device's reader reads pressure alone (Linux CPU), while step samples come at least twice
        per ``interval_s`` (the last two at most ``interval_s / 2`` apart, the last one younger
        than ``interval_s``) and the last full sample is younger than
        :data:`FULL_SAMPLE_MAX_AGE_S`, only the pressure is read: the step path has just read what
        a full sample would, and every background sample costs the training thread GIL hand-offs.
        With longer steps every sample is a full one: it is what sees a co-tenant arrive in the
        middle of a step early.
        """
        last = self._last_step
        try:
            now = time.monotonic()
            if (last is not None and last[3] <= self.interval_s / 2 and now - last[0] < self.interval_s
                    and now - self._last_full < FULL_SAMPLE_MAX_AGE_S and self.sampler.pressure_alone):
                return self._pressure_sample(now, last)
            self._last_full = time.monotonic()
            snap = self.sampler.probe(False)
            used, budget = int(snap.process_bytes), self.effective_budget(snap)
            action = self.observe(used, budget, step=self._step, source="background")
        except Exception as exc:
            self._log_failure("background_sample", exc)
            return Action.NONE
        try:
            now = getattr(snap, "timestamp", None)
            psi_action = self._observe_snapshot_pressure(snap, time.monotonic() if now is None else float(now),
                                                         used, budget, action is Action.NONE)
        except Exception as exc:
            self._log_failure("pressure", exc)
            return action
        return action if action is not Action.NONE else psi_action

    def _pressure_sample(self, now: float, last: tuple) -> Action:
        """A background sample that reads the pressure alone, judged with the last step sample's
        usage. Never raises."""
        try:
            if self.sampler.pressure_kind != "psi":
                return Action.NONE   # no reader reads another model's figure alone
            pressure = self.sampler.pressure()
            return self.observe_pressure(pressure, now, used_bytes=last[1], budget_bytes=last[2])
        except Exception as exc:
            self._log_failure("pressure", exc)
            return Action.NONE
