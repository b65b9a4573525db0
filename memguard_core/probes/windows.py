"""Windows memory probe: ``GlobalMemoryStatusEx`` through ctypes.

Source: Win32 API, sysinfoapi.h ``GlobalMemoryStatusEx`` and the ``MEMORYSTATUSEX`` structure
(learn.microsoft.com/windows/win32/api/sysinfoapi/ns-sysinfoapi-memorystatusex):
``dwLength, dwMemoryLoad`` (DWORD) then seven DWORDLONGs ``ullTotalPhys, ullAvailPhys,
ullTotalPageFile, ullAvailPageFile, ullTotalVirtual, ullAvailVirtual, ullAvailExtendedVirtual``;
64 bytes. ``ullAvailPhys`` is "the amount of physical memory currently available" (standby +
free + zero lists), the figure psutil reports as ``available`` on Windows (psutil/_pswindows.py).
``dwMemoryLoad`` is the percent of physical memory in use (0..100); it is not a stall time,
so ``pressure`` is left None.

Process figures: psutil ``memory_info()`` ``rss`` (working set) and ``peak_wset``.
Job-object limits (Windows containers) are not read yet.

:func:`parse_memorystatusex` works on the field values so tests feed recorded values; only
:func:`read_memorystatusex` needs Windows.
"""

from __future__ import annotations

import ctypes
import time
from typing import Dict, Mapping, Optional

from memguard_core.probes import MemorySnapshot, StepReader, _warn_once

__all__ = ["MEMORYSTATUSEX", "FIELDS", "parse_memorystatusex", "struct_to_fields",
           "read_memorystatusex", "snapshot_from_fields", "probe", "step_reader"]

FIELDS = ("dwLength", "dwMemoryLoad", "ullTotalPhys", "ullAvailPhys", "ullTotalPageFile",
          "ullAvailPageFile", "ullTotalVirtual", "ullAvailVirtual", "ullAvailExtendedVirtual")


class MEMORYSTATUSEX(ctypes.Structure):
    """The Win32 struct; DWORD = 32-bit unsigned, DWORDLONG = 64-bit unsigned."""

    _fields_ = [("dwLength", ctypes.c_uint32), ("dwMemoryLoad", ctypes.c_uint32)] + [
        (name, ctypes.c_uint64) for name in FIELDS[2:]]


def struct_to_fields(st: MEMORYSTATUSEX) -> Dict[str, int]:
    """The struct's fields as a dict of ints."""
    return {name: int(getattr(st, name)) for name in FIELDS}


def parse_memorystatusex(fields: Mapping[str, int]) -> Dict[str, Optional[int]]:
    """Interpret ``MEMORYSTATUSEX`` field values.

    Returns:
        ``{"total": ullTotalPhys, "available": ullAvailPhys (clamped to total),
        "load_percent": dwMemoryLoad}`` in bytes / percent; a missing, negative or
        inconsistent field (available > total, load > 100) is logged once and set None
        (available is then clamped).
    """
    def get(name):
        v = fields.get(name)
        if v is None:
            return None
        try:
            v = int(v)
        except (TypeError, ValueError):
            _warn_once(f"MEMORYSTATUSEX.{name}", "memguard: %s: garbage %r; ignored", name, v)
            return None
        if v < 0:
            _warn_once(f"MEMORYSTATUSEX.{name}", "memguard: %s: negative; ignored", name)
            return None
        return v

    total, avail, load = get("ullTotalPhys"), get("ullAvailPhys"), get("dwMemoryLoad")
    if total is not None and avail is not None and avail > total:
        _warn_once("MEMORYSTATUSEX.ullAvailPhys", "memguard: ullAvailPhys > ullTotalPhys; "
                   "clamped")
        avail = total
    if load is not None and load > 100:
        _warn_once("MEMORYSTATUSEX.dwMemoryLoad", "memguard: dwMemoryLoad > 100; ignored")
        load = None
    return {"total": total, "available": avail, "load_percent": load}


def read_memorystatusex() -> Dict[str, int]:
    """Call ``GlobalMemoryStatusEx`` (Windows only). Raises OSError if the call fails."""
    st = MEMORYSTATUSEX()
    st.dwLength = ctypes.sizeof(MEMORYSTATUSEX)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(st)):  # type: ignore[attr-defined]
        raise ctypes.WinError()  # type: ignore[attr-defined]
    return struct_to_fields(st)


def snapshot_from_fields(fields: Mapping[str, int], *, rss: int, peak: Optional[int],
                         now: Optional[float] = None) -> MemorySnapshot:
    """A :class:`MemorySnapshot` (``source="windows"``) from ``MEMORYSTATUSEX`` values."""
    p = parse_memorystatusex(fields)
    total = p["total"] or 0
    avail = p["available"] if p["available"] is not None else 0
    return MemorySnapshot(device="cpu", total_bytes=total, available_bytes=min(avail, total),
                          process_bytes=int(rss), process_peak_bytes=peak, pressure=None,
                          limit_bytes=None, limit_source="host", source="windows",
                          timestamp=time.monotonic() if now is None else now)


def probe(cheap: bool = False) -> MemorySnapshot:
    """Windows host snapshot. Both paths are cheap (one syscall + psutil); never raises."""
    now = time.monotonic()
    rss, peak = 0, None
    try:
        import psutil

        mi = psutil.Process().memory_info()
        rss = int(mi.rss)
        peak = int(getattr(mi, "peak_wset", 0)) or None
    except Exception as exc:
        _warn_once("windows.process", "memguard: process memory unavailable: %r", exc)
    try:
        fields = read_memorystatusex()
    except Exception as exc:
        _warn_once("windows.GlobalMemoryStatusEx", "memguard: GlobalMemoryStatusEx failed: %r",
                   exc)
        import psutil

        vm = psutil.virtual_memory()
        fields = {"ullTotalPhys": int(vm.total), "ullAvailPhys": int(vm.available)}
    return snapshot_from_fields(fields, rss=rss, peak=peak, now=now)


def step_reader() -> StepReader:
    """The runtime monitor's reader on Windows CPU: the host probe through ``probes.probe("cpu")``
    (psutil if this backend fails). The peak working set (``peak_wset``) cannot be reset, so
    there is no peak reset and no snapshot-free per-step path; Windows offers no pressure
    signal here and no live-bytes counter is read."""
    return StepReader("cpu")
