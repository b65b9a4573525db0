"""This process's resident set and its peak on the Linux per-step path: /proc/self/statm, the peak
from ``ru_maxrss`` after a ``clear_refs`` reset, and the per-step figures without a snapshot; and
the process's peak over its life, which every reset folds in first, so the figure the reset takes
from ``ru_maxrss`` / ``time -v`` stays known and can be put back (:func:`process_peak_bytes`,
:func:`raise_peak_to`). See docs/monitor.md, "Probes" and "The process's own peak".
"""

from __future__ import annotations

import os
import time
from typing import Optional, Tuple

from .cgroup import step_levels
from . import files
from .files import slow_cache
from .proc import MEMINFO_KEY, STATUS_KEYS, read_status
from .rlimit import cached_rlimits

try:
    import resource as _resource
except ImportError:   # not on Windows; this module is only used on Linux, but must import anywhere
    _resource = None

__all__ = ["reset_peak", "step_rss_and_peak", "step_figures", "RU_DRIFT_BYTES", "process_peak_bytes",
           "raise_peak_to", "resets_done"]


#: Generating /proc/self/status makes the kernel sum per-CPU RSS counters and format dozens of
#: lines, where /proc/self/statm is one short line and getrusage(2) a syscall without text. The
#: per-step path therefore reads the current RSS from statm and the peak
#: from ``ru_maxrss`` (kernel/sys.c: ``max(signal->maxrss, mm hiwater_rss)``, KiB), which
#: ``clear_refs`` = 5 resets like VmHWM (both read the mm's hiwater_rss) -- except for
#: ``signal->maxrss``, the high-water mark of the mm the process had before its ``execve``
#: (fs/exec.c ``exec_mmap``): a process started by a large parent (a launcher, a notebook
#: kernel) keeps that figure as a floor under ``ru_maxrss`` for life. The floor is bounded from
#: above by what ``ru_maxrss`` reads right after a reset (``max(floor, RSS)``); a later reading
#: above that bound is the true peak, one at or below it is ambiguous and VmHWM is read instead.
_ru_floor_kib: Optional[int] = None      # upper bound of signal->maxrss; None before our first reset
_clear_refs_fd: Optional[int] = None
_clear_refs_tried = False
_statm_fd: Optional[int] = None
#: the largest peak read right before a reset (bytes; the first one reads VmHWM: the process's peak
#: before any reset), so the process's peak over its life survives the resets
_life_peak = 0
_resets = 0
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: ``ru_maxrss`` reads the batched per-CPU RSS counters, VmHWM their exact sum: a reading this far
#: above VmHWM is the floor, not drift (the batch is a few hundred KiB per CPU that ran the process).
RU_DRIFT_BYTES = 4 << 20


def reset_peak() -> bool:
    """Reset this process's peak resident set (VmHWM := VmRSS) by writing ``5`` to
    ``/proc/self/clear_refs`` (kernel Documentation/filesystems/proc.rst, "clear_refs"), through a
    descriptor kept open, and note the bound of the ``ru_maxrss`` floor (see above).

    Returns:
        True when the kernel took the reset; False where ``clear_refs`` cannot be written
        (old kernel, seccomp, read-only /proc). Never raises.
    """
    global _clear_refs_fd, _clear_refs_tried, _ru_floor_kib, _life_peak, _resets
    try:
        fd = _clear_refs_fd
        if fd is None:
            if _clear_refs_tried:
                return False
            _clear_refs_tried = True
            fd = _clear_refs_fd = os.open("/proc/self/clear_refs", os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        before = _erased_peak()
        os.write(fd, b"5")
    except OSError:
        _clear_refs_fd = None
        return False
    if before is not None and before > _life_peak:
        _life_peak = before
    _resets += 1
    try:
        after = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
        # max(floor, RSS now): the floor is at most this; keep the tightest bound seen
        if _ru_floor_kib is None or after < _ru_floor_kib:
            _ru_floor_kib = after
    except Exception:
        pass
    return True


def _erased_peak() -> Optional[int]:
    """The peak a reset is about to erase (bytes), where it can raise the process's peak:
    ``ru_maxrss`` where it is above the floor's bound (one syscall; it reads up to a few hundred
    KiB below VmHWM, see above); at or below that bound the window's peak is at most the bound, so
    None where the kept peak is already above it, else VmHWM (also before the first reset)."""
    floor = _ru_floor_kib
    if floor is not None:
        try:
            kib = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
        except Exception:
            kib = 0
        if kib > floor:
            return kib * 1024
        if _life_peak >= floor * 1024:
            return None
    return read_status(keys=STATUS_KEYS).get("VmHWM")


def process_peak_bytes() -> Optional[int]:
    """This process's peak resident set over its life, bytes: VmHWM as it would read had
    :func:`reset_peak` never reset it -- the largest peak read before each reset (the first
    reads the peak before any reset), and VmHWM now. None where /proc/self/status cannot be read
    and no reset was done. Reads /proc/self/status once; never raises."""
    try:
        now = read_status(keys=STATUS_KEYS).get("VmHWM")
    except Exception:
        now = None
    if now is None and not _life_peak:
        return None
    return max(_life_peak, now or 0)


def resets_done() -> int:
    """How many times :func:`reset_peak` reset this process's VmHWM (0 in a fresh fork)."""
    return _resets


def raise_peak_to(target_bytes: int) -> bool:
    """Raise VmHWM (and with it ``ru_maxrss``, and ``time -v``'s figure at exit) back to
    ``target_bytes`` after resets took it away: an anonymous mapping of ``target - RSS`` bytes is
    written one byte a page, so the resident set reaches the target, and unmapped. VmHWM is
    ``max(hiwater_rss, RSS)`` and the unmap records the high-water mark before it drops the pages
    (``unmap_region`` calls ``update_hiwater_rss`` before its zap: mm/mmap.c, mm/vma.c in recent
    kernels; kernel/sys.c ``getrusage``: ``ru_maxrss`` is the same mark). Huge pages are declined
    on the mapping (``MADV_NOHUGEPAGE``), so the resident set rises by the bytes written and not by
    2 MiB steps. The mark the unmap records is the kernel's batched per-CPU sum
    (include/linux/mm.h ``get_mm_counter``: ``percpu_counter_read_positive`` since Linux 6.2), a
    few pages per CPU below the exact RSS: where VmHWM or ``ru_maxrss`` still reads below the
    target after a write, the write is done again with twice the shortfall added (at most twice
    more).

    The caller decides whether memory allows it (the pages are resident for the time of one write
    over them). Returns True when VmHWM and ``ru_maxrss`` read at least ``target_bytes`` after;
    never raises.
    """
    target = int(target_bytes)
    try:
        status = read_status(keys=STATUS_KEYS)
        rss = status.get("VmRSS")
        if status.get("VmHWM") is None or rss is None:
            return False
        extra = 0
        for attempt in range(3):
            short = target - _mark(status)
            if short <= 0:
                return True
            if attempt:
                extra += 2 * short
            _write_pages(target - rss + extra)
            status = read_status(keys=STATUS_KEYS)
        return _mark(status) >= target
    except Exception:
        return False


def _mark(status) -> int:
    """The lower of VmHWM (``status``) and ``ru_maxrss``, bytes: what a reader of either sees."""
    hwm = status.get("VmHWM") or 0
    try:
        return min(hwm, _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss * 1024)
    except Exception:
        return hwm


def _write_pages(nbytes: int) -> None:
    """Map ``nbytes`` (rounded up to pages) anonymous, write one byte a page, unmap."""
    import mmap

    size = max(_PAGE_SIZE, -(-int(nbytes) // _PAGE_SIZE) * _PAGE_SIZE)
    m = mmap.mmap(-1, size)
    try:
        try:
            m.madvise(mmap.MADV_NOHUGEPAGE)
        except (AttributeError, OSError):
            pass
        m[::_PAGE_SIZE] = b"\x01" * (size // _PAGE_SIZE)
    finally:
        m.close()


def step_rss_and_peak() -> Tuple[Optional[int], Optional[int]]:
    """(VmRSS, peak since the last reset) in bytes, for the per-step path: statm (its second field,
    resident pages; proc(5)) + ``ru_maxrss`` where that is unambiguous, else /proc/self/status
    (see above), which also stands in when statm cannot be read. ``ru_maxrss`` comes from the
    kernel's batched per-CPU counters and reads up to a few hundred KiB below VmHWM."""
    global _ru_floor_kib, _statm_fd
    rss = None
    try:
        fd = _statm_fd
        if fd is None:
            fd = _statm_fd = os.open("/proc/self/statm", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        rss = int(os.pread(fd, 256, 0).split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        if _statm_fd is not None:   # reopened next time
            try:
                os.close(_statm_fd)
            except OSError:
                pass
            _statm_fd = None
    floor = _ru_floor_kib
    if rss is not None and floor is not None:
        try:
            peak_kib = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
        except Exception:
            peak_kib = 0
        if peak_kib > floor:
            return rss, max(rss, peak_kib * 1024)
    status = read_status(keys=STATUS_KEYS)
    hwm = status.get("VmHWM")
    if hwm is not None and floor is not None:
        try:
            peak_kib = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
            if peak_kib * 1024 > hwm + RU_DRIFT_BYTES:
                _ru_floor_kib = min(floor, peak_kib)   # ru_maxrss reads the floor itself: its exact value
        except Exception:
            pass
    return status.get("VmRSS", rss), hwm


def step_figures() -> Optional[Tuple[float, int, int, int]]:
    """The per-step check's figures in the common case, without building a snapshot:
    ``(monotonic seconds, RSS, peak since the last reset, RSS + available)``, sizes in bytes, as
    :func:`memguard_core.probes.linux.probe` ``(cheap=True)`` would give them (the peak is ``max(RSS, ru_maxrss)``;
    ``available`` comes from the cached /proc/meminfo reading, moved by this process's growth
    since). The check runs at every micro-batch, right after a training step, when every cache is
    cold: this path skips the cheap probe's extra reads and its snapshot object.

    Returns None, and the caller takes :func:`probe`, when the common case does not hold: a limited
    cgroup level (its usage must be read), an ``RLIMIT_AS`` / ``RLIMIT_DATA`` in force, the cgroup levels or /proc/meminfo last read
    :data:`.files.SLOW_FIGURES_MAX_AGE_S` or more ago (the cheap probe re-reads them), no peak reset yet,
    or an ambiguous ``ru_maxrss`` (see above). Never raises.
    """
    levels, floor, fd = step_levels(), _ru_floor_kib, _statm_fd
    if levels is None or levels[2] or floor is None or fd is None:
        return None
    if cached_rlimits() != (None, None):
        return None   # a virtual-memory limit caps what is available: the cheap probe applies it
    now = time.monotonic()
    hit = slow_cache.get(MEMINFO_KEY)
    age = files.SLOW_FIGURES_MAX_AGE_S
    if hit is None or now - hit[0] >= age or now - levels[0] >= age:
        return None
    mem, rss_then = hit[1]
    total, avail = mem.get("MemTotal"), mem.get("MemAvailable")
    if total is None or avail is None or rss_then is None or total <= 0:
        return None
    try:
        rss = int(os.pread(fd, 256, 0).split()[1]) * _PAGE_SIZE
        peak_kib = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
    except Exception:
        return None
    if peak_kib <= floor:
        return None
    avail = max(0, min(avail - (rss - rss_then), total))   # the probe's rule where no cgroup level limits
    return now, rss, max(rss, peak_kib * 1024), rss + avail


def _forget_after_fork() -> None:
    """In a forked child (DataLoader workers, multiprocessing): the kept descriptors of
    /proc/self/* still name the parent (procfs binds a file to the task at open), and a kept
    ``clear_refs`` would reset the parent's peak. Drop them, and what was read through them."""
    global _clear_refs_fd, _clear_refs_tried, _ru_floor_kib, _statm_fd, _life_peak, _resets
    for fd in [f for f in (_clear_refs_fd, _statm_fd) if f is not None]:
        try:
            os.close(fd)
        except OSError:
            pass
    _clear_refs_fd, _clear_refs_tried, _ru_floor_kib, _statm_fd = None, False, None, None
    _life_peak, _resets = 0, 0   # the child's own VmHWM is its peak


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
