"""Leak detection: memory read at the same point of every step that keeps rising.

A healthy training loop holds the same memory at the start of every step once the optimizer state
exists; a reference kept to each step's tensors (a list of losses that are never ``.item()``-ed, a
growing cache, a callback storing outputs) makes it climb a little every step until the process
is killed. The torch adapters feed this the CPU RSS or CUDA ``memory_allocated`` at step start;
MLX's subclass reads ``mx.get_active_memory()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from .errors import require_int, require_positive_int

__all__ = ["LeakDetector", "LeakReport"]

logger = logging.getLogger("memguard.leak")


@dataclass
class LeakReport:
    """A detected leak: the sampled memory grew over ``window`` consecutive samples.

    Attributes:
        step: the step of the last sample.
        growth_bytes: last - first sample over the window (bytes).
        per_step_bytes: mean growth per step (bytes).
        samples: the window's samples (bytes).
        message: one human line.
    """

    step: Optional[int]
    growth_bytes: int
    per_step_bytes: float
    samples: Tuple[int, ...]
    message: str


class LeakDetector:
    """Flags monotonic growth of a memory figure sampled once per training step.

    Rule: after ``warmup`` samples, the last ``window`` + 1 samples never decrease, at least 3 in 4
    of the steps add memory, each step adds at least ``min_step_bytes`` on average, and the total
    growth is at least ``min_growth_bytes``. After firing, the detector re-arms one window later
    (one report per window of growth).

    Args:
        window: consecutive steps of growth required (>= 2).
        min_growth_bytes: total growth over the window that counts as a leak (bytes).
        min_step_bytes: mean growth per step below which nothing is flagged (bytes).
        warmup: samples ignored at the start (optimizer state and caches are created then).
        on_leak: callable receiving the :class:`LeakReport` (its failure is logged, not raised).
        what: the figure's name in the message (``"CPU RSS"``, ``"CUDA allocated memory"``).
        hint: what to look for, appended to the message.

    Raises:
        ConfigError: bad numbers.
    """

    def __init__(self, window: int = 8, min_growth_bytes: int = 8 << 20, min_step_bytes: int = 4096,
                 warmup: int = 2, on_leak: Optional[Callable[[LeakReport], None]] = None, *,
                 what: str = "memory", hint: str = "look for tensors kept across steps (losses not "
                                                   ".item()-ed, outputs stored by a callback)"):
        require_int("leak_window", window, "an integer >= 2", lo=2)
        self.window = window
        self.min_growth_bytes = require_positive_int("leak_min_growth_bytes", min_growth_bytes, allow_zero=True)
        self.min_step_bytes = require_positive_int("leak_min_step_bytes", min_step_bytes, allow_zero=True)
        self.warmup = require_positive_int("leak_warmup", warmup, allow_zero=True)
        self.on_leak = on_leak
        self.what = what
        self.hint = hint
        self.samples: List[Tuple[Optional[int], int]] = []
        self.reports: List[LeakReport] = []
        self._armed_at = 0

    @property
    def fired(self) -> bool:
        return bool(self.reports)

    def read(self) -> Optional[int]:
        """The figure to sample when ``sample`` is given none (bytes); subclasses read their device."""
        return None

    def sample(self, step: Optional[int] = None, value_bytes: Optional[int] = None) -> Optional[LeakReport]:
        """Record the figure (bytes; default :meth:`read`) at ``step``; returns a report when a leak
        is detected at this sample. Never raises."""
        try:
            if value_bytes is None:
                value_bytes = self.read()
            if value_bytes is None:
                return None
            return self._add(step, int(value_bytes))
        except Exception as exc:  # a detector must never stop training
            logger.debug("memguard leak detector: no sample (%s)", exc)
            return None

    def _add(self, step: Optional[int], value: int) -> Optional[LeakReport]:
        self.samples.append((step, value))
        n = len(self.samples)
        if n - self.warmup < self.window + 1 or n < self._armed_at:
            return None
        win = [a for _, a in self.samples[-(self.window + 1):]]
        diffs = [b - a for a, b in zip(win[:-1], win[1:])]
        growth = win[-1] - win[0]
        if min(diffs) < 0 or growth < self.min_growth_bytes or growth / self.window < self.min_step_bytes \
                or sum(1 for d in diffs if d > 0) < len(diffs) * 0.75:
            return None
        rep = LeakReport(step, growth, growth / self.window, tuple(win),
                         f"possible memory leak: {self.what} grew at every step for {self.window} steps "
                         f"(+{growth / 2**20:.2f} MiB, {growth / self.window / 2**10:.1f} KiB/step); {self.hint}")
        self.reports.append(rep)
        self._armed_at = n + self.window
        logger.warning("memguard: %s", rep.message)
        if self.on_leak is not None:
            try:
                self.on_leak(rep)
            except Exception as exc:
                logger.warning("memguard: on_leak callback failed: %s", exc)
        return rep
