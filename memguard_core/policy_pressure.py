"""The pressure decisions of the monitor's policy: a PSI, macOS memorystatus or CUDA allocator-retry
episode's first action cleans, later ones raise the micro-batches. A mixin of
:class:`memguard_core.monitor_policy.MicroBatchPolicy` (it uses ``psi``, ``level``, ``last_pressure``, the
episode trackers, ``raise_micro_batches`` and the lock); the rules: docs/monitor.md.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

from .monitor_types import Action, MemoryEvent

__all__ = ["PressureDecisions"]


class PressureDecisions:
    """The pressure moments of :class:`memguard_core.monitor_policy.MicroBatchPolicy` (see the module doc)."""

    def observe_pressure(self, pressure: Optional[float], now: float, *, step: Optional[int] = None,
                         used_bytes: int = 0, budget_bytes: int = 0,
                         act: bool = True) -> Optional[MemoryEvent]:
        """Feed one PSI reading (``some avg10``, percent) taken at ``now`` (monotonic s), see
        :class:`PsiPolicy`: the first action of an episode is a clean, later ones split. ``None``
        (no PSI here) is ignored, as is every reading when ``psi`` is None. With ``act=False`` the
        reading is recorded but nothing is decided. ``used_bytes`` / ``budget_bytes`` only go into
        the event.

        Returns the event (action ``clean``, ``split``, or ``log`` when k is at ``max_micro_batches``), or
        None.

        Raises:
            ValueError: ``pressure`` is not a number in 0..100.
        """
        if self.psi is None or pressure is None:
            return None
        if isinstance(pressure, bool) or not isinstance(pressure, (int, float)) \
                or not math.isfinite(pressure) or not (0.0 <= pressure <= 100.0):
            raise ValueError(f"PSI reading {pressure!r} is not a percentage")
        p = float(pressure)
        usage = used_bytes / budget_bytes if budget_bytes > 0 else 0.0
        with self._lock:
            self.last_pressure = p
            hit = self._episodes.feed(p, now, act)
            return self._pressure_event(hit, "psi", step, usage, used_bytes, budget_bytes)

    def _pressure_event(self, hit: Optional[Tuple[int, str]], source: str, step: Optional[int],
                        usage: float, used_bytes: int, budget_bytes: int) -> Optional[MemoryEvent]:
        """The event of an episode's n-th action (lock held): the first cleans, later ones split."""
        if hit is None:
            return None
        nth, what = hit
        if nth == 1:
            action, msg = Action.CLEAN, f"{what}: cleaning caches"
        else:
            old = self.raise_micro_batches()
            if old is not None:
                action = Action.SPLIT
                msg = f"{what} after a clean: splitting micro-batches {old} -> {self._micro_batches}"
            else:
                action = Action.LOG
                msg = f"{what}; the micro-batch cannot be split further (k={self._micro_batches})"
        return MemoryEvent(step, self.level, action, usage, int(used_bytes), int(budget_bytes),
                           self._micro_batches, source, msg)

    def observe_memorystatus(self, used_percent: Optional[float], now: float, *,
                             kernel_level: Optional[str] = None, swap_used_bytes: Optional[int] = None,
                             step: Optional[int] = None, used_bytes: int = 0, budget_bytes: int = 0,
                             act: bool = True) -> Optional[MemoryEvent]:
        """Feed one macOS pressure reading taken at ``now`` (monotonic s), see
        :class:`MemorystatusPolicy`: ``used_percent`` = 100 - ``kern.memorystatus_level``,
        ``kernel_level`` ``"normal"`` / ``"warn"`` / ``"critical"``, ``swap_used_bytes`` swap in
        use (bytes). All None, or ``memorystatus`` None: ignored. With ``act=False`` the reading
        is recorded but nothing is decided. ``used_bytes`` / ``budget_bytes`` only go into the
        event (source ``"memorystatus"``).

        Raises:
            ValueError: ``used_percent`` not a number in 0..100, or ``swap_used_bytes`` negative.
        """
        if self._mac_episodes is None or (used_percent is None and kernel_level is None
                                          and swap_used_bytes is None):
            return None
        if used_percent is not None and (isinstance(used_percent, bool)
                                         or not isinstance(used_percent, (int, float))
                                         or not math.isfinite(used_percent)
                                         or not (0.0 <= used_percent <= 100.0)):
            raise ValueError(f"memorystatus reading {used_percent!r} is not a percentage")
        if swap_used_bytes is not None and (isinstance(swap_used_bytes, bool)
                                            or not isinstance(swap_used_bytes, int) or swap_used_bytes < 0):
            raise ValueError(f"swap in use {swap_used_bytes!r} is not a number of bytes")
        if kernel_level not in (None, "normal", "warn", "critical"):
            kernel_level = None
        usage = used_bytes / budget_bytes if budget_bytes > 0 else 0.0
        with self._lock:
            if used_percent is not None:
                self.last_pressure = float(used_percent)
            hit = self._mac_episodes.feed(None if used_percent is None else float(used_percent), now,
                                          kernel=kernel_level, swap_used=swap_used_bytes, act=act)
            return self._pressure_event(hit, "memorystatus", step, usage, used_bytes, budget_bytes)

    def observe_alloc_retries(self, retries: Optional[int], *, ooms: Optional[int] = None,
                              step: Optional[int] = None, used_bytes: int = 0, budget_bytes: int = 0,
                              act: bool = True) -> Optional[MemoryEvent]:
        """Feed one optimizer step's CUDA allocator counts, see :class:`AllocRetryPolicy`:
        ``retries`` = ``num_alloc_retries``, ``ooms`` = ``num_ooms`` (cumulative counts, read once
        per optimizer step). The first action of an episode is a clean, later ones split. ``None``,
        or ``alloc_retries`` None: ignored. With ``act=False`` the step is counted but nothing is
        decided. ``used_bytes`` / ``budget_bytes`` only go into the event (source
        ``"alloc_retries"``).

        Returns the event (action ``clean``, ``split``, or ``log`` when k is at ``max_micro_batches``), or
        None.

        Raises:
            ValueError: ``retries`` (or ``ooms``) is not a count (an integer >= 0).
        """
        if self._retry_episodes is None or retries is None:
            return None
        for name, v in (("num_alloc_retries", retries), ("num_ooms", ooms)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} {v!r} is not a count")
        usage = used_bytes / budget_bytes if budget_bytes > 0 else 0.0
        with self._lock:
            hit = self._retry_episodes.feed(retries, ooms, act)
            return self._pressure_event(hit, "alloc_retries", step, usage, used_bytes, budget_bytes)
