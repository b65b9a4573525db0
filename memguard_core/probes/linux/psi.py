"""Pressure stall information (PSI) of memory for the Linux probe: the cgroup's own v2
``memory.pressure``, else /proc/pressure/memory (kernel Documentation/accounting/psi.rst). See
docs/monitor.md, "Pressure".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional

from ..common import warn_once
from .cgroup import locate_cgroups, location
from .files import read_text

__all__ = ["Psi", "parse_psi", "read_psi", "pressure"]


@dataclass(frozen=True)
class Psi:
    """Memory pressure stall information.

    ``*_avg10/60/300`` are percent (0..100) of wall time in the last 10/60/300 s during which
    *some* (at least one) / *full* (all non-idle) tasks stalled on memory; ``*_total_us`` is the
    cumulative stall time in microseconds (Documentation/accounting/psi.rst). ``None`` where
    the line or field is missing. ``path`` is the file read.
    """

    some_avg10: Optional[float]
    some_avg60: Optional[float]
    some_avg300: Optional[float]
    some_total_us: Optional[int]
    full_avg10: Optional[float]
    full_avg60: Optional[float]
    full_avg300: Optional[float]
    full_total_us: Optional[int]
    path: str = ""


def parse_psi(text: str, where: str = "pressure") -> Optional[Psi]:
    """Parse a PSI file (``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` / ``full ...``).

    Returns:
        :class:`Psi`, or None when neither a ``some`` nor a ``full`` line parses.
        Averages outside 0..100 or garbage are logged once and left as None.
    """
    vals: Dict[str, Optional[float]] = {}
    seen = False
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] not in ("some", "full"):
            continue
        kind = parts[0]
        for item in parts[1:]:
            key, _, raw = item.partition("=")
            if key not in ("avg10", "avg60", "avg300", "total"):
                continue
            try:
                v = int(raw) if key == "total" else float(raw)
            except ValueError:
                warn_once(f"{where}:{kind}.{key}", "memguard: %s %s %s: garbage %r; ignored",
                           where, kind, key, raw[:40])
                continue
            if v < 0 or (key != "total" and v > 100.0):
                warn_once(f"{where}:{kind}.{key}", "memguard: %s %s %s: out of range %r; "
                           "ignored", where, kind, key, raw[:40])
                continue
            vals[f"{kind}_{key}"] = v
            seen = True
    if not seen:
        return None
    return Psi(
        some_avg10=vals.get("some_avg10"), some_avg60=vals.get("some_avg60"),
        some_avg300=vals.get("some_avg300"),
        some_total_us=_int_or_none(vals.get("some_total")),
        full_avg10=vals.get("full_avg10"), full_avg60=vals.get("full_avg60"),
        full_avg300=vals.get("full_avg300"),
        full_total_us=_int_or_none(vals.get("full_total")),
        path=where,
    )


def _int_or_none(v) -> Optional[int]:
    return None if v is None else int(v)


def read_psi(proc_root: str = "/proc", sys_root: str = "", *,
             cgroup_dir: Optional[str] = None) -> Optional[Psi]:
    """Memory PSI of this process's cgroup (v2 ``memory.pressure``), else system-wide.

    Args:
        proc_root, sys_root: roots (see module doc).
        cgroup_dir: a cgroup v2 directory whose ``memory.pressure`` to read; default: the
            process's own v2 cgroup found via mountinfo.

    Returns:
        :class:`Psi` or None (PSI disabled, e.g. kernel booted with ``psi=0``, or < 4.20).
    """
    if cgroup_dir is None:
        loc = locate_cgroups(proc_root, sys_root)
        cgroup_dir = loc.v2_dir
    candidates = []
    if cgroup_dir:
        candidates.append(os.path.join(cgroup_dir, "memory.pressure"))
    candidates.append(os.path.join(proc_root, "pressure", "memory"))
    for path in candidates:
        text = read_text(path)
        if text is None:
            continue
        psi = parse_psi(text, path)
        if psi is not None:
            return psi
        warn_once(path, "memguard: %s holds no PSI lines; ignored", path)
    return None


def pressure() -> Optional[float]:
    """PSI ``some avg10`` of memory (percent) of this process's cgroup v2 (``memory.pressure``),
    else of the host (/proc/pressure/memory); None where the kernel has no PSI. Uses the cgroup
    location found by the last full :func:`memguard_core.probes.linux.probe` (no mountinfo
    parse): the monitor's background thread reads this alone between full samples. Never raises."""
    try:
        loc = location("/proc", "", refresh=False)
        psi = read_psi("/proc", "", cgroup_dir=loc.v2_dir or "")
        return None if psi is None else psi.some_avg10
    except Exception as exc:  # defensive: a probe never raises
        warn_once("linux.pressure", "memguard: reading PSI failed: %r", exc)
        return None
