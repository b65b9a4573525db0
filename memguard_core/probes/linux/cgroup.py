"""This process's memory cgroup for the Linux probe: located from /proc/self/cgroup and mountinfo
(never fixed paths), its limit, usage and working set over the cgroup and its ancestors, v1 and v2
(kernel Documentation/admin-guide/cgroup-v1/memory.rst and cgroup-v2.rst). See docs/monitor.md,
"Probes".
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..common import warn_once
from . import files
from .files import kept, read_int, read_keyed, read_limit, read_text, slow_figure

__all__ = ["Mount", "CgroupLocation", "CgroupMemory", "parse_mountinfo", "parse_proc_cgroup",
           "locate_cgroups", "location", "cgroup_memory", "step_levels"]


@dataclass(frozen=True)
class Mount:
    """One /proc/<pid>/mountinfo line (the fields we use). See proc_pid_mountinfo(5)."""

    root: str          # field 4: the root of the mount inside its filesystem
    mount_point: str   # field 5, octal escapes (\\040) decoded
    fstype: str
    super_options: Tuple[str, ...]


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(s: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), s)


def parse_mountinfo(text: str) -> List[Mount]:
    """Parse /proc/<pid>/mountinfo; malformed lines are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 6 or len(fields) < sep + 3:
            continue
        mounts.append(Mount(root=_unescape(fields[3]), mount_point=_unescape(fields[4]),
                            fstype=fields[sep + 1],
                            super_options=tuple(fields[sep + 3].split(",")) if len(fields) > sep + 3 else ()))
    return mounts


def parse_proc_cgroup(text: str) -> Tuple[Optional[str], Optional[str]]:
    """Parse /proc/<pid>/cgroup (``hierarchy-ID:controllers:path``, cgroups(7)).

    Returns:
        ``(v1_memory_path, v2_path)``: the path in the v1 hierarchy that holds the ``memory``
        controller and the path in the unified (v2, ID 0, empty controller list) hierarchy;
        None where absent.
    """
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


@dataclass(frozen=True)
class CgroupLocation:
    """Filesystem directories of this process's memory cgroup and of its mount."""

    v1_dir: Optional[str] = None     # cgroup v1 memory controller directory
    v1_mount: Optional[str] = None   # the v1 memory hierarchy's mount point (walk stops here)
    v2_dir: Optional[str] = None     # cgroup v2 directory (for memory.* and memory.pressure)
    v2_mount: Optional[str] = None


def _cgroup_dir(mount: Mount, cgroup_path: str, sys_root: str) -> Tuple[str, str]:
    """(directory of the cgroup, mount point), both with ``sys_root`` prefixed.

    The cgroup path from /proc/self/cgroup is relative to the hierarchy's root; the mount
    shows the subtree starting at ``mount.root``. Inside a container without a cgroup
    namespace the path may not lie under the mount root; then the mount point itself is the
    process's cgroup (the JDK does the same, cgroupSubsystem_linux.cpp).
    """
    mp = sys_root + mount.mount_point
    root = mount.root.rstrip("/")
    path = cgroup_path if cgroup_path.startswith("/") else "/" + cgroup_path
    if root == "":
        rel = path
    elif path == root or path.startswith(root + "/"):
        rel = path[len(root):]
    else:
        rel = path if os.path.isdir(mp + path) else ""
    rel = rel.rstrip("/")
    return (mp + rel if rel else mp), mp


def _pick_mount(mounts: List[Mount], cgroup_path: str) -> Optional[Mount]:
    """Among several mounts of one hierarchy, the one whose root contains ``cgroup_path``."""
    if not mounts:
        return None
    best = None
    for m in mounts:
        root = m.root.rstrip("/")
        if root == "" or cgroup_path == root or cgroup_path.startswith(root + "/"):
            if best is None or len(root) > len(best.root.rstrip("/")):
                best = m
    return best or mounts[0]


def locate_cgroups(proc_root: str = "/proc", sys_root: str = "") -> CgroupLocation:
    """Find this process's memory cgroup directories from /proc/self/cgroup + mountinfo."""
    cg_text = read_text(os.path.join(proc_root, "self", "cgroup"))
    mi_text = read_text(os.path.join(proc_root, "self", "mountinfo"))
    if cg_text is None or mi_text is None:
        return CgroupLocation()
    v1_path, v2_path = parse_proc_cgroup(cg_text)
    mounts = parse_mountinfo(mi_text)
    v1_dir = v1_mount = v2_dir = v2_mount = None
    if v1_path is not None:
        m = _pick_mount([m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options],
                        v1_path)
        if m is not None:
            v1_dir, v1_mount = _cgroup_dir(m, v1_path, sys_root)
    if v2_path is not None:
        m = _pick_mount([m for m in mounts if m.fstype == "cgroup2"], v2_path)
        if m is not None:
            v2_dir, v2_mount = _cgroup_dir(m, v2_path, sys_root)
    return CgroupLocation(v1_dir, v1_mount, v2_dir, v2_mount)


_loc_cache: Dict[Tuple[str, str], CgroupLocation] = {}
_loc_lock = threading.Lock()


def location(proc_root: str, sys_root: str, refresh: bool) -> CgroupLocation:
    """:func:`locate_cgroups`, or its last result for these roots where not ``refresh``."""
    key = (proc_root, sys_root)
    if not refresh:
        loc = _loc_cache.get(key)
        if loc is not None:
            return loc
    loc = locate_cgroups(proc_root, sys_root)
    with _loc_lock:
        _loc_cache[key] = loc
    return loc


@dataclass(frozen=True)
class CgroupMemory:
    """The memory cgroup of this process, container-aware. Sizes in bytes.

    Attributes:
        version: 1 or 2.
        path: directory of the process's own cgroup.
        limit: the smallest limit over the cgroup and its ancestors up to the hierarchy's
            mount (v2: ``memory.high`` where set, else ``memory.max``, i.e. the smaller of the
            two; v1: ``memory.limit_in_bytes``), None if none is set.
        limit_path: directory whose limit won.
        usage: the cgroup's usage (v1 ``memory.usage_in_bytes``, v2 ``memory.current``),
            including its descendants and page cache.
        working_set: ``usage - inactive_file`` (v1 ``total_inactive_file``), clamped >= 0.
        available: ``min(limit - working_set)`` over every limited level, clamped >= 0; None
            if no level has a limit.
        oom_kill: OOM kills in this cgroup (v1 ``memory.oom_control`` ``oom_kill``, Linux
            4.13+; v2 ``memory.events`` ``oom_kill``).
        max_usage: high-water mark of usage (v1 ``memory.max_usage_in_bytes``; v2
            ``memory.peak``, Linux 5.19+).
    """

    version: int
    path: str
    limit: Optional[int]
    limit_path: Optional[str]
    usage: Optional[int]
    working_set: Optional[int]
    available: Optional[int]
    oom_kill: Optional[int]
    max_usage: Optional[int]


#: The per-step path's record of the levels of this process's cgroup that have a limit:
#: ``(time found, own cgroup directory, [(index up the hierarchy, directory)])``, from a full walk
#: at most every :data:`.files.SLOW_FIGURES_MAX_AGE_S`. Outside a container the list is empty and the
#: per-step probe does not look at the cgroup at all.
_step_levels: Optional[Tuple[float, str, List[Tuple[int, str]]]] = None


def _cached_limit(path: str) -> Tuple[bool, Optional[int]]:
    """:func:`read_limit`, reused on the per-step path while younger than
    :data:`.files.SLOW_FIGURES_MAX_AGE_S` (limits change when a container is resized, not per step; the
    usage files next to them are read every time)."""
    return slow_figure("limit:" + path, lambda: read_limit(path))  # type: ignore[return-value]


def _level_v1(d: str, need_usage: bool) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(limit, usage, working_set) of one v1 cgroup directory; usage read only if needed
    (``need_usage`` or a limit is set)."""
    _, limit = _cached_limit(os.path.join(d, "memory.limit_in_bytes"))
    if limit is None and not need_usage:
        return None, None, None
    usage = read_int(os.path.join(d, "memory.usage_in_bytes"))
    ws = None
    if usage is not None:
        def inactive_file() -> int:
            stat = read_keyed(os.path.join(d, "memory.stat"))
            return stat.get("total_inactive_file", stat.get("inactive_file", 0))
        ws = max(0, usage - int(slow_figure("v1-inactive:" + d, inactive_file)))
    return limit, usage, ws


def _level_v2(d: str, need_usage: bool) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(limit, usage, working_set) of one v2 cgroup directory (usage as in :func:`_level_v1`).

    The limit is ``memory.high`` when set (throttling and heavy reclaim start there, and it
    is where a job should stop growing), else ``memory.max`` (the OOM-kill line); if both are
    set the smaller wins.
    """
    _, mx = _cached_limit(os.path.join(d, "memory.max"))
    _, high = _cached_limit(os.path.join(d, "memory.high"))
    set_limits = [v for v in (high, mx) if v is not None]
    limit = min(set_limits) if set_limits else None
    if limit is None and not need_usage:
        return None, None, None
    usage = read_int(os.path.join(d, "memory.current"))
    ws = None
    if usage is not None:
        def inactive_file() -> int:
            return read_keyed(os.path.join(d, "memory.stat")).get("inactive_file", 0)
        ws = max(0, usage - int(slow_figure("v2-inactive:" + d, inactive_file)))
    return limit, usage, ws


def _ancestors(d: str, stop: str) -> List[str]:
    """``d`` and its parents up to and including ``stop`` (the hierarchy's mount point)."""
    out = [d]
    stop = stop.rstrip("/") or "/"
    cur = d.rstrip("/")
    while cur != stop and len(cur) > len(stop):
        cur = os.path.dirname(cur)
        out.append(cur)
    return out


def cgroup_memory(proc_root: str = "/proc", sys_root: str = "", *,
                  refresh: bool = True, detail: bool = True) -> Optional[CgroupMemory]:
    """The memory cgroup of this process (v1 memory controller if mounted, else v2).

    Args:
        proc_root, sys_root: roots (see module doc).
        refresh: re-read /proc/self/cgroup and mountinfo (else reuse the last location found
            for these roots; the per-step path uses the cached one).
        detail: also read the own cgroup's usage / working set when no limit is set there,
            ``oom_kill`` and ``max_usage``; the per-step path passes False (those are None).

    Returns:
        :class:`CgroupMemory`, or None when the process is in no memory cgroup we can see.
        Never raises.
    """
    global _step_levels
    try:
        loc = location(proc_root, sys_root, refresh)
        # the per-step path skips the directory checks: a removed cgroup shows as unreadable files
        isdir = (lambda d: True) if kept.on else os.path.isdir
        if loc.v1_dir is not None and isdir(loc.v1_dir):
            version, own, stop, level = 1, loc.v1_dir, loc.v1_mount or loc.v1_dir, _level_v1
        elif loc.v2_dir is not None and isdir(loc.v2_dir):
            version, own, stop, level = 2, loc.v2_dir, loc.v2_mount or loc.v2_dir, _level_v2
        else:
            return None
        limit = limit_path = available = None
        own_usage = own_ws = None
        own_read = False
        limited: Optional[List[Tuple[int, str]]] = None
        levels: Optional[List[Tuple[int, str]]] = None
        if kept.on and not detail:
            now = time.monotonic()
            hit = _step_levels
            if hit is not None and hit[1] == own and now - hit[0] < files.SLOW_FIGURES_MAX_AGE_S:
                levels = hit[2]   # only the levels with a limit have anything to read per step
            else:
                limited = []
        if levels is None:
            levels = list(enumerate(_ancestors(own, stop)))
        for i, d in levels:
            lim, usage, ws = level(d, detail and i == 0)
            if limited is not None and lim is not None:
                limited.append((i, d))
            if i == 0:
                own_usage, own_ws, own_read = usage, ws, (detail or lim is not None)
            if lim is None:
                continue
            if limit is None or lim < limit:
                limit, limit_path = lim, d
            if ws is None and not own_read:
                # this level's usage is unreadable: the own cgroup's working set (a lower
                # bound of the ancestor's) is the best we have
                _, own_usage, own_ws = level(own, True)
                own_read = True
            ws_here = ws if ws is not None else own_ws
            if ws_here is not None:
                room = max(0, lim - ws_here)
                available = room if available is None else min(available, room)
        if limited is not None:
            _step_levels = (now, own, limited)
        oom = max_usage = None
        if not detail:
            pass
        elif version == 1:
            oom = read_keyed(os.path.join(own, "memory.oom_control")).get("oom_kill")
            max_usage = read_int(os.path.join(own, "memory.max_usage_in_bytes"))
        else:
            oom = read_keyed(os.path.join(own, "memory.events")).get("oom_kill")
            max_usage = read_int(os.path.join(own, "memory.peak"))
        return CgroupMemory(version=version, path=own, limit=limit, limit_path=limit_path,
                            usage=own_usage, working_set=own_ws, available=available,
                            oom_kill=oom, max_usage=max_usage)
    except Exception as exc:  # defensive: a probe never raises
        warn_once(f"cgroup_memory:{proc_root}:{sys_root}",
                   "memguard: reading the memory cgroup failed: %r", exc)
        return None


def step_levels() -> Optional[Tuple[float, str, List[Tuple[int, str]]]]:
    """The per-step path's record of the limited levels (see above), None before a per-step
    :func:`cgroup_memory` found them."""
    return _step_levels


def _forget_after_fork() -> None:
    global _step_levels
    _step_levels = None   # found through the parent's kept descriptors


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
