"""macOS memory probe: ``sysctl hw.memsize``, ``vm_stat``, ``kern.memorystatus_level``.

macOS has no container limits and no OOM error: when unified memory runs out it compresses,
then swaps, then the memorystatus ("jetsam") subsystem kills processes. So the signals are:

- total: ``hw.memsize`` (bytes of physical RAM), sysctl(3).
- available: ``(free + speculative + inactive) * page size`` from ``vm_stat``. This is psutil's
  ``virtual_memory().available`` on macOS (psutil/_psosx.py: ``avail = inactive + free`` where
  psutil's ``free`` is the kernel's ``free_count``), which psutil took from Zabbix
  (src/libs/zbxsysinfo/osx/memory.c). ``vm_stat`` prints ``Pages free`` as
  ``free_count - speculative_count`` (Apple system_cmds, vm_stat.c), so speculative is added
  back. ``Pages purgeable`` is NOT added: purgeable pages sit on the active/inactive queues
  too, so adding them would count some pages twice; leaving them out errs on the safe side.
- pressure: ``100 - kern.memorystatus_level``. ``kern.memorystatus_level`` is the percentage
  of memory the kernel counts as available to memorystatus (bsd/kern/kern_memorystatus.c:
  ``memorystatus_level = available_pages * 100 / total_pages``); it falls as pressure rises.
  It is not a PSI stall time; consumers must compare it by ``snapshot.source``.
- process: RSS from psutil, peak from ``getrusage(RUSAGE_SELF).ru_maxrss`` (bytes on macOS,
  getrusage(2)).

The parse functions take the raw command output so tests feed recorded outputs; the
subprocess calls (and the ctypes ``sysctlbyname`` of the cheap path) are the only parts that
need a Mac. The cheap path runs no subprocess: it uses psutil's ``host_statistics64`` reading
(same formula) and ``sysctlbyname`` through ctypes.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Dict, Mapping, Optional

from memguard_core.probes import MemorySnapshot, StepReader, _warn_once

__all__ = ["parse_vm_stat", "parse_sysctl", "available_from_vm_stat", "snapshot_from_outputs",
           "probe", "step_reader", "SYSCTL_NAMES"]

#: What the full probe asks ``sysctl`` for.
SYSCTL_NAMES = ("hw.memsize", "hw.pagesize", "kern.memorystatus_level", "vm.swapusage")

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
            _warn_once(f"vm_stat:{label.strip()}", "memguard: vm_stat %s: garbage %r; ignored",
                       label.strip(), raw[:40])
            continue
        if n < 0:
            _warn_once(f"vm_stat:{label.strip()}", "memguard: vm_stat %s: negative; ignored",
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
        _warn_once(f"sysctl:{name}", "memguard: sysctl %s: garbage %r; ignored", name, raw[:40])
        return None
    if v < 0:
        _warn_once(f"sysctl:{name}", "memguard: sysctl %s: negative; ignored", name)
        return None
    return v


def available_from_vm_stat(vm: Mapping[str, int]) -> Optional[int]:
    """``(free + speculative + inactive) * page_size`` bytes (see module doc), or None."""
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
        _warn_once("sysctl:kern.memorystatus_level", "memguard: memorystatus_level %d > 100; "
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
        _warn_once("darwin.snapshot", "memguard: vm_stat/sysctl output did not parse "
                   "(total=%r, available=%r)", total, avail)
    total = total or 0
    avail = max(0, min(avail or 0, total))
    return MemorySnapshot(device="cpu", total_bytes=int(total), available_bytes=int(avail),
                          process_bytes=int(rss), process_peak_bytes=peak,
                          pressure=None if level is None else float(100 - level),
                          limit_bytes=None, limit_source="host", source="darwin",
                          timestamp=time.monotonic() if now is None else now)


def _process_figures():
    import resource

    import psutil

    rss = int(psutil.Process().memory_info().rss)
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # bytes on macOS
    return rss, max(peak, rss)


def _sysctlbyname_int(name: str) -> Optional[int]:
    """Read an integer sysctl through libc ``sysctlbyname`` (no subprocess; macOS only)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = ctypes.c_uint64(0)
    size = ctypes.c_size_t(ctypes.sizeof(buf))
    if libc.sysctlbyname(name.encode(), ctypes.byref(buf), ctypes.byref(size), None,
                         ctypes.c_size_t(0)) != 0:
        return None
    # 4-byte sysctls (kern.memorystatus_level is an int) fill the low bytes (little-endian).
    return int(buf.value & 0xFFFFFFFF) if size.value == 4 else int(buf.value)


def probe(cheap: bool = False) -> MemorySnapshot:
    """macOS host snapshot (see module doc). Runs only on macOS; never raises.

    ``cheap=False`` runs ``sysctl`` and ``vm_stat`` (two subprocesses);
    ``cheap=True`` uses psutil (``host_statistics64``, same available formula) and
    ``sysctlbyname`` through ctypes.
    """
    now = time.monotonic()
    try:
        rss, peak = _process_figures()
    except Exception as exc:
        _warn_once("darwin.process", "memguard: process memory unavailable: %r", exc)
        rss, peak = 0, None
    if not cheap:
        try:
            vm_out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5,
                                    check=True).stdout
            sc_out = subprocess.run(["sysctl", *SYSCTL_NAMES], capture_output=True, text=True,
                                    timeout=5).stdout
            return snapshot_from_outputs(vm_out, sc_out, rss=rss, peak=peak, now=now)
        except Exception as exc:
            _warn_once("darwin.subprocess", "memguard: vm_stat/sysctl failed (%r); using the "
                       "cheap path", exc)
    import psutil

    vm = psutil.virtual_memory()
    level = None
    try:
        level = _sysctlbyname_int("kern.memorystatus_level")
    except Exception as exc:
        _warn_once("darwin.sysctlbyname", "memguard: sysctlbyname failed: %r", exc)
    if level is not None and not 0 <= level <= 100:
        level = None
    return MemorySnapshot(device="cpu", total_bytes=int(vm.total),
                          available_bytes=int(vm.available), process_bytes=rss,
                          process_peak_bytes=peak,
                          pressure=None if level is None else float(100 - level),
                          limit_bytes=None, limit_source="host", source="darwin", timestamp=now)


def step_reader() -> StepReader:
    """The runtime monitor's reader on macOS CPU: the host probe through ``probes.probe("cpu")``
    (psutil if this backend fails). macOS cannot reset ``ru_maxrss`` (the process's lifetime
    high-water mark), so there is no peak reset and no snapshot-free per-step path; the
    memorystatus level comes with the full snapshots only; no live-bytes counter is read."""
    return StepReader("cpu")
