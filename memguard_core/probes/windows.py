"""Windows memory probe: psutil for total / available, ``GlobalMemoryStatusEx`` for the commit limit.

- total / available: ``psutil.virtual_memory()`` (``ullTotalPhys`` / ``ullAvailPhys``: standby +
  free + zero lists, psutil/_pswindows.py).
- the commit limit, which psutil does not report: Windows does not overcommit, so an allocation
  fails once the system's commit charge reaches the commit limit (RAM + page files), however much
  physical memory is free. ``GlobalMemoryStatusEx`` (sysinfoapi.h, ``MEMORYSTATUSEX``:
  ``dwLength, dwMemoryLoad`` (DWORD) then seven DWORDLONGs ``ullTotalPhys, ullAvailPhys,
  ullTotalPageFile, ullAvailPageFile, ullTotalVirtual, ullAvailVirtual,
  ullAvailExtendedVirtual``; 64 bytes; learn.microsoft.com/windows/win32/api/sysinfoapi/
  ns-sysinfoapi-memorystatusex) gives it as ``ullTotalPageFile`` ("the current committed memory
  limit for the system or the current process, whichever is smaller") and what is left of it as
  ``ullAvailPageFile``. The snapshot reports them as ``address_limit_*`` (``"commit-limit"``) and
  caps ``available_bytes`` at the commit left.
- ``dwMemoryLoad`` is the percent of physical memory in use (0..100); it is not a stall time, so
  ``pressure`` is left None.

Process figures: psutil ``memory_info()`` ``rss`` (working set) and ``peak_wset``.
Job-object limits (Windows containers) are not read yet.

:func:`parse_memorystatusex` works on the field values so tests feed recorded values; only
:func:`read_memorystatusex` needs Windows.
"""

from __future__ import annotations

import ctypes
import time
from typing import Dict, Mapping, Optional

from .common import warn_once
from .reader import StepReader
from .snapshot import MemorySnapshot

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
        "load_percent": dwMemoryLoad, "commit_limit": ullTotalPageFile, "commit_available":
        ullAvailPageFile (clamped to the limit)}`` in bytes / percent; a missing, negative or
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
            warn_once(f"MEMORYSTATUSEX.{name}", "memguard: %s: garbage %r; ignored", name, v)
            return None
        if v < 0:
            warn_once(f"MEMORYSTATUSEX.{name}", "memguard: %s: negative; ignored", name)
            return None
        return v

    total, avail, load = get("ullTotalPhys"), get("ullAvailPhys"), get("dwMemoryLoad")
    commit, commit_avail = get("ullTotalPageFile"), get("ullAvailPageFile")
    if commit is not None and commit_avail is not None and commit_avail > commit:
        warn_once("MEMORYSTATUSEX.ullAvailPageFile", "memguard: ullAvailPageFile > ullTotalPageFile; "
                   "clamped")
        commit_avail = commit
    if total is not None and avail is not None and avail > total:
        warn_once("MEMORYSTATUSEX.ullAvailPhys", "memguard: ullAvailPhys > ullTotalPhys; "
                   "clamped")
        avail = total
    if load is not None and load > 100:
        warn_once("MEMORYSTATUSEX.dwMemoryLoad", "memguard: dwMemoryLoad > 100; ignored")
        load = None
    return {"total": total, "available": avail, "load_percent": load, "commit_limit": commit,
            "commit_available": commit_avail}


def read_memorystatusex() -> Dict[str, int]:
    """Call ``GlobalMemoryStatusEx`` (Windows only). Raises OSError if the call fails."""
    st = MEMORYSTATUSEX()
    st.dwLength = ctypes.sizeof(MEMORYSTATUSEX)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(st)):  # type: ignore[attr-defined]
        raise ctypes.WinError()  # type: ignore[attr-defined]
    return struct_to_fields(st)


def snapshot_from_fields(fields: Mapping[str, int], *, rss: int, peak: Optional[int],
                         now: Optional[float] = None) -> MemorySnapshot:
    """A :class:`MemorySnapshot` (``source="windows"``) from ``MEMORYSTATUSEX`` values: physical
    total / available, available capped at the commit left (``ullAvailPageFile``) where the
    commit limit is known."""
    p = parse_memorystatusex(fields)
    total = p["total"] or 0
    avail = p["available"] if p["available"] is not None else 0
    limit, room = p["commit_limit"], p["commit_available"]
    if limit is not None and room is not None:
        avail = min(avail, room)   # committing beyond the limit fails, free RAM or not
    else:
        limit = room = None
    return MemorySnapshot(device="cpu", total_bytes=total, available_bytes=min(avail, total),
                          process_bytes=int(rss), process_peak_bytes=peak, pressure=None,
                          limit_bytes=None, limit_source="host", source="windows",
                          timestamp=time.monotonic() if now is None else now,
                          address_limit_bytes=limit,
                          address_limit_source=None if limit is None else "commit-limit",
                          address_headroom_bytes=room)


def probe(cheap: bool = False) -> MemorySnapshot:
    """Windows host snapshot: total / available from ``psutil.virtual_memory()``, the commit limit
    from ``GlobalMemoryStatusEx`` (psutil lacks it). Both paths are cheap (one syscall + psutil);
    never raises."""
    now = time.monotonic()
    rss, peak = 0, None
    fields: Dict[str, int] = {}
    try:
        import psutil

        mi = psutil.Process().memory_info()
        rss = int(mi.rss)
        peak = int(getattr(mi, "peak_wset", 0)) or None
        vm = psutil.virtual_memory()
        fields = {"ullTotalPhys": int(vm.total), "ullAvailPhys": int(vm.available)}
    except Exception as exc:
        warn_once("windows.psutil", "memguard: psutil memory figures unavailable: %r", exc)
    try:
        st = read_memorystatusex()
        fields.setdefault("ullTotalPhys", st["ullTotalPhys"])
        fields.setdefault("ullAvailPhys", st["ullAvailPhys"])
        fields["ullTotalPageFile"], fields["ullAvailPageFile"] = st["ullTotalPageFile"], st["ullAvailPageFile"]
    except Exception as exc:
        warn_once("windows.GlobalMemoryStatusEx", "memguard: GlobalMemoryStatusEx failed: %r", exc)
    return snapshot_from_fields(fields, rss=rss, peak=peak, now=now)


def step_reader() -> StepReader:
    """The runtime monitor's reader on Windows CPU: the host probe through ``probes.probe("cpu")``
    (psutil if this backend fails). The peak working set (``peak_wset``) cannot be reset, so
    there is no peak reset and no snapshot-free per-step path; Windows offers no pressure
    signal here and no live-bytes counter is read."""
    return StepReader("cpu")
