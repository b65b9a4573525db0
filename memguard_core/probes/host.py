"""The host's memory (the ``cpu`` device): picks the backend of this interpreter's platform
(:mod:`~memguard_core.probes.linux`, :mod:`~memguard_core.probes.darwin`,
:mod:`~memguard_core.probes.windows`) and the C library's heap controls where it has them.
See docs/monitor.md, "Probes" and "The CPU heap between steps".
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional

from .common import psutil_fallback, warn_once
from .reader import StepReader
from .snapshot import MemorySnapshot

__all__ = ["host_source", "host_probe", "host_step_reader", "trim_heap", "pin_mmap_threshold", "glibc_version",
           "MOE_MMAP_THRESHOLD_BYTES"]


def host_source() -> str:
    """The host backend for this interpreter: ``"linux"``, ``"darwin"`` or ``"windows"``
    (``"psutil"`` elsewhere)."""
    if sys.platform.startswith("linux"):
        return "linux"
    if sys.platform == "darwin":
        return "darwin"
    if sys.platform in ("win32", "cygwin"):
        return "windows"
    return "psutil"


def host_probe(cheap: bool) -> MemorySnapshot:
    """The host backend's snapshot (``cheap``: see :func:`memguard_core.probes.probe`); the psutil
    one where the platform has no backend.

    Raises:
        what the backend raises (:func:`memguard_core.probes.probe` falls back to psutil).
    """
    src = host_source()
    if src == "linux":
        from . import linux

        return linux.probe(cheap=cheap)
    if src == "darwin":
        from . import darwin

        return darwin.probe(cheap=cheap)
    if src == "windows":
        from . import windows

        return windows.probe(cheap=cheap)
    return psutil_fallback()


def host_step_reader() -> StepReader:
    """The host backend's :class:`StepReader` (Linux, macOS, Windows; elsewhere one with nothing
    but the probe the package binds)."""
    src = host_source()
    if src == "linux":
        from . import linux

        return linux.step_reader()
    if src == "darwin":
        from . import darwin

        return darwin.step_reader()
    if src == "windows":
        from . import windows

        return windows.step_reader()
    return StepReader("cpu")


def trim_heap() -> None:
    """Hand the free heap the C library keeps back to the OS where the host backend can (glibc
    ``malloc_trim(0)`` on Linux; nothing elsewhere). Never raises."""
    try:
        if host_source() == "linux":
            from .linux import heap

            heap.malloc_trim()
    except Exception as exc:  # an exotic libc must not break a clean
        warn_once("trim_heap", "memguard: returning the free heap failed: %r", exc)


#: The mmap threshold the guard fixes for a mixture-of-experts run in bf16 / fp16 on a CPU (bytes):
#: every allocation of this size or more is mmapped and goes back to the kernel when freed. Lower
#: values keep fewer holes but pay a system call and fresh zeroed pages for more allocations; the
#: trade-off measured on full-depth MoE runs is in docs/monitor.md, "The CPU heap between steps".
MOE_MMAP_THRESHOLD_BYTES = 4 << 20


def pin_mmap_threshold(nbytes: int = MOE_MMAP_THRESHOLD_BYTES) -> bool:
    """Fix the C library's mmap threshold at ``nbytes`` for the rest of this process where the
    host backend can (glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)`` on Linux, which also turns off
    glibc's dynamic adjustment of it: :func:`memguard_core.probes.linux.heap.pin_mmap_threshold`),
    so large freed tensors go back to the kernel instead of staying in the heap. Returns True when
    it was set, False elsewhere or when glibc refused. Never raises."""
    try:
        if host_source() == "linux":
            from .linux import heap

            return heap.pin_mmap_threshold(nbytes)
    except Exception as exc:  # an exotic libc must not break the run's start
        warn_once("pin_mmap_threshold", "memguard: pinning the mmap threshold failed: %r", exc)
    return False


def glibc_version() -> Optional[str]:
    """The version of the GNU C library this process runs with (``"2.36"``), read from
    ``confstr(_CS_GNU_LIBC_VERSION)``; None where the C library is not glibc (musl, macOS, Windows)
    or it cannot be read. Its heap decides how much freed memory a CPU run keeps resident
    (``memguard_core.estimator.cpu_heap``). Never raises."""
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    parts = (text or "").split()
    if len(parts) == 2 and parts[0] == "glibc" and re.match(r"^\d+\.\d+", parts[1]):
        return parts[1]
    return None
