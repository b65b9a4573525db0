"""macOS memory probe: psutil for total / available, ``sysctlbyname`` for what psutil lacks
(``kern.memorystatus_level``, ``kern.memorystatus_vm_pressure_level``, ``vm.swapusage``).

:func:`probe` and :func:`step_reader` read the same counters (no subprocess); the pressure is
memorystatus's share of memory in use (``pressure_kind="memorystatus"``, fed to
:class:`memguard_core.monitor_policy.MemorystatusPolicy`), not a PSI stall time. Every sysctl goes
through :func:`_sysctlbyname`, the one boundary tests replace; the text parsers
(:func:`parse_vm_stat`, :func:`parse_sysctl`, :func:`snapshot_from_outputs`) read recorded
``vm_stat`` / ``sysctl`` output. What each figure means: docs/monitor.md, "What each probe reads"
and "One pressure model per platform".
"""

from __future__ import annotations

import re
import struct
import time
from typing import Dict, Mapping, Optional, Tuple

from .common import warn_once
from .reader import StepReader
from .snapshot import MemorySnapshot

__all__ = ["parse_vm_stat", "parse_sysctl", "available_from_vm_stat", "snapshot_from_outputs",
           "probe", "step_reader", "SYSCTL_NAMES", "KERNEL_PRESSURE_LEVELS", "read_pressure",
           "parse_swapusage_text"]

#: The sysctls of a recorded ``sysctl`` output (:func:`snapshot_from_outputs`).
SYSCTL_NAMES = ("hw.memsize", "hw.pagesize", "kern.memorystatus_level", "vm.swapusage")

#: ``kern.memorystatus_vm_pressure_level`` values (the ``DISPATCH_MEMORYPRESSURE_*`` flags,
#: dispatch/source.h) -> level name.
KERNEL_PRESSURE_LEVELS = {1: "normal", 2: "warn", 4: "critical"}

_SWAP_USED_RE = re.compile(r"used\s*=\s*([0-9.]+)([KMG])")

_PAGE_SIZE_RE = re.compile(r"page size of (\d+) bytes")


def _key(label: str) -> str:
    """``'Pages wired down'`` -> ``'wired_down'``, ``'File-backed pages'`` -> ``'file_backed'``."""
    k = label.strip().strip('"').lower()
    if k.startswith("pages "):
        k = k[len("pages "):]
    if k.endswith(" pages"):
        k = k[: -len(" pages")]
    return re.sub(r"[^a-z0-9]+", "_", k).strip("_")


def parse_vm_stat(text: str) -> Dict[str, int]:
    """Parse ``vm_stat`` output.

    Returns:
        ``{"page_size": bytes, "free": pages, "active": pages, "inactive": pages,
        "speculative": pages, "wired_down": pages, "purgeable": pages, "file_backed": pages,
        "anonymous": pages, "occupied_by_compressor": pages, ...}``. Counts are pages (not
        bytes); bad lines are logged once and skipped. ``page_size`` missing if the header is.
    """
    out: Dict[str, int] = {}
    for line in text.splitlines():
        m = _PAGE_SIZE_RE.search(line)
        if m:
            out["page_size"] = int(m.group(1))
            continue
        label, sep, value = line.rpartition(":")
        if not sep or not label.strip():
            continue
        raw = value.strip().rstrip(".")
        try:
            n = int(raw)
        except ValueError:
            warn_once(f"vm_stat:{label.strip()}", "memguard: vm_stat %s: garbage %r; ignored",
                       label.strip(), raw[:40])
            continue
        if n < 0:
            warn_once(f"vm_stat:{label.strip()}", "memguard: vm_stat %s: negative; ignored",
                       label.strip())
            continue
        out[_key(label)] = n
    return out


def parse_sysctl(text: str) -> Dict[str, str]:
    """Parse ``sysctl name ...`` output (``name: value`` per line) into ``{name: raw value}``."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() and " " not in name.strip():
            out[name.strip()] = value.strip()
    return out


def _sysctl_int(values: Mapping[str, str], name: str) -> Optional[int]:
    raw = values.get(name)
    if raw is None:
        return None
    try:
        v = int(raw)
    except ValueError:
        warn_once(f"sysctl:{name}", "memguard: sysctl %s: garbage %r; ignored", name, raw[:40])
        return None
    if v < 0:
        warn_once(f"sysctl:{name}", "memguard: sysctl %s: negative; ignored", name)
        return None
    return v


def available_from_vm_stat(vm: Mapping[str, int]) -> Optional[int]:
    """``(free + speculative + inactive) * page_size`` bytes (docs/monitor.md, "What each probe reads"), or None."""
    if "page_size" not in vm or "free" not in vm or "inactive" not in vm:
        return None
    return (vm["free"] + vm.get("speculative", 0) + vm["inactive"]) * vm["page_size"]


def snapshot_from_outputs(vm_stat_text: str, sysctl_text: str, *, rss: int,
                          peak: Optional[int], now: Optional[float] = None) -> MemorySnapshot:
    """Build a snapshot from recorded ``vm_stat`` and ``sysctl`` outputs.

    Args:
        vm_stat_text: output of ``vm_stat``.
        sysctl_text: output of ``sysctl hw.memsize hw.pagesize kern.memorystatus_level ...``.
        rss, peak: this process's resident set and its peak, bytes.
        now: timestamp (default ``time.monotonic()``).

    Returns:
        :class:`MemorySnapshot` with ``source="darwin"``. If ``hw.memsize`` is missing the
        total is the sum of the page queues; if the available figure is missing it is taken from
        ``memorystatus_level``; zeros if nothing parses (logged).
    """
    vm = parse_vm_stat(vm_stat_text)
    sc = parse_sysctl(sysctl_text)
    total = _sysctl_int(sc, "hw.memsize")
    if "page_size" not in vm:
        ps = _sysctl_int(sc, "hw.pagesize")
        if ps:
            vm["page_size"] = ps
    level = _sysctl_int(sc, "kern.memorystatus_level")
    if level is not None and level > 100:
        warn_once("sysctl:kern.memorystatus_level", "memguard: memorystatus_level %d > 100; "
                   "ignored", level)
        level = None
    if total is None and "page_size" in vm:
        queues = ("free", "active", "inactive", "speculative", "throttled", "wired_down",
                  "occupied_by_compressor")
        total = sum(vm.get(q, 0) for q in queues) * vm["page_size"] or None
    avail = available_from_vm_stat(vm)
    if avail is None and total is not None and level is not None:
        avail = total * level // 100
    if total is None or avail is None:
        warn_once("darwin.snapshot", "memguard: vm_stat/sysctl output did not parse "
                   "(total=%r, available=%r)", total, avail)
    total = total or 0
    avail = max(0, min(avail or 0, total))
    return MemorySnapshot(device="cpu", total_bytes=int(total), available_bytes=int(avail),
                          process_bytes=int(rss), process_peak_bytes=peak,
                          pressure=None if level is None else float(100 - level),
                          limit_bytes=None, limit_source="host", source="darwin",
                          timestamp=time.monotonic() if now is None else now,
                          pressure_kind=None if level is None else "memorystatus",
                          swap_used_bytes=parse_swapusage_text(sc.get("vm.swapusage", "")))


def parse_swapusage_text(text: str) -> Optional[int]:
    """``used`` of ``sysctl vm.swapusage`` text (``total = 2048.00M  used = 1263.25M  free = ...``)
    in bytes; None if absent."""
    m = _SWAP_USED_RE.search(text or "")
    if not m:
        return None
    return int(float(m.group(1)) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])


def _process_figures():
    import resource

    import psutil

    rss = int(psutil.Process().memory_info().rss)
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # bytes on macOS
    return rss, max(peak, rss)


_libc = None


def _sysctlbyname(name: str) -> Optional[bytes]:
    """The raw value of sysctl ``name`` through libc ``sysctlbyname(3)`` (size query, then read);
    None when the call fails (unknown name, no permission). macOS only: the one boundary tests
    replace."""
    import ctypes
    import ctypes.util

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = ctypes.c_size_t(0)
    if _libc.sysctlbyname(name.encode(), None, ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return None
    buf = ctypes.create_string_buffer(max(1, size.value))
    if _libc.sysctlbyname(name.encode(), buf, ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
        return None
    return buf.raw[: size.value]


def _sysctl_uint(name: str) -> Optional[int]:
    """An integer sysctl (4 or 8 bytes, little-endian on every Mac), None if unreadable."""
    raw = _sysctlbyname(name)
    if raw is None or len(raw) not in (4, 8):
        if raw is not None:
            warn_once(f"sysctl:{name}", "memguard: sysctl %s: %d bytes, not an integer; ignored",
                       name, len(raw))
        return None
    return int.from_bytes(raw, "little")


def _sysctlbyname_int(name: str) -> Optional[int]:
    """Read an integer sysctl (kept for callers of the former helper)."""
    return _sysctl_uint(name)


def read_pressure() -> Tuple[Optional[float], Optional[str], Optional[int]]:
    """``(100 - kern.memorystatus_level (percent in use), kernel level name, vm.swapusage
    xsu_used bytes)``, each None where unreadable or out of range (logged once). Never raises."""
    used = kernel = swap = None
    try:
        level = _sysctl_uint("kern.memorystatus_level")
        if level is not None and 0 <= level <= 100:
            used = float(100 - level)
        elif level is not None:
            warn_once("sysctl:kern.memorystatus_level", "memguard: memorystatus_level %d > 100; "
                       "ignored", level)
        flag = _sysctl_uint("kern.memorystatus_vm_pressure_level")
        if flag is not None:
            kernel = KERNEL_PRESSURE_LEVELS.get(flag)
            if kernel is None:
                warn_once("sysctl:kern.memorystatus_vm_pressure_level",
                           "memguard: memorystatus_vm_pressure_level %d is no known level; ignored", flag)
        raw = _sysctlbyname("vm.swapusage")
        if raw is not None and len(raw) >= 24:
            _total, _avail, swap = struct.unpack_from("<QQQ", raw)
        elif raw is not None:
            warn_once("sysctl:vm.swapusage", "memguard: vm.swapusage: %d bytes; ignored", len(raw))
    except Exception as exc:  # defensive: a probe never raises
        warn_once("darwin.sysctlbyname", "memguard: sysctlbyname failed: %r", exc)
    return used, kernel, swap


def probe(cheap: bool = False) -> MemorySnapshot:
    """macOS host snapshot (docs/monitor.md, "What each probe reads"). Never raises.

    ``total`` / ``available`` from ``psutil.virtual_memory()``; ``pressure`` = 100 -
    ``kern.memorystatus_level`` with ``pressure_kind="memorystatus"``, ``kernel_pressure`` and
    ``swap_used_bytes`` from sysctls (:func:`read_pressure`). ``cheap`` is accepted for the common
    probe signature: both paths read the same cheap counters and run no subprocess.
    """
    now = time.monotonic()
    try:
        rss, peak = _process_figures()
    except Exception as exc:
        warn_once("darwin.process", "memguard: process memory unavailable: %r", exc)
        rss, peak = 0, None
    total = avail = 0
    try:
        import psutil

        vm = psutil.virtual_memory()
        total, avail = int(vm.total), int(vm.available)
    except Exception as exc:
        warn_once("darwin.psutil", "memguard: psutil.virtual_memory() failed: %r", exc)
    used, kernel, swap = read_pressure()
    return MemorySnapshot(device="cpu", total_bytes=total, available_bytes=max(0, min(avail, total)),
                          process_bytes=rss, process_peak_bytes=peak, pressure=used,
                          limit_bytes=None, limit_source="host", source="darwin", timestamp=now,
                          pressure_kind=None if used is None and kernel is None and swap is None
                          else "memorystatus",
                          kernel_pressure=kernel, swap_used_bytes=swap)


def step_reader() -> StepReader:
    """The runtime monitor's reader on macOS CPU: the host probe through ``probes.probe("cpu")``
    (psutil if this backend fails). macOS cannot reset ``ru_maxrss`` (the process's lifetime
    high-water mark), so there is no peak reset and no snapshot-free per-step path; the
    memorystatus figures come with the snapshots (background samples); no live-bytes counter is
    read."""
    return StepReader("cpu")
