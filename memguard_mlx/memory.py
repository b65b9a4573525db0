"""MLX memory controls and small memory utilities, guarded.

* :class:`MemoryControls` -- sets the allocator's memory, cache and wired limits from a budget and
  restores the previous values afterwards.
* :class:`LeakDetector` -- flags monotonic growth of active memory across training steps.
* :func:`profile_peak`, :class:`MemoryTimeline`, :func:`find_max_batch_size` -- memory utilities,
  as public API.
* :func:`is_allocation_error` -- recognises MLX's allocation failures.

What each MLX limit does and how an allocation fails per backend: docs/mlx.md, "MLX's memory
limits".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from memguard_core.errors import ConfigError, require_fraction, require_positive_int
from memguard_core.leak import LeakDetector as _CoreLeakDetector, LeakReport

logger = logging.getLogger("memguard.mlx")

__all__ = ["MemoryControls", "LeakDetector", "LeakReport", "profile_peak", "PeakProfile",
           "MemoryTimeline", "find_max_batch_size", "is_allocation_error", "ALLOCATION_ERROR_MARKERS"]

#: Substrings of MLX's allocation-failure messages (``mlx/allocator.cpp`` ``[malloc] Unable to
#: allocate``; Metal allocator ``[metal::malloc]``: "Attempting to allocate ... greater than the
#: maximum allowed buffer size", "Resource limit ... exceeded"), plus the generic "out of memory".
ALLOCATION_ERROR_MARKERS = ("[malloc]", "unable to allocate", "[metal::malloc]",
                            "maximum allowed buffer size", "resource limit", "out of memory",
                            "insufficient memory")


def is_allocation_error(exc: BaseException) -> bool:
    """True for an MLX allocation failure (a ``RuntimeError``/``MemoryError`` whose message carries
    one of :data:`ALLOCATION_ERROR_MARKERS`)."""
    if isinstance(exc, MemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    msg = str(exc).lower()
    return any(m in msg for m in ALLOCATION_ERROR_MARKERS)


def _mx():
    import mlx.core as mx

    return mx


# ---------------------------------------------------------------------------------------------
# limits


@dataclass
class MemoryControls:
    """The MLX allocator limits memguard sets for a run, and their restoration.

    Defaults (each can be turned off with ``False``, or given in bytes):

    * ``memory_limit=True`` -> the run's budget: MLX then frees its cache and (on Metal) waits for
      running work before it grows past the budget, instead of past 1.5 x the working set.
    * ``cache_limit=True`` -> ``max(budget - planned_peak, budget // 8)``: the cache may hold what the
      budget leaves above the planned peak (at least 1/8 of the budget, so small allocations keep
      being reused); a fixed cap (say 4 GB) would be too much for small machines and too little for
      large ones.
    * ``wired_limit=True`` -> on Metal ``min(max_recommended_working_set_size, budget)`` (mlx_lm
      sets the full recommended size; wiring more than the budget would pin memory the guard
      promised to leave free); not touched on CPU.

    Use :meth:`apply` then :meth:`restore` (or as a context manager). Failures are logged, never
    raised.
    """

    memory_limit: Any = True
    cache_limit: Any = True
    wired_limit: Any = True
    applied: Dict[str, int] = field(default_factory=dict)
    previous: Dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("memory_limit", "cache_limit", "wired_limit"):
            v = getattr(self, name)
            if isinstance(v, bool) or v is None:
                continue
            if not isinstance(v, int) or v < 0:
                raise ConfigError(name, "True, False, None or a number of bytes >= 0", v)

    def plan(self, budget_bytes: int, planned_peak_bytes: Optional[int] = None,
             device_info: Optional[dict] = None) -> Dict[str, int]:
        """The limits (bytes) :meth:`apply` would set, by name."""
        budget = require_positive_int("budget_bytes", budget_bytes)
        out: Dict[str, int] = {}
        if self.memory_limit is True:
            out["memory_limit"] = budget
        elif isinstance(self.memory_limit, int) and self.memory_limit is not False:
            out["memory_limit"] = int(self.memory_limit)
        if self.cache_limit is True:
            room = budget - int(planned_peak_bytes or 0)
            out["cache_limit"] = int(max(room, budget // 8))
        elif isinstance(self.cache_limit, int) and self.cache_limit is not False:
            out["cache_limit"] = int(self.cache_limit)
        info = device_info or {}
        rec = info.get("max_recommended_working_set_size")
        if self.wired_limit is True:
            if rec:
                out["wired_limit"] = int(min(int(rec), budget))
        elif isinstance(self.wired_limit, int) and self.wired_limit is not False:
            out["wired_limit"] = int(self.wired_limit)
        return out

    def apply(self, budget_bytes: int, planned_peak_bytes: Optional[int] = None) -> Dict[str, int]:
        """Set the limits; returns what was set. Never raises (a failing setter is logged)."""
        mx = _mx()
        from .probes import device_info

        try:
            wanted = self.plan(budget_bytes, planned_peak_bytes, device_info(mx))
        except ConfigError:
            raise
        for name, value in wanted.items():
            setter = getattr(mx, "set_" + name, None)
            if setter is None:
                continue
            try:
                self.previous[name] = int(setter(int(value)))
                self.applied[name] = int(value)
            except Exception as exc:
                logger.warning("memguard: mx.set_%s(%d) failed (%s); left unchanged", name, value, exc)
        if self.applied:
            logger.info("memguard: MLX limits set: %s", ", ".join(
                f"{k}={v / 2**30:.2f} GiB" for k, v in self.applied.items()))
        return dict(self.applied)

    def restore(self) -> None:
        """Put back the limits that :meth:`apply` replaced. Never raises."""
        mx = _mx()
        for name, value in self.previous.items():
            try:
                getattr(mx, "set_" + name)(int(value))
            except Exception as exc:  # pragma: no cover - depends on the device
                logger.warning("memguard: restoring mx.set_%s failed: %s", name, exc)
        self.previous.clear()
        self.applied.clear()


# ---------------------------------------------------------------------------------------------
# leak detector


class LeakDetector(_CoreLeakDetector):
    """Flags monotonic growth of MLX active memory across training steps
    (:class:`memguard_core.leak.LeakDetector` reading ``mx.get_active_memory()``).

    The pattern of mlx-examples #1262 (and #738, #1076): memory climbs a little every step until the
    machine swaps, while each step's own work is the same -- a reference kept to a step's arrays (a
    list of losses that are never ``.item()``-ed, a growing compile cache, a callback storing
    arrays). Active memory sampled at the same point of every step (after the optimizer update is
    evaluated) is flat in a healthy run once the optimizer state exists.

    Args: as :class:`memguard_core.leak.LeakDetector` (``window``, ``min_growth_bytes``,
    ``min_step_bytes``, ``warmup``, ``on_leak``).

    Raises:
        ConfigError: bad numbers.
    """

    def __init__(self, window: int = 8, min_growth_bytes: int = 8 << 20, min_step_bytes: int = 4096,
                 warmup: int = 2, on_leak: Optional[Callable[[LeakReport], None]] = None):
        super().__init__(window, min_growth_bytes, min_step_bytes, warmup, on_leak,
                         what="MLX active memory",
                         hint="look for arrays kept across steps (losses not .item()-ed, lists in callbacks)")

    def read(self) -> Optional[int]:
        return int(_mx().get_active_memory())


# ---------------------------------------------------------------------------------------------
# utilities: peak profile, timeline, batch-size search


@dataclass(frozen=True)
class PeakProfile:
    """What :func:`profile_peak` measured (bytes).

    Attributes:
        result: the function's return value (evaluated).
        initial / peak / final: active memory before, the peak during, active after.
        leaked: ``final - initial`` (what the result and anything kept alive hold).
        seconds: wall time.
    """

    result: Any
    initial: int
    peak: int
    final: int
    seconds: float

    @property
    def leaked(self) -> int:
        return self.final - self.initial

    @property
    def added_peak(self) -> int:
        """Peak above what was active before the call (the function's own working set)."""
        return self.peak - self.initial


def profile_peak(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PeakProfile:
    """Run ``fn(*args, **kwargs)``, evaluate its result, and measure MLX memory around it.

    Resets the peak, records active, runs and ``mx.eval``-s the result, reads the peak and active.
    The peak counter is reset by this call (``mx.reset_peak_memory``).

    Returns:
        PeakProfile (bytes).
    Raises:
        whatever ``fn`` raises.
    """
    mx = _mx()
    mx.reset_peak_memory()
    initial = int(mx.get_active_memory())
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    try:
        mx.eval(result)
    except (TypeError, ValueError):
        pass  # not an array tree (e.g. None): nothing lazy to evaluate
    secs = time.perf_counter() - t0
    return PeakProfile(result, initial, int(mx.get_peak_memory()), int(mx.get_active_memory()), secs)


class MemoryTimeline:
    """Memory timeline tracker: ``mark(label)`` records active, peak
    (since the previous mark when ``reset_peak=True``) and cache memory in bytes; ``report()``
    returns readable lines.

    Args:
        reset_peak: reset ``mx.get_peak_memory`` after each mark, so every entry's peak is the
            interval's (the default); False: the peak since the process start / last reset.
    """

    def __init__(self, reset_peak: bool = True):
        self.reset_peak = reset_peak
        self.entries: List[Dict[str, Any]] = []
        self._t0 = time.perf_counter()

    def mark(self, label: str = "") -> Dict[str, Any]:
        """Record a point; returns ``{"label", "t", "active", "peak", "cache"}`` (bytes, seconds)."""
        from .probes import read_counters

        mx = _mx()
        c = read_counters(mx)
        e = {"label": label, "t": time.perf_counter() - self._t0, "active": c.active, "peak": c.peak,
             "cache": c.cache}
        self.entries.append(e)
        if self.reset_peak:
            mx.reset_peak_memory()
        return e

    track = mark

    def report(self) -> List[str]:
        out = [f"{'label':30s} {'t[s]':>7s} {'active MiB':>11s} {'peak MiB':>9s} {'cache MiB':>10s}"]
        for e in self.entries:
            out.append(f"{e['label'][:30]:30s} {e['t']:7.2f} {e['active'] / 2**20:11.2f} "
                       f"{e['peak'] / 2**20:9.2f} {e['cache'] / 2**20:10.2f}")
        return out

    def max_peak(self) -> int:
        return max((e["peak"] for e in self.entries), default=0)


def find_max_batch_size(step_fn: Callable[[int], Any], *, budget_bytes: Optional[int] = None,
                        start: int = 1, max_batch_size: int = 1024, safety_ratio: float = 0.8,
                        candidates: Optional[Sequence[int]] = None) -> Tuple[int, Dict[int, int]]:
    """Largest batch size whose measured peak stays within the budget -- guarded, not by crashing.

    The usual batch-size search doubles the batch until an allocation fails. On unified
    memory a failure never comes (the Mac swaps and freezes) and on MLX's Linux CPU backend a
    failed allocation is a SIGSEGV (see the module doc). So this measures instead: run
    ``step_fn(b)`` (a forward + backward at batch ``b``, returning arrays to evaluate) for growing
    ``b``, read ``mx.get_peak_memory()`` of each, and stop before a batch whose peak, *extrapolated
    linearly* from the last two measurements, would exceed the budget. A batch is only ever run when
    its predicted peak fits, so the probing itself stays inside the budget.

    Args:
        step_fn: ``step_fn(batch_size)`` -> arrays (evaluated here).
        budget_bytes: peak allowed (bytes); default ``(process + available) x safety_ratio`` of the
            MLX probe (container-aware on Linux, the working set on Metal).
        start: first batch size tried (>= 1); sizes double from there.
        max_batch_size: upper bound.
        safety_ratio: used only for the default budget.
        candidates: explicit increasing batch sizes instead of doubling.

    Returns:
        ``(best, peaks)``: the largest batch that fit (0 when not even ``start`` fit) and the
        measured peak (bytes) by batch size.

    Raises:
        ConfigError: bad numbers. An allocation error of ``step_fn`` is caught (the batch counts as
        not fitting); any other exception propagates.
    """
    mx = _mx()
    start = require_positive_int("start", start)
    max_batch_size = require_positive_int("max_batch_size", max_batch_size)
    if budget_bytes is None:
        from memguard_core.probes import probe

        snap = probe("mlx")
        budget_bytes = int((snap.process_bytes + snap.available_bytes)
                           * require_fraction("safety_ratio", safety_ratio))
    budget = require_positive_int("budget_bytes", budget_bytes)
    if candidates is None:
        sizes, b = [], start
        while b <= max_batch_size:
            sizes.append(b)
            b *= 2
    else:
        sizes = [require_positive_int("candidates", int(c)) for c in candidates if c <= max_batch_size]
    peaks: Dict[int, int] = {}
    best = 0
    for b in sizes:
        if len(peaks) >= 2:
            (b1, p1), (b2, p2) = list(peaks.items())[-2:]
            slope = (p2 - p1) / max(1, b2 - b1)
            predicted = p2 + slope * (b - b2)
            if predicted > budget:
                logger.info("memguard: batch %d predicted %.2f MiB > budget %.2f MiB; stopping", b,
                            predicted / 2**20, budget / 2**20)
                break
        mx.clear_cache()
        mx.reset_peak_memory()
        try:
            out = step_fn(b)
            mx.eval(out)
        except Exception as exc:
            if is_allocation_error(exc):
                logger.info("memguard: batch %d failed to allocate (%s)", b, exc)
                break
            raise
        peak = int(mx.get_peak_memory())
        del out
        peaks[b] = peak
        if peak > budget:
            break
        best = b
    mx.clear_cache()
    return best, peaks
