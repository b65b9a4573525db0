"""Tolerant readers of procfs, sysfs and cgroupfs files for the Linux probe: a missing file is
absent, garbage or a negative number is logged once and absent; on the per-step path, descriptors
kept open and read with ``pread``, and the slow figures reused for up to a second. See
docs/monitor.md, "Probes".
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ..common import warn_once

__all__ = ["UNLIMITED_THRESHOLD", "KeptFiles", "kept", "SLOW_FIGURES_MAX_AGE_S", "slow_cache",
           "slow_figure", "read_text", "to_nonneg_int", "read_int", "read_limit", "parse_flat_keyed",
           "read_keyed"]

#: Limits at or above this many bytes (1 EiB) mean "no limit". cgroup v1 reports "unlimited"
#: as PAGE_COUNTER_MAX * PAGE_SIZE, e.g. 9223372036854771712 with 4 KiB pages
#: (mm/page_counter.c, include/linux/page_counter.h), which differs by page size.
UNLIMITED_THRESHOLD = 1 << 60


class KeptFiles(threading.local):
    """Per-step fast path: read-only descriptors kept open per path and read with ``pread`` at
    offset 0 (procfs, sysfs and cgroupfs regenerate the content on a read from offset 0): no
    open, close or text decoding per read, which dominate the cost of reading a small file.
    Active only inside :func:`memguard_core.probes.linux.probe` with ``cheap=True`` on the real
    roots (``/proc``, ``""``)."""

    on = False


kept = KeptFiles()
_kept_fds: Dict[str, int] = {}
_kept_lock = threading.Lock()

#: The per-step path re-reads the two larger files, /proc/meminfo and a cgroup's memory.stat
#: (the kernel formats dozens of lines for each), only when its last reading is older than this.
#: The monitor's background thread refreshes both with a full probe every 0.5 s; between readings, MemAvailable moves with this process's own
#: RSS and a cgroup's inactive file pages are taken as they were. The small files that show a
#: co-tenant at once (the cgroup's usage files) are read at every step; limit files are cached
#: alike (they change when a container is resized, not per step).
SLOW_FIGURES_MAX_AGE_S = 1.0
slow_cache: Dict[str, Tuple[float, object]] = {}


def slow_figure(key: str, read: Callable[[], object]) -> object:
    """``read()``, or its cached value when on the per-step path (:data:`kept` on) and younger
    than :data:`SLOW_FIGURES_MAX_AGE_S`. Any full read refreshes the cache."""
    now = time.monotonic()
    if kept.on:
        hit = slow_cache.get(key)
        if hit is not None and now - hit[0] < SLOW_FIGURES_MAX_AGE_S:
            return hit[1]
    value = read()
    slow_cache[key] = (now, value)
    return value


def _read_kept(path: str) -> Optional[str]:
    fd = _kept_fds.get(path)
    if fd is None:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError:
            return None   # the slow path below logs it
        with _kept_lock:
            old = _kept_fds.get(path)
            if old is None:
                _kept_fds[path] = fd
            else:
                os.close(fd)
                fd = old
    try:
        return os.pread(fd, 16384, 0).decode("ascii", "replace")
    except OSError:
        # the file went away (a removed cgroup) or cannot be re-read: forget the descriptor
        with _kept_lock:
            if _kept_fds.get(path) == fd:
                del _kept_fds[path]
        try:
            os.close(fd)
        except OSError:
            pass
        return None


def read_text(path: str) -> Optional[str]:
    """File contents, or None. Missing files are silent; other errors warn once per path."""
    if kept.on:
        text = _read_kept(path)
        if text is not None:
            return text
    try:
        with open(path, "r", encoding="ascii", errors="replace") as fh:
            return fh.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        warn_once(path, "memguard: cannot read %s: %s; treating it as absent", path, exc)
        return None


def to_nonneg_int(token: str, where: str) -> Optional[int]:
    try:
        value = int(token)
    except (TypeError, ValueError):
        warn_once(where, "memguard: %s: not an integer (%r); treating it as absent",
                   where, (token or "")[:40])
        return None
    if value < 0:
        warn_once(where, "memguard: %s: negative value %d; treating it as absent", where, value)
        return None
    return value


def read_int(path: str) -> Optional[int]:
    """A file holding one non-negative integer; None if absent or bad."""
    text = read_text(path)
    if text is None:
        return None
    return to_nonneg_int(text.strip(), path)


def read_limit(path: str) -> Tuple[bool, Optional[int]]:
    """A limit file: ``(present, bytes or None for unlimited)``.

    ``"max"`` (v2) and values >= :data:`UNLIMITED_THRESHOLD` (v1) mean unlimited.
    """
    text = read_text(path)
    if text is None:
        return False, None
    token = text.strip()
    if token == "max":
        return True, None
    value = to_nonneg_int(token, path)
    if value is None:
        return False, None
    if value >= UNLIMITED_THRESHOLD:
        return True, None
    return True, value


def parse_flat_keyed(text: str, where: str) -> Dict[str, int]:
    """Parse ``key value`` lines (memory.stat, memory.events, memory.oom_control).

    Lines whose value is not a non-negative integer are logged once and skipped.
    """
    out: Dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        v = to_nonneg_int(parts[1], f"{where}:{parts[0]}")
        if v is not None:
            out[parts[0]] = v
    return out


def read_keyed(path: str) -> Dict[str, int]:
    text = read_text(path)
    return parse_flat_keyed(text, path) if text is not None else {}


def _forget_after_fork() -> None:
    """In a forked child (DataLoader workers, multiprocessing): the kept descriptors of
    /proc/self/* still name the parent (procfs binds a file to the task at open). Drop them, and
    what was read through them."""
    global _kept_lock
    _kept_lock = threading.Lock()   # another thread may have held it at the fork
    for fd in list(_kept_fds.values()):
        try:
            os.close(fd)
        except OSError:
            pass
    _kept_fds.clear()
    slow_cache.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
