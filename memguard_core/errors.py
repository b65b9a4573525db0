"""Exceptions raised by memguard.

Every error that comes from bad input names the offending field and what was expected,
so a CLI user or a config file author can fix it without reading the source.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence


class MemGuardError(Exception):
    """Base class of every error memguard raises on purpose."""


class ConfigError(MemGuardError, ValueError):
    """A user-supplied value is missing or invalid.

    Attributes:
        field: name of the bad field (as the user spelled it: a CLI flag, a kwarg, a config key).
        expected: what a valid value looks like.
        got: the value received (``None`` if it was missing).
    """

    def __init__(self, field: str, expected: str, got: Any = None):
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"invalid {field!s}: expected {expected}, got {got!r}")


class DoesNotFitError(MemGuardError):
    """No downgrade of the training settings fits the memory budget.

    Attributes:
        shortfall_bytes: bytes the smallest plan still lacks (peak - budget).
        budget_bytes: the budget the planner had.
        best_peak_bytes: the estimated peak of the smallest plan tried.
        suggestions: concrete changes the user can make (quantize, shorter sequences, ...).
        target_note: how the planner's target derives from ``budget_bytes`` when it is not the budget
            itself (the preflight plans below the monitor's warning level, less what the process
            already holds), for the message; the shortfall is then measured against that target.
    """

    def __init__(self, shortfall_bytes: int, budget_bytes: int, best_peak_bytes: int,
                 suggestions: Sequence[str], *, target_note: str = ""):
        self.shortfall_bytes = int(shortfall_bytes)
        self.budget_bytes = int(budget_bytes)
        self.best_peak_bytes = int(best_peak_bytes)
        self.suggestions = list(suggestions)
        self.target_note = target_note
        lines = [
            f"training does not fit: the smallest plan needs {best_peak_bytes / 2**30:.2f} GiB, "
            f"the budget is {budget_bytes / 2**30:.2f} GiB{target_note} "
            f"(short by {shortfall_bytes / 2**30:.2f} GiB).",
            "Try:",
        ] + [f"  - {s}" for s in self.suggestions]
        super().__init__("\n".join(lines))


def require_positive_int(field: str, value: Any, *, allow_zero: bool = False) -> int:
    """Validate an integer count (batch size, sequence length, ...).

    Raises:
        ConfigError: ``value`` is not an int (bools rejected) or is < 1 (< 0 with ``allow_zero``).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise ConfigError(field, "an integer", value) from None
    lo = 0 if allow_zero else 1
    if value < lo:
        raise ConfigError(field, f"an integer >= {lo}", value)
    return value


def require_int(field: str, value: Any, expected: str, *, lo: int = 1, allow_none: bool = False) -> Optional[int]:
    """Validate a strict integer >= ``lo`` (``None`` too with ``allow_none``). Unlike
    :func:`require_positive_int`, a float such as ``3.0`` is rejected; the error says ``expected``.

    Raises:
        ConfigError: ``value`` is a bool, not an int, or < ``lo``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(field, expected, value)
    return value


def require_choice(field: str, value: Any, choices: Sequence[str]) -> str:
    """Validate that ``value`` is one of ``choices`` (case-insensitive for strings).

    Raises:
        ConfigError: value not among the choices.
    """
    if isinstance(value, str):
        v = value.strip().lower()
        for c in choices:
            if v == c.lower():
                return c
    raise ConfigError(field, "one of " + ", ".join(repr(c) for c in choices), value)


def require_fraction(field: str, value: Any, *, lo: float = 0.0, hi: float = 1.0) -> float:
    """Validate a ratio in (lo, hi].

    Raises:
        ConfigError: not a number or outside (lo, hi].
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(field, f"a number in ({lo}, {hi}]", value)
    if not (lo < float(value) <= hi):
        raise ConfigError(field, f"a number in ({lo}, {hi}]", value)
    return float(value)


def require_number(field: str, value: Any, expected: str, *, lo: Optional[float] = None,
                   lo_open: bool = False, hi: Optional[float] = None, allow_none: bool = False) -> Optional[float]:
    """Validate a finite real number (``bool`` is not one) with optional bounds: ``value >= lo``
    (``> lo`` with ``lo_open``) and ``value <= hi``.

    Args:
        field: the name the error gives.
        expected: what the error says was expected (e.g. ``"a number of seconds >= 0"``).

    Returns:
        ``float(value)``, or None when ``value`` is None and ``allow_none``.

    Raises:
        ConfigError: not a finite number, or out of bounds.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(field, expected, value)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ConfigError(field, expected, value)
    if hi is not None and value > hi:
        raise ConfigError(field, expected, value)
    return float(value)


class WindowOOMError(MemGuardError, RuntimeError):
    """An out-of-memory error that redoing the accumulation window cannot get past: the failing
    forward already ran one row (sequence) at a time, or the window failed ``redos`` times in a row.

    The message names where it failed, the micro-batches tried and the plan that would fit (the
    preflight's, when one ran; else the changes to try). Contains "out of memory" so tools that
    match on it (``memguard run``, accelerate's ``should_reduce_batch_size``) still see an OOM.

    Attributes:
        phase: where the last failure was raised (``forward``, ``backward``, ``optimizer step``).
        micro_batches: micro-batches per batch of the last attempt.
        rows: rows (packed: sequences) of the batch.
        redos: window redos done before giving up.
        plan: lines of the plan that would fit (may be empty).
    """

    def __init__(self, phase: str, micro_batches: int, rows: int, redos: int, reason: str,
                 plan: Sequence[str] = ()):
        self.phase, self.micro_batches, self.rows, self.redos = phase, int(micro_batches), int(rows), int(redos)
        self.plan = list(plan)
        lines = [f"memguard: out of memory in the {phase} that redoing the accumulation window cannot get past: "
                 f"{reason} ({micro_batches} micro-batches of a {rows}-row batch, {redos} window redo(s))."]
        if self.plan:
            lines += ["A plan that would fit:"] + [f"  - {p}" for p in self.plan]
        super().__init__("\n".join(lines))
