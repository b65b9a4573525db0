"""The runtime monitor's vocabulary: pressure levels, actions, the level thresholds, the grow-back
policy and the decision record (:class:`MemoryEvent`). Plain values; docs/monitor.md.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from .errors import ConfigError, require_fraction, require_int, require_number

__all__ = ["Level", "Action", "Thresholds", "GrowPolicy", "MemoryEvent"]


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
    around a threshold). Defaults 85 / 90 / 95 %, 5 points of hysteresis.

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
class GrowPolicy:
    """When the micro-batches per batch k may halve again after pressure has gone (see :class:`MicroBatchPolicy`).

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
        require_int("grow.steps", self.steps, "an integer >= 1")
        for name, lo, strict in (("seconds", 0.0, False), ("backoff", 1.0, True), ("max_backoff", 1.0, False)):
            require_number(f"grow.{name}", getattr(self, name), f"a number {'>' if strict else '>='} {lo:g}",
                           lo=lo, lo_open=strict)


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
        micro_batches: the micro-batches per batch k after this decision.
        source: ``step`` (per-step sample), ``background``, ``psi`` (sustained memory pressure,
            see :class:`PsiPolicy`; ``usage`` is then the latest usage), ``memorystatus`` (macOS
            pressure, see :class:`MemorystatusPolicy`), ``alloc_retries`` (the CUDA allocator's
            retries, see :class:`AllocRetryPolicy`) or ``request``. A
            grow-back (action ``grow``) and its undo (action ``split``) come from ``step``.
        message: one human line.
    """

    step: Optional[int]
    level: Level
    action: Action
    usage: float
    used_bytes: int
    budget_bytes: int
    micro_batches: int
    source: str
    message: str
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"step": self.step, "level": self.level.name.lower(), "action": self.action.value,
                "usage": round(self.usage, 4), "used_bytes": self.used_bytes,
                "budget_bytes": self.budget_bytes, "micro_batches": self.micro_batches, "source": self.source,
                "message": self.message}
