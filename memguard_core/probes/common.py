"""Helpers every probe backend shares: the once-per-source warning and the psutil fallback
snapshot. Backends import this module; it imports no backend. See docs/monitor.md, "Probes".
"""

from __future__ import annotations

import logging
import threading
import time

from .snapshot import MemorySnapshot

__all__ = ["log", "warn_once", "reset_warned", "psutil_fallback"]

#: The logger of every probe (``memguard.probes``).
log = logging.getLogger("memguard.probes")

_warned: set = set()
_warned_lock = threading.Lock()


def warn_once(key: str, msg: str, *args) -> None:
    """Log ``msg`` at WARNING the first time ``key`` (usually a file path) fails; DEBUG after."""
    with _warned_lock:
        first = key not in _warned
        if first:
            _warned.add(key)
    if first:
        log.warning(msg, *args)
    else:
        log.debug(msg, *args)


def reset_warned() -> None:
    """Forget which sources have warned (tests)."""
    with _warned_lock:
        _warned.clear()


def psutil_fallback(device: str = "cpu") -> MemorySnapshot:
    """Last-resort host snapshot from psutil (no container awareness); zeros if that fails too."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        mi = psutil.Process().memory_info()
        return MemorySnapshot(device=device, total_bytes=int(vm.total),
                              available_bytes=int(vm.available), process_bytes=int(mi.rss),
                              process_peak_bytes=None, pressure=None, limit_bytes=None,
                              limit_source="host", source="psutil", timestamp=time.monotonic())
    except Exception as exc:
        warn_once("psutil.virtual_memory", "memguard: psutil fallback probe failed: %r", exc)
        return MemorySnapshot(device=device, total_bytes=0, available_bytes=0, process_bytes=0,
                              process_peak_bytes=None, pressure=None, limit_bytes=None,
                              limit_source="host", source="none", timestamp=time.monotonic())
