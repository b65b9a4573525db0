"""glibc's heap for the Linux probe: the bytes ``malloc`` holds for live allocations
(``mallinfo2``), handing the free heap back (``malloc_trim``) and fixing the mmap threshold
(``mallopt``). See docs/monitor.md, "The CPU heap between steps".
"""

from __future__ import annotations

import ctypes
from typing import Optional

from ..common import warn_once

__all__ = ["Mallinfo2", "libc", "malloc_in_use", "malloc_trim", "M_MMAP_THRESHOLD", "pin_mmap_threshold"]


class Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc >= 2.33): ten ``size_t`` fields."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]


_libc_handle = None   # ctypes handle of the process's libc, False where it cannot be opened


def libc():
    """The process's own C library through ctypes (``CDLL(None)``: the libc already loaded, whose
    ``malloc`` torch's CPU allocations use), opened once; None where it cannot be opened."""
    global _libc_handle
    if _libc_handle is None:
        try:
            _libc_handle = ctypes.CDLL(None)
        except OSError:
            _libc_handle = False
    return _libc_handle or None


_mallinfo2 = None   # the bound function, False where libc has none


def malloc_in_use() -> Optional[int]:
    """Bytes glibc's ``malloc`` holds for live allocations: ``uordblks`` (in use in the heap
    arenas, all arenas summed) + ``hblkhd`` (in use in mmapped chunks), from ``mallinfo2()``
    (mallinfo(3), glibc >= 2.33).

    Unlike RSS it does not count the free heap glibc keeps, so it does not fall when
    ``malloc_trim`` returns that heap to the kernel, only when memory is really freed; torch's CPU
    tensors and NumPy arrays come from ``malloc`` (Python's small-object arenas do not: they are
    mmapped directly). Cost: one walk of the arenas' free lists
    (microseconds to a millisecond); the monitor reads it only around a critical clean. Where
    ``malloc`` is replaced (``LD_PRELOAD`` of jemalloc / tcmalloc) glibc's counters miss torch's
    allocations and barely move: a clean is then credited with about nothing (the monitor splits,
    the conservative side).

    Returns:
        The bytes, or None off glibc or before glibc 2.33 (``mallinfo2`` missing; the older
        ``mallinfo`` wraps at 2 GiB). Never raises.
    """
    global _mallinfo2
    fn = _mallinfo2
    if fn is None:
        fn = getattr(libc(), "mallinfo2", None) or False
        if fn:
            fn.restype, fn.argtypes = Mallinfo2, []
        _mallinfo2 = fn
    if fn is False:
        return None
    try:
        info = fn()
        return int(info.uordblks) + int(info.hblkhd)
    except Exception as exc:  # defensive: a probe never raises
        warn_once("linux.mallinfo2", "memguard: mallinfo2() failed: %r", exc)
        return None


def malloc_trim() -> bool:
    """Return the free memory glibc's heap keeps to the kernel (``malloc_trim(0)``, malloc_trim(3)).

    On CPU, torch allocates through ``malloc``; blocks below glibc's dynamic mmap threshold (up to
    32 MiB, mallopt(3) ``M_MMAP_THRESHOLD``) come from the heap, and freed heap stays in the
    process's RSS, still charged to its cgroup.

    Returns:
        True when glibc released memory, False when it had none to release or there is no
        ``malloc_trim`` (not glibc). Raises what ctypes raises when libc cannot be called.
    """
    trim = getattr(libc(), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


#: ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (glibc ``malloc/malloc.h``).
M_MMAP_THRESHOLD = -3


def pin_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` for this process (``mallopt(M_MMAP_THRESHOLD,
    nbytes)``, mallopt(3)).

    By default glibc starts the threshold at 128 KiB and raises it to the size of every mmapped
    chunk freed (up to 32 MiB on 64-bit), so after a few steps a training process serves most of its
    tensors from the heap, where freed blocks stay resident until a later request fits them. Setting
    the parameter turns that adjustment off for the rest of the process's life (mallopt(3): "Dynamic
    adjustment of the mmap threshold is disabled if any of ... M_MMAP_THRESHOLD ... is set"):
    allocations of ``nbytes`` or more are then mmapped and go back to the kernel on ``free``. The
    cost is a system call and fresh zeroed pages per such allocation. There is no call that restores
    the dynamic threshold.

    Args:
        nbytes: the threshold in bytes, 0 .. 32 MiB (glibc refuses more).

    Returns:
        True when glibc accepted it; False when it refused or there is no ``mallopt`` (not glibc).
        Raises what ctypes raises when libc cannot be called.
    """
    fn = getattr(libc(), "mallopt", None)
    if fn is None:
        return False
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(fn(M_MMAP_THRESHOLD, int(nbytes)))
