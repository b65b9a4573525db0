"""What every probe returns: :class:`MemorySnapshot` (one reading of a device's memory) and the
helpers that display it (``memguard probe``). See docs/monitor.md, "Probes".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

__all__ = ["MemorySnapshot", "total_limit", "PRESSURE_LABELS", "display_rows", "host_pressure_fields"]


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of the memory a training process can use on one device.

    All sizes are bytes.

    Attributes:
        device: ``"cpu"``, ``"cuda:<index>"``, ``"mlx"`` or ``"mps"``.
        total_bytes: the most this process may use: ``min(host or device total, container
            limit)``. On CUDA the device's total memory; on MLX/Metal the recommended working
            set (``max_recommended_working_set_size``).
        available_bytes: what it can still take, container-aware: on Linux
            ``min(MemAvailable, limit - working_set)`` over the cgroup and its ancestors; on
            CUDA the driver's free memory (sees other processes) plus the blocks this
            process's caching allocator holds but does not use (it can reuse them); never
            negative.
        process_bytes: used by this process: RSS on cpu, allocator-reserved (+ CUDA context
            where NVML tells it) on cuda, active memory on mlx.
        process_peak_bytes: VmHWM (Linux) / ``ru_maxrss`` (macOS) / peak working set
            (Windows) on cpu, ``max_memory_reserved`` on cuda, ``mx.get_peak_memory`` on mlx;
            ``None`` if unknown.
        pressure: percent 0..100. Linux: PSI ``some avg10`` of memory (share of the last 10 s
            in which at least one task stalled on memory; kernel Documentation/accounting/psi.rst).
            macOS: ``100 - kern.memorystatus_level`` (share of memory the kernel does not
            count as available; NOT a stall time: ``pressure_kind`` says which). ``None``
            elsewhere.
        limit_bytes: the container (cgroup) limit in force (smaller than the host total),
            ``None`` if none.
        limit_source: ``"host"``, ``"cgroup-v1:<dir>"``, ``"cgroup-v2:<dir>"`` (the cgroup
            directory whose limit won), ``"cuda"``, ``"mlx"`` / ``"mps"`` (Metal working set).
        source: the probe that produced it: ``"linux"``, ``"darwin"``, ``"windows"``,
            ``"cuda"``, ``"mlx"``, ``"mps"``, or ``"psutil"`` / ``"none"`` for the fallbacks used when
            the platform probe failed.
        timestamp: ``time.monotonic()`` at the reading.
        pressure_kind: what ``pressure`` measures, so that each pressure policy reads only its own
            platform's figure: ``"psi"`` (Linux stall share), ``"memorystatus"`` (macOS share in
            use), None where ``pressure`` is None or its kind is unknown.
        kernel_pressure: the kernel's own pressure level where it publishes one: macOS
            ``kern.memorystatus_vm_pressure_level`` as ``"normal"`` / ``"warn"`` / ``"critical"``
            (the ``DISPATCH_MEMORYPRESSURE_*`` levels); None elsewhere or when unreadable.
        swap_used_bytes: swap in use on the host (macOS ``vm.swapusage`` ``xsu_used``), bytes; the
            monitor turns successive readings into swap activity. None where not read.
        address_limit_bytes: a limit on this process's *virtual* memory in force, bytes: the soft
            ``RLIMIT_AS`` or ``RLIMIT_DATA`` (setrlimit(2); what ``ulimit -v`` / ``prlimit --as``
            set) with the least room left, or the Windows commit limit; None where none is set.
        address_limit_source: which one: ``"RLIMIT_AS"``, ``"RLIMIT_DATA"`` or ``"commit-limit"``;
            None with no such limit.
        address_headroom_bytes: the room left under that limit for new mappings, bytes: the limit
            minus what it counts now (``RLIMIT_AS``: ``VmSize``; ``RLIMIT_DATA``: ``VmData +
            VmStk``, /proc/self/status; the commit limit: ``ullAvailPageFile``), never negative.
            It is virtual address space, not RSS: ``available_bytes`` is capped by it (every new
            resident byte of a fresh allocation needs as much new mapping, so the cap is the
            conservative translation to the resident figures the monitor compares) and
            ``total_bytes`` by the limit itself (RSS <= VmSize <= RLIMIT_AS).
    """

    device: str
    total_bytes: int
    available_bytes: int
    process_bytes: int
    process_peak_bytes: Optional[int]
    pressure: Optional[float]
    limit_bytes: Optional[int]
    limit_source: str
    source: str
    timestamp: float
    pressure_kind: Optional[str] = None
    kernel_pressure: Optional[str] = None
    swap_used_bytes: Optional[int] = None
    address_limit_bytes: Optional[int] = None
    address_limit_source: Optional[str] = None
    address_headroom_bytes: Optional[int] = None

    @property
    def used_fraction(self) -> float:
        """``1 - available/total`` in 0..1; 0.0 when the total is unknown (``total_bytes <= 0``)."""
        if self.total_bytes <= 0:
            return 0.0
        frac = 1.0 - self.available_bytes / self.total_bytes
        return min(1.0, max(0.0, frac))


def total_limit(snap: MemorySnapshot) -> tuple:
    """The limit that set ``snap.total_bytes`` and its name, for display (``memguard probe``).

    Returns:
        ``(bytes, source)``: the virtual-memory limit (``address_limit_bytes``,
        ``"RLIMIT_AS"`` / ``"RLIMIT_DATA"`` / ``"commit-limit"``) when it capped the total; else
        the container limit (``limit_bytes``, ``limit_source``: ``"cgroup-v2:<dir>"`` ...);
        else ``(None, limit_source)``: the host's (or device's) own total, nothing below it.
    """
    a = snap.address_limit_bytes
    if a is not None and snap.address_limit_source and snap.total_bytes == a \
            and (snap.limit_bytes is None or a <= snap.limit_bytes):
        return a, snap.address_limit_source
    if snap.limit_bytes:
        return snap.limit_bytes, snap.limit_source
    return None, snap.limit_source


#: What ``MemorySnapshot.pressure`` measures, by ``pressure_kind``, with its unit (display).
PRESSURE_LABELS = {"psi": "pressure (PSI some avg10, % stalled)",
                   "memorystatus": "pressure (memory the kernel counts in use, %)"}


def display_rows(snap: MemorySnapshot, fmt: Callable[[Optional[float]], str]) -> List[tuple]:
    """``(what, value)`` rows of ``memguard probe``'s table: the totals with the limit that set
    the total and its source, the container and virtual-memory limits apart (``none`` when not
    set), the process figures, and the pressure with its unit (``pressure_kind``). ``fmt``
    formats bytes."""
    lim, src = total_limit(snap)
    rows = [("device", snap.device), ("total", fmt(snap.total_bytes)),
            ("total set by", f"{src} ({fmt(lim)})" if lim is not None else f"{src} (no lower limit)"),
            ("available", fmt(snap.available_bytes)),
            ("container limit", f"{fmt(snap.limit_bytes)} ({snap.limit_source})" if snap.limit_bytes else "none"),
            ("address-space limit", f"{fmt(snap.address_limit_bytes)} ({snap.address_limit_source}; "
                                    f"{fmt(snap.address_headroom_bytes)} left)"
             if snap.address_limit_bytes is not None else "none"),
            ("this process", fmt(snap.process_bytes)), ("this process, peak", fmt(snap.process_peak_bytes))]
    label = PRESSURE_LABELS.get(snap.pressure_kind or "", "pressure (%)")
    rows.append((label, "-" if snap.pressure is None else f"{snap.pressure:.2f}"))
    if snap.kernel_pressure:
        rows.append(("kernel pressure level", snap.kernel_pressure))
    rows.append(("used", f"{snap.used_fraction:.0%}"))
    return rows


def host_pressure_fields(host: MemorySnapshot) -> Dict[str, object]:
    """The host snapshot's pressure fields (``pressure_kind``, ``kernel_pressure``,
    ``swap_used_bytes``) as keyword arguments of a device snapshot that reports the host's pressure
    (MLX, MPS), named by their model (the host's own probe decided it: PSI on Linux,
    memorystatus on macOS)."""
    kind = getattr(host, "pressure_kind", None)
    if kind is None and host.pressure is not None:
        kind = {"darwin": "memorystatus", "linux": "psi"}.get(host.source)
    return {"pressure_kind": kind,
            "kernel_pressure": getattr(host, "kernel_pressure", None),
            "swap_used_bytes": getattr(host, "swap_used_bytes", None)}
