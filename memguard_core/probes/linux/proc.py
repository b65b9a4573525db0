"""/proc/meminfo and /proc/<pid>/status for the Linux probe: the host's total and available memory,
this process's resident set and its peak (kernel Documentation/filesystems/proc.rst). See
docs/monitor.md, "Probes".
"""

from __future__ import annotations

import os
import re
from typing import Dict, Optional

from ..common import warn_once
from .files import read_text

__all__ = ["parse_meminfo", "parse_status", "read_meminfo", "read_status", "MEMINFO_KEYS",
           "MEMINFO_KEY", "STATUS_KEYS"]

_KB_LINE = re.compile(r"^([^:\s]+):\s+(\S+)(?:\s+(kB))?\s*$")


def parse_meminfo(text: str, where: str = "meminfo",
                  keys: Optional[frozenset] = None) -> Dict[str, int]:
    """Parse /proc/meminfo (or the Vm*/Rss* lines of /proc/<pid>/status).

    Args:
        keys: parse only these keys (the per-step path); default all.

    Returns:
        ``{key: value}`` with ``kB`` values converted to bytes (x1024; "kB" in these files is
        KiB, proc.rst). Lines that do not parse or hold negative numbers are skipped (logged once).
    """
    out: Dict[str, int] = {}
    if keys is not None:
        lines = []
        for key in keys:   # find the few wanted lines instead of scanning all ~50 (per-step path)
            i = text.find(key + ":")
            while i > 0 and text[i - 1] != "\n":
                i = text.find(key + ":", i + 1)
            if i >= 0:
                j = text.find("\n", i)
                lines.append(text[i:] if j < 0 else text[i:j])
    else:
        lines = text.splitlines()
    for line in lines:
        m = _KB_LINE.match(line.strip())
        if not m:
            continue
        key, num, unit = m.groups()
        try:
            value = int(num)
        except ValueError:
            if unit:  # a kB line with a garbage number
                warn_once(f"{where}:{key}", "memguard: %s %s: not an integer (%r); ignored",
                           where, key, num[:40])
            continue
        if value < 0:
            warn_once(f"{where}:{key}", "memguard: %s %s: negative (%d); ignored",
                       where, key, value)
            continue
        out[key] = value * 1024 if unit else value
    return out


def parse_status(text: str, where: str = "status") -> Dict[str, int]:
    """Parse /proc/<pid>/status; sizes (``VmRSS``, ``VmHWM``, ...) in bytes."""
    return {k: v for k, v in parse_meminfo(text, where).items()
            if k.startswith(("Vm", "Rss", "Hugetlb"))}


def read_meminfo(proc_root: str = "/proc", keys: Optional[frozenset] = None) -> Dict[str, int]:
    """/proc/meminfo as ``{key: bytes}`` (only ``keys`` if given); empty if unreadable."""
    path = os.path.join(proc_root, "meminfo")
    text = read_text(path)
    return parse_meminfo(text, path, keys) if text is not None else {}


def read_status(proc_root: str = "/proc", pid: str = "self",
                keys: Optional[frozenset] = None) -> Dict[str, int]:
    """/proc/<pid>/status sizes as ``{key: bytes}`` (only ``keys`` if given); empty if
    unreadable."""
    path = os.path.join(proc_root, str(pid), "status")
    text = read_text(path)
    if text is None:
        return {}
    if keys is not None:
        return parse_meminfo(text, path, keys)
    return parse_status(text, path)


#: The /proc/meminfo lines the probe reads, the cache key of its per-step reading, and the
#: /proc/self/status lines of the resident set and its peak.
MEMINFO_KEYS = frozenset(("MemTotal", "MemAvailable", "MemFree", "Buffers", "Cached"))
MEMINFO_KEY = "meminfo:/proc"
STATUS_KEYS = frozenset(("VmRSS", "VmHWM"))
