"""Memory statistics for logs and thresholds, per device, on top of :mod:`memguard_core.probes`.

:func:`memory_stats` (allocated, reserved, peak, free, total bytes and utilization),
:func:`memory_utilization`, :func:`format_memory_stats` (one line) and :func:`reset_peak_memory`:
device- and container-aware, in bytes, cheap enough for every optimizer step; they raise only
:class:`~memguard_core.errors.ConfigError` for a bad ``device``. What each key reads per device, and
why utilization is ``1 - free/total``: docs/monitor.md, "Statistics for logs".
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, Optional

from memguard_core.probes import (MemorySnapshot, allocator_counters, probe, reset_allocator_peak,
                                  resolve_device)

__all__ = ["memory_stats", "memory_utilization", "format_memory_stats", "reset_peak_memory",
           "process_file_resident_bytes", "process_bytes_apart_from"]

log = logging.getLogger("memguard.stats")

GiB = 1 << 30

# Software peak baseline for the host when the kernel reset (clear_refs) is not possible.
# hwm_at_reset: the OS peak when reset was asked; observed: max RSS seen since then.
_cpu_baseline: Optional[Dict[str, int]] = None
_lock = threading.Lock()


def _cpu_peak(snap: MemorySnapshot) -> int:
    """Peak RSS since the last :func:`reset_peak_memory` (or process start)."""
    rss = snap.process_bytes
    hwm = snap.process_peak_bytes
    with _lock:
        base = _cpu_baseline
        if base is None:
            return max(hwm or 0, rss)
        if hwm is not None and hwm > base["hwm_at_reset"]:
            # the OS high-water mark rose after the reset, so it is a peak reached since then
            return max(hwm, rss)
        base["observed"] = max(base["observed"], rss)
        return base["observed"]


def memory_stats(device: str = "auto", *, cheap: bool = True) -> Dict[str, Any]:
    """Memory statistics of ``device`` (see the module table for the per-device meaning).

    Args:
        device: ``"auto"`` | ``"cpu"`` | ``"cuda"`` | ``"cuda:<i>"`` | ``"mlx"`` | ``"mps"``
            (see :func:`memguard_core.probes.resolve_device`).
        cheap: use the per-step probe path (default); ``False`` adds NVML / vm_stat.

    Returns:
        ``{"device", "allocated_bytes", "reserved_bytes", "peak_bytes", "free_bytes",
        "total_bytes", "utilization", "pressure", "limit_source", "source"}``; sizes in bytes,
        utilization 0..1.

    Raises:
        ConfigError: bad ``device``.
    """
    dev = resolve_device(device)
    snap = probe(dev, cheap=cheap)
    allocated = reserved = snap.process_bytes
    peak: Optional[int] = snap.process_peak_bytes
    try:
        if snap.source in ("cuda", "mlx", "mps"):   # the device's own probe, not a fallback
            allocated, reserved, peak = allocator_counters(dev)
        else:
            peak = _cpu_peak(snap)
    except Exception as exc:  # a stats read never breaks training
        log.warning("memguard: reading %s allocator counters failed: %r", dev, exc)
    return {
        "device": snap.device,
        "allocated_bytes": int(allocated),
        "reserved_bytes": int(reserved),
        "peak_bytes": int(peak if peak is not None else allocated),
        "free_bytes": int(snap.available_bytes),
        "total_bytes": int(snap.total_bytes),
        "utilization": snap.used_fraction,
        "pressure": snap.pressure,
        "limit_source": snap.limit_source,
        "source": snap.source,
    }


def memory_utilization(device: str = "auto") -> float:
    """``1 - free/total`` of ``device``, 0..1 (see module doc). Raises ConfigError on bad device."""
    return float(memory_stats(device)["utilization"])


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def format_memory_stats(device: str = "auto") -> str:
    """One log line, e.g.

    ``cpu mem: 1.2 GiB rss, 1.5 GiB peak / 3.0 GiB limit (cgroup-v1) (40%)``,
    ``cuda:0 mem: 12.3 GiB allocated, 14.8 GiB peak, 16.0 GiB reserved / 80.0 GiB total (cuda)
    (19%)``, ``mlx mem: 1.0 GiB active, 1.2 GiB peak, 0.1 GiB cache / 12.0 GiB limit (mlx) (8%)``.
    The percentage is ``utilization``. Raises ConfigError on a bad device.
    """
    s = memory_stats(device)
    kind = s["limit_source"].split(":", 1)[0]
    bound = "total" if kind in ("host", "cuda") else "limit"
    pct = f"({s['utilization'] * 100:.0f}%)"
    tail = f"/ {_gib(s['total_bytes'])} {bound} ({kind}) {pct}"
    if s["source"] == "cuda":
        head = (f"{_gib(s['allocated_bytes'])} allocated, {_gib(s['peak_bytes'])} peak, "
                f"{_gib(s['reserved_bytes'])} reserved")
    elif s["source"] == "mps":
        head = f"{_gib(s['allocated_bytes'])} allocated, {_gib(s['reserved_bytes'])} driver"
    elif s["source"] == "mlx":
        head = (f"{_gib(s['allocated_bytes'])} active, {_gib(s['peak_bytes'])} peak, "
                f"{_gib(s['reserved_bytes'] - s['allocated_bytes'])} cache")
    else:
        head = f"{_gib(s['allocated_bytes'])} rss, {_gib(s['peak_bytes'])} peak"
    return f"{s['device']} mem: {head} {tail}"


def reset_peak_memory(device: str = "auto", *, proc_root: str = "/proc") -> str:
    """Start a new peak window for ``device``.

    - cuda: ``torch.cuda.reset_peak_memory_stats(i)`` -> returns ``"allocator"``.
    - mlx: ``mx.reset_peak_memory()`` -> ``"allocator"``.
    - mps: ``torch.mps`` has no peak counter to reset -> ``"none"`` (``peak_bytes`` is the
      driver-allocated figure, cache included).
    - cpu on Linux: write ``5`` to ``/proc/self/clear_refs``, which resets VmHWM to the current
      RSS (kernel Documentation/filesystems/proc.rst, "clear_refs") -> ``"kernel"``. ``ru_maxrss``
      and ``time -v`` read the same mark: the peak erased is kept first
      (:func:`memguard_core.process_peak.process_peak_rss_bytes`, the process's peak over its life).
      Where that is not allowed (old kernel, seccomp, read-only /proc) and on macOS / Windows,
      a software baseline is kept instead -> ``"software"``: until the OS high-water mark
      rises above its value at the reset, ``peak_bytes`` is the largest RSS seen by
      :func:`memory_stats` since the reset (a lower bound of the true peak); once it rises,
      the OS figure is exact again.

    Returns:
        how the reset was done (``"allocator"``, ``"kernel"`` or ``"software"``), ``"none"``
        where the device has no peak to reset (mps), or ``"failed"`` if the framework call raised
        (logged).

    Raises:
        ConfigError: bad ``device``.
    """
    global _cpu_baseline
    dev = resolve_device(device)
    try:
        if dev != "cpu":
            return "allocator" if reset_allocator_peak(dev) else "none"
    except Exception as exc:
        log.warning("memguard: resetting the %s peak failed: %r", dev, exc)
        return "failed"

    try:
        if proc_root == "/proc":
            from memguard_core.probes.linux import peak

            if not peak.reset_peak():   # keeps the descriptor and notes the ru_maxrss floor
                raise OSError("/proc/self/clear_refs not writable")
        else:
            with open(os.path.join(proc_root, "self", "clear_refs"), "w") as fh:
                fh.write("5")
        with _lock:
            _cpu_baseline = None
        return "kernel"
    except OSError as exc:
        log.debug("memguard: clear_refs not writable (%s); keeping a software peak", exc)
    snap = probe("cpu", cheap=True)
    with _lock:
        _cpu_baseline = {"hwm_at_reset": int(snap.process_peak_bytes or snap.process_bytes),
                         "observed": int(snap.process_bytes)}
    return "software"


def process_file_resident_bytes() -> Optional[int]:
    """This process's file-backed resident pages (``RssFile`` of /proc/self/status: mapped
    libraries and files), bytes; None off Linux or when unreadable. Never raises."""
    try:
        from memguard_core.probes.linux import proc

        return proc.read_status(keys=frozenset(("RssFile",))).get("RssFile")
    except Exception:
        return None



def process_bytes_apart_from(ranges) -> Optional[int]:
    """This process's resident set (``VmRSS``) less the resident bytes of ``ranges`` (``(address,
    nbytes)`` pairs: the model's tensor storages), bytes, >= 0: what the process holds apart from
    them (interpreter, libraries, the heap kept from loading, data in memory). Pages of a
    memory-mapped checkpoint not yet touched are neither in the RSS nor taken out of it
    (``memguard_core.probes.linux.smaps.resident_bytes_in``). None off Linux or when unreadable.
    Never raises."""
    try:
        from memguard_core.probes.linux import proc, smaps

        rss = proc.read_status(keys=frozenset(("VmRSS",))).get("VmRSS")
        held = smaps.resident_bytes_in(ranges)
        if rss is None or held is None:
            return None
        return max(0, int(rss) - int(held))
    except Exception:
        return None
