"""Linux memory probe: /proc/meminfo, /proc/self/status, PSI, cgroup v1 and v2, address-space
limits, glibc's heap; one module per job (files, proc, psi, cgroup, rlimit, peak, heap), this
module the probe (:func:`probe`) and the monitor's step reader (:func:`step_reader`) over them.
Every read is tolerant (a bad or missing file is absent, logged once); nothing raises into the
caller. ``proc_root`` / ``sys_root`` point the reads at recorded trees in tests. The kernel sources
of each figure: docs/monitor.md, "Probes" and "What each probe reads".
"""

from __future__ import annotations

import time

from ..common import warn_once
from ..reader import StepReader
from ..snapshot import MemorySnapshot
from .cgroup import cgroup_memory, location, step_levels
from . import files
from .files import kept, slow_cache, slow_figure
from .heap import malloc_in_use
from .peak import reset_peak, step_figures, step_rss_and_peak
from .proc import MEMINFO_KEY, MEMINFO_KEYS, STATUS_KEYS, read_meminfo, read_status
from .psi import pressure, read_psi
from .rlimit import address_limit_now

__all__ = ["probe", "step_reader"]


def step_reader() -> StepReader:
    """The runtime monitor's reader on Linux CPU: the cheap probe, the VmHWM reset through a kept
    ``clear_refs`` descriptor (:func:`.peak.reset_peak`), the snapshot-free per-step figures
    (:func:`.peak.step_figures`), PSI read alone (:func:`.psi.pressure`: the background thread
    reads it between full samples) and glibc's in-use bytes (:func:`.heap.malloc_in_use`). The
    functions are bound when the reader is built."""
    return StepReader("cpu", probe=probe, reset_peak=reset_peak, step_figures=step_figures,
                      pressure=pressure, live_bytes=malloc_in_use, pressure_kind="psi")



def probe(cheap: bool = False, *, proc_root: str = "/proc", sys_root: str = "") -> MemorySnapshot:
    """Linux host snapshot, container-aware.

    ``total = min(MemTotal, cgroup limit)``; ``available = min(MemAvailable, limit -
    working_set over the cgroup and its ancestors)``; ``process_bytes = VmRSS``;
    ``process_peak_bytes = VmHWM``; ``pressure = PSI some avg10`` (the cgroup's own v2
    ``memory.pressure`` where present, else /proc/pressure/memory). ``limit_bytes`` is the
    cgroup limit when it is below MemTotal (a larger one is not in force), else None.

    Under a soft ``RLIMIT_AS`` / ``RLIMIT_DATA`` (:func:`.rlimit.address_limit`), ``available`` is capped
    at the room left under it and ``total`` at the limit; ``address_limit_*`` report it.

    ``cheap=True`` (the per-step path) reuses the cached cgroup location (no mountinfo parse),
    reads through kept descriptors (:class:`.files.KeptFiles`), skips PSI (``pressure`` is None: the
    monitor reads PSI averages in its background thread only) and reuses readings of
    /proc/meminfo, memory.stat and the cgroup limit files younger than
    :data:`.files.SLOW_FIGURES_MAX_AGE_S` (MemAvailable then moves with this process's RSS since that
    reading); the RSS (/proc/self/statm), the peak (``ru_maxrss`` after a :func:`.peak.reset_peak`, else
    VmHWM) and the cgroup usage files are read every time. Never raises.
    """
    if cheap and proc_root == "/proc" and sys_root == "":
        kept.on = True
        try:
            return _probe(True, proc_root, sys_root)
        finally:
            kept.on = False
    return _probe(cheap, proc_root, sys_root)


def _probe(cheap: bool, proc_root: str, sys_root: str) -> MemorySnapshot:
    now = time.monotonic()
    if kept.on:
        rss, hwm = step_rss_and_peak()
    else:
        status = read_status(proc_root, keys=STATUS_KEYS)
        rss = status.get("VmRSS")
        hwm = status.get("VmHWM")
    hit = slow_cache.get(MEMINFO_KEY) if kept.on else None
    if hit is not None and now - hit[0] < files.SLOW_FIGURES_MAX_AGE_S:
        mem, rss_then = hit[1]   # the per-step path: slow_figure's rule, without its call
    else:
        mem, rss_then = slow_figure(MEMINFO_KEY if proc_root == "/proc" else "meminfo:" + proc_root,
                                     lambda: (read_meminfo(proc_root, MEMINFO_KEYS), rss))
    host_total = mem.get("MemTotal")
    host_avail = mem.get("MemAvailable")
    if host_avail is None and host_total is not None and "MemFree" in mem:
        host_avail = mem["MemFree"] + mem.get("Buffers", 0) + mem.get("Cached", 0)
    if host_avail is not None and rss is not None and rss_then is not None:
        host_avail = max(0, host_avail - (rss - rss_then))  # a cached reading: this process's growth since
    if host_total is None or host_avail is None or rss is None:
        try:
            import psutil

            if host_total is None or host_avail is None:
                vm = psutil.virtual_memory()
                host_total, host_avail = int(vm.total), int(vm.available)
            if rss is None:
                rss = int(psutil.Process().memory_info().rss)
        except Exception as exc:
            warn_once("linux.psutil", "memguard: psutil fallback failed: %r", exc)
            host_total = host_total or 0
            host_avail = host_avail or 0
            rss = rss or 0

    levels = step_levels()
    if kept.on and levels is not None and not levels[2] and now - levels[0] < files.SLOW_FIGURES_MAX_AGE_S:
        cg = None   # the per-step path found no limited cgroup level less than a second ago
    else:
        cg = cgroup_memory(proc_root, sys_root, refresh=not cheap, detail=False)
    total, avail = host_total, host_avail
    limit_bytes, limit_source = None, "host"
    if cg is not None:
        if cg.limit is not None and (host_total <= 0 or cg.limit < host_total):
            limit_bytes = cg.limit
            limit_source = f"cgroup-v{cg.version}:{cg.limit_path}"
            total = cg.limit if host_total <= 0 else min(host_total, cg.limit)
        if cg.available is not None:
            avail = min(avail, cg.available)
    vlim = address_limit_now(proc_root)
    if vlim is not None:
        # virtual room, not RSS: capping what is available at it is the conservative translation
        # (see rlimit.address_limit); RSS can never pass the limit itself
        avail = min(avail, vlim.headroom)
        total = vlim.limit if total <= 0 else min(total, vlim.limit)
    avail = max(0, min(avail, total)) if total > 0 else max(0, avail)

    pressure = None
    if not cheap:
        loc = location(proc_root, sys_root, refresh=False)
        psi = read_psi(proc_root, sys_root, cgroup_dir=loc.v2_dir or "")
        if psi is not None:
            pressure = psi.some_avg10

    return MemorySnapshot(device="cpu", total_bytes=int(total), available_bytes=int(avail),
                          process_bytes=int(rss), process_peak_bytes=hwm, pressure=pressure,
                          limit_bytes=limit_bytes, limit_source=limit_source, source="linux",
                          timestamp=now, pressure_kind=None if pressure is None else "psi",
                          address_limit_bytes=None if vlim is None else vlim.limit,
                          address_limit_source=None if vlim is None else vlim.source,
                          address_headroom_bytes=None if vlim is None else vlim.headroom)
