"""The process's own peak resident set, kept for the tools that read it: the figure a guarded run
reports as ``process_peak_rss_bytes`` (summary, event log), and VmHWM put back at train end after
the per-step resets on Linux CPU took it away (``ru_maxrss``, ``/usr/bin/time -v`` and a launcher's
``wait4`` rusage read it). See docs/monitor.md, "The process's own peak".
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

__all__ = ["process_peak_rss_bytes", "restore_process_peak", "RESTORE_SHARE"]

log = logging.getLogger("memguard.monitor")

#: The restore writes ``peak - RSS`` bytes for a moment; it runs only when that is at most this
#: share of what the process can still take (``available_bytes``: host, cgroup and address-space
#: limits), so it cannot bring this process or a co-tenant near a limit.
RESTORE_SHARE = 0.5


def process_peak_rss_bytes() -> Optional[int]:
    """This process's peak resident set over its life, bytes, as the OS would report it had no
    reset happened: on Linux, the peak the resets of ``/proc/self/clear_refs`` kept
    (:func:`memguard_core.probes.linux.peak.process_peak_bytes`: the largest VmHWM read before each
    reset, and VmHWM now); elsewhere the snapshot's ``process_peak_bytes`` (``ru_maxrss`` on macOS,
    ``peak_wset`` on Windows; nothing resets them). None when it cannot be read. Never raises."""
    try:
        if sys.platform.startswith("linux"):
            from .probes.linux import peak

            return peak.process_peak_bytes()
        from .probes import probe

        v = probe("cpu", cheap=True).process_peak_bytes
        return None if v is None else int(v)
    except Exception:
        log.debug("memguard: the process's peak was not read", exc_info=True)
        return None


def restore_process_peak() -> Optional[int]:
    """After the guard's last per-step reset: put this process's VmHWM back at its peak over its
    life (:func:`memguard_core.probes.linux.peak.raise_peak_to`), so ``ru_maxrss`` read in the
    process and ``time -v`` / accounting at its exit see the run's peak, when memory allows
    (``peak - RSS <= RESTORE_SHARE x available``); says in one line when it does not. Nothing
    happens off Linux or where no reset was done.

    Returns:
        the process's peak over its life in bytes (:func:`process_peak_rss_bytes`), None when
        unknown. Never raises.
    """
    target = process_peak_rss_bytes()
    if target is None or not sys.platform.startswith("linux"):
        return target
    try:
        from .probes import probe
        from .probes.linux import peak

        if not peak.resets_done():
            return target
        snap = probe("cpu", cheap=False)
        gap = target - int(snap.process_bytes)
        if (snap.process_peak_bytes or 0) >= target or gap <= 0:
            return target
        if gap > RESTORE_SHARE * int(snap.available_bytes):
            log.info("memguard: VmHWM / ru_maxrss read %.2f GiB after the per-step peak resets, below this "
                     "process's peak %.2f GiB; not raised back (it would take %.2f GiB, more than %.0f%% of the "
                     "%.2f GiB available): read process_peak_rss_bytes in the run summary",
                     (snap.process_peak_bytes or 0) / 2**30, target / 2**30, gap / 2**30, RESTORE_SHARE * 100,
                     snap.available_bytes / 2**30)
            return target
        t0 = time.monotonic()
        ok = peak.raise_peak_to(target)
        log.info("memguard: VmHWM / ru_maxrss %s to this process's peak %.2f GiB after the per-step resets "
                 "(%.2f GiB written for %.2f s)", "raised back" if ok else "could not be raised back",
                 target / 2**30, gap / 2**30, time.monotonic() - t0)
    except Exception:
        log.debug("memguard: the process's peak was not restored", exc_info=True)
    return target
