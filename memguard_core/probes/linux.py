"""Linux memory probe: /proc/meminfo, /proc/self/status, PSI, cgroup v1 and v2.

Sources:
- /proc/meminfo ``MemTotal`` / ``MemAvailable`` and /proc/<pid>/status ``VmRSS`` / ``VmHWM``:
  kernel Documentation/filesystems/proc.rst. ``MemAvailable`` exists since Linux 3.14; before
  that we use ``MemFree + Buffers + Cached`` (what ``free`` showed as available then).
- PSI (``some``/``full`` ``avg10/avg60/avg300/total``): Documentation/accounting/psi.rst.
  ``total`` is in microseconds; the averages are percentages computed by the kernel.
- cgroup v1 memory controller (``memory.limit_in_bytes``, ``memory.usage_in_bytes``,
  ``memory.max_usage_in_bytes``, ``memory.stat`` ``total_inactive_file``, ``memory.oom_control``
  ``oom_kill``): Documentation/admin-guide/cgroup-v1/memory.rst.
- cgroup v2 (``memory.max``, ``memory.high``, ``memory.current``, ``memory.peak``,
  ``memory.stat`` ``inactive_file``, ``memory.events`` ``oom_kill``, ``memory.pressure``):
  Documentation/admin-guide/cgroup-v2.rst.
- Locating the cgroup from /proc/self/cgroup + /proc/self/mountinfo (never fixed paths): the
  same scheme as the JDK's container support (src/hotspot/os/linux/cgroupSubsystem_linux.cpp)
  and proc(5) / proc_pid_mountinfo(5) for the field layout.
- Virtual-memory limits ``RLIMIT_AS`` / ``RLIMIT_DATA`` (getrlimit(2), setrlimit(2); ``ulimit -v``,
  ``prlimit --as``): the kernel refuses a new mapping when ``total_vm`` (``VmSize``) plus its size
  exceeds the soft ``RLIMIT_AS``, or, for a private writable mapping, when ``data_vm``
  (``VmData``) plus its size exceeds ``RLIMIT_DATA`` (mm/mmap.c ``may_expand_vm``, Linux >= 4.7
  for the data limit); torch's CPU allocator then raises "can't allocate memory". See
  :func:`address_limit`.
- Working set = usage - inactive file cache: what cAdvisor reports as
  ``container_memory_working_set_bytes`` and the kubelet uses for memory eviction
  (cadvisor container/libcontainer/handler.go: v1 ``total_inactive_file``, v2 ``inactive_file``).
  Inactive file pages are the first the kernel reclaims before it OOM-kills the cgroup.

Every read is tolerant: a missing file is simply absent; an unreadable file, garbage or a
negative number is logged once per path at WARNING (logger ``memguard.probes``) and treated as
absent. Nothing here raises into the caller.

All functions take ``proc_root`` (default ``"/proc"``) and ``sys_root`` (prefix put in front of
every mount point found in mountinfo, default ``""``) so tests can point them at recorded trees.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from memguard_core.probes import MemorySnapshot, StepReader, _warn_once

__all__ = [
    "Psi", "CgroupMemory", "Mount", "CgroupLocation",
    "parse_meminfo", "parse_status", "parse_psi", "parse_proc_cgroup", "parse_mountinfo",
    "parse_flat_keyed", "read_meminfo", "read_status", "read_psi", "locate_cgroups",
    "cgroup_memory", "probe", "reset_peak", "step_figures", "pressure", "malloc_in_use",
    "malloc_trim", "pin_mmap_threshold", "step_reader", "UNLIMITED_THRESHOLD",
    "AddressLimit", "read_rlimits", "address_limit",
]

#: Limits at or above this many bytes (1 EiB) mean "no limit". cgroup v1 reports "unlimited"
#: as PAGE_COUNTER_MAX * PAGE_SIZE, e.g. 9223372036854771712 with 4 KiB pages
#: (mm/page_counter.c, include/linux/page_counter.h), which differs by page size.
UNLIMITED_THRESHOLD = 1 << 60


# ----------------------------------------------------------------------------------------------
# tolerant readers

class _KeptFiles(threading.local):
    """Per-step fast path: read-only descriptors kept open per path and read with ``pread`` at
    offset 0 (procfs, sysfs and cgroupfs regenerate the content on a read from offset 0): no
    open, close or text decoding per read, which dominate the cost of reading a small file.
    Active only inside :func:`probe` with ``cheap=True`` on the real roots (``/proc``, ``""``)."""

    on = False


_kept = _KeptFiles()
_kept_fds: Dict[str, int] = {}
_kept_lock = threading.Lock()

#: The per-step path re-reads the two larger files, /proc/meminfo and a cgroup's memory.stat
#: (the kernel formats dozens of lines for each), only when its last reading is older than this. The monitor's background thread refreshes both
#: with a full probe every 0.5 s; between readings, MemAvailable moves with this process's own
#: RSS and a cgroup's inactive file pages are taken as they were. The small files that show a
#: co-tenant at once (the cgroup's usage files) are read at every step; limit files are cached
#: alike (they change when a container is resized, not per step).
SLOW_FIGURES_MAX_AGE_S = 1.0
_slow_cache: Dict[str, Tuple[float, object]] = {}


def _slow_figure(key: str, read: Callable[[], object]) -> object:
    """``read()``, or its cached value when on the per-step path (:data:`_kept` on) and younger
    than :data:`SLOW_FIGURES_MAX_AGE_S`. Any full read refreshes the cache."""
    now = time.monotonic()
    if _kept.on:
        hit = _slow_cache.get(key)
        if hit is not None and now - hit[0] < SLOW_FIGURES_MAX_AGE_S:
            return hit[1]
    value = read()
    _slow_cache[key] = (now, value)
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


def _read_text(path: str) -> Optional[str]:
    """File contents, or None. Missing files are silent; other errors warn once per path."""
    if _kept.on:
        text = _read_kept(path)
        if text is not None:
            return text
    try:
        with open(path, "r", encoding="ascii", errors="replace") as fh:
            return fh.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        _warn_once(path, "memguard: cannot read %s: %s; treating it as absent", path, exc)
        return None


def _to_nonneg_int(token: str, where: str) -> Optional[int]:
    try:
        value = int(token)
    except (TypeError, ValueError):
        _warn_once(where, "memguard: %s: not an integer (%r); treating it as absent",
                   where, (token or "")[:40])
        return None
    if value < 0:
        _warn_once(where, "memguard: %s: negative value %d; treating it as absent", where, value)
        return None
    return value


def _read_int(path: str) -> Optional[int]:
    """A file holding one non-negative integer; None if absent or bad."""
    text = _read_text(path)
    if text is None:
        return None
    return _to_nonneg_int(text.strip(), path)


def _read_limit(path: str) -> Tuple[bool, Optional[int]]:
    """A limit file: ``(present, bytes or None for unlimited)``.

    ``"max"`` (v2) and values >= :data:`UNLIMITED_THRESHOLD` (v1) mean unlimited.
    """
    text = _read_text(path)
    if text is None:
        return False, None
    token = text.strip()
    if token == "max":
        return True, None
    value = _to_nonneg_int(token, path)
    if value is None:
        return False, None
    if value >= UNLIMITED_THRESHOLD:
        return True, None
    return True, value


# ----------------------------------------------------------------------------------------------
# /proc/meminfo, /proc/self/status

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
                _warn_once(f"{where}:{key}", "memguard: %s %s: not an integer (%r); ignored",
                           where, key, num[:40])
            continue
        if value < 0:
            _warn_once(f"{where}:{key}", "memguard: %s %s: negative (%d); ignored",
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
    text = _read_text(path)
    return parse_meminfo(text, path, keys) if text is not None else {}


def read_status(proc_root: str = "/proc", pid: str = "self",
                keys: Optional[frozenset] = None) -> Dict[str, int]:
    """/proc/<pid>/status sizes as ``{key: bytes}`` (only ``keys`` if given); empty if
    unreadable."""
    path = os.path.join(proc_root, str(pid), "status")
    text = _read_text(path)
    if text is None:
        return {}
    if keys is not None:
        return parse_meminfo(text, path, keys)
    return parse_status(text, path)


_MEMINFO_KEYS = frozenset(("MemTotal", "MemAvailable", "MemFree", "Buffers", "Cached"))
_MEMINFO_KEY = "meminfo:/proc"
_STATUS_KEYS = frozenset(("VmRSS", "VmHWM"))


# ----------------------------------------------------------------------------------------------
# PSI

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
                _warn_once(f"{where}:{kind}.{key}", "memguard: %s %s %s: garbage %r; ignored",
                           where, kind, key, raw[:40])
                continue
            if v < 0 or (key != "total" and v > 100.0):
                _warn_once(f"{where}:{kind}.{key}", "memguard: %s %s %s: out of range %r; "
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
        text = _read_text(path)
        if text is None:
            continue
        psi = parse_psi(text, path)
        if psi is not None:
            return psi
        _warn_once(path, "memguard: %s holds no PSI lines; ignored", path)
    return None


# ----------------------------------------------------------------------------------------------
# locating the cgroup

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
    cg_text = _read_text(os.path.join(proc_root, "self", "cgroup"))
    mi_text = _read_text(os.path.join(proc_root, "self", "mountinfo"))
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


def _location(proc_root: str, sys_root: str, refresh: bool) -> CgroupLocation:
    key = (proc_root, sys_root)
    if not refresh:
        loc = _loc_cache.get(key)
        if loc is not None:
            return loc
    loc = locate_cgroups(proc_root, sys_root)
    with _loc_lock:
        _loc_cache[key] = loc
    return loc


# ----------------------------------------------------------------------------------------------
# cgroup memory

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


def parse_flat_keyed(text: str, where: str) -> Dict[str, int]:
    """Parse ``key value`` lines (memory.stat, memory.events, memory.oom_control).

    Lines whose value is not a non-negative integer are logged once and skipped.
    """
    out: Dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        v = _to_nonneg_int(parts[1], f"{where}:{parts[0]}")
        if v is not None:
            out[parts[0]] = v
    return out


def _read_keyed(path: str) -> Dict[str, int]:
    text = _read_text(path)
    return parse_flat_keyed(text, path) if text is not None else {}


#: The per-step path's record of the levels of this process's cgroup that have a limit:
#: ``(time found, own cgroup directory, [(index up the hierarchy, directory)])``, from a full walk
#: at most every :data:`SLOW_FIGURES_MAX_AGE_S`. Outside a container the list is empty and the
#: per-step probe does not look at the cgroup at all.
_step_levels: Optional[Tuple[float, str, List[Tuple[int, str]]]] = None


def _cached_limit(path: str) -> Tuple[bool, Optional[int]]:
    """:func:`_read_limit`, reused on the per-step path while younger than
    :data:`SLOW_FIGURES_MAX_AGE_S` (limits change when a container is resized, not per step; the
    usage files next to them are read every time)."""
    return _slow_figure("limit:" + path, lambda: _read_limit(path))  # type: ignore[return-value]


def _level_v1(d: str, need_usage: bool) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """(limit, usage, working_set) of one v1 cgroup directory; usage read only if needed
    (``need_usage`` or a limit is set)."""
    _, limit = _cached_limit(os.path.join(d, "memory.limit_in_bytes"))
    if limit is None and not need_usage:
        return None, None, None
    usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
    ws = None
    if usage is not None:
        def inactive_file() -> int:
            stat = _read_keyed(os.path.join(d, "memory.stat"))
            return stat.get("total_inactive_file", stat.get("inactive_file", 0))
        ws = max(0, usage - int(_slow_figure("v1-inactive:" + d, inactive_file)))
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
    usage = _read_int(os.path.join(d, "memory.current"))
    ws = None
    if usage is not None:
        def inactive_file() -> int:
            return _read_keyed(os.path.join(d, "memory.stat")).get("inactive_file", 0)
        ws = max(0, usage - int(_slow_figure("v2-inactive:" + d, inactive_file)))
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
        loc = _location(proc_root, sys_root, refresh)
        # the per-step path skips the directory checks: a removed cgroup shows as unreadable files
        isdir = (lambda d: True) if _kept.on else os.path.isdir
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
        if _kept.on and not detail:
            now = time.monotonic()
            hit = _step_levels
            if hit is not None and hit[1] == own and now - hit[0] < SLOW_FIGURES_MAX_AGE_S:
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
            oom = _read_keyed(os.path.join(own, "memory.oom_control")).get("oom_kill")
            max_usage = _read_int(os.path.join(own, "memory.max_usage_in_bytes"))
        else:
            oom = _read_keyed(os.path.join(own, "memory.events")).get("oom_kill")
            max_usage = _read_int(os.path.join(own, "memory.peak"))
        return CgroupMemory(version=version, path=own, limit=limit, limit_path=limit_path,
                            usage=own_usage, working_set=own_ws, available=available,
                            oom_kill=oom, max_usage=max_usage)
    except Exception as exc:  # defensive: a probe never raises
        _warn_once(f"cgroup_memory:{proc_root}:{sys_root}",
                   "memguard: reading the memory cgroup failed: %r", exc)
        return None


# ----------------------------------------------------------------------------------------------
# virtual-memory limits: RLIMIT_AS / RLIMIT_DATA

@dataclass(frozen=True)
class AddressLimit:
    """A limit on this process's virtual memory and the room left under it. Sizes in bytes.

    Attributes:
        source: ``"RLIMIT_AS"`` or ``"RLIMIT_DATA"``.
        limit: the soft limit (the one the kernel enforces; the hard one only caps raising it).
        counted: what the kernel counts against it now: ``VmSize`` (``total_vm``) for
            ``RLIMIT_AS``; ``VmData + VmStk`` for ``RLIMIT_DATA`` (the kernel counts ``data_vm`` =
            ``VmData``; the main stack is added so the full probe agrees with /proc/self/statm's
            ``data`` field, which the per-step path can read; it errs towards less room).
        headroom: ``max(0, limit - counted)``: the room left for new mappings.
    """

    source: str
    limit: int
    counted: int
    headroom: int


def _rlimit_bytes(which: int) -> Optional[int]:
    """The soft limit ``which`` in bytes, None when unlimited or unreadable."""
    try:
        soft, _hard = _resource.getrlimit(which)
    except Exception as exc:  # defensive: a probe never raises
        _warn_once(f"getrlimit:{which}", "memguard: getrlimit(%r) failed: %r", which, exc)
        return None
    if soft is None or soft < 0 or soft == _resource.RLIM_INFINITY or soft >= UNLIMITED_THRESHOLD:
        return None
    return int(soft)


def read_rlimits() -> Tuple[Optional[int], Optional[int]]:
    """The soft ``(RLIMIT_AS, RLIMIT_DATA)`` of this process in bytes (getrlimit(2)); None for one
    that is unlimited (``RLIM_INFINITY``) or cannot be read. Never raises."""
    if _resource is None:
        return None, None
    return (_rlimit_bytes(_resource.RLIMIT_AS),
            _rlimit_bytes(getattr(_resource, "RLIMIT_DATA", _resource.RLIMIT_AS)))


#: ``(monotonic s, (RLIMIT_AS, RLIMIT_DATA))`` of the last :func:`read_rlimits`: a limit changes when
#: someone calls setrlimit / prlimit, not per step, so the per-step path re-reads it at most every
#: :data:`SLOW_FIGURES_MAX_AGE_S`.
_rlimits_seen: Optional[Tuple[float, Tuple[Optional[int], Optional[int]]]] = None


def _cached_rlimits(max_age: float = None) -> Tuple[Optional[int], Optional[int]]:
    global _rlimits_seen
    now = time.monotonic()
    hit = _rlimits_seen
    age = SLOW_FIGURES_MAX_AGE_S if max_age is None else max_age
    if hit is not None and now - hit[0] < age:
        return hit[1]
    limits = read_rlimits()
    _rlimits_seen = (now, limits)
    return limits


def address_limit(vm_size: Optional[int], vm_data: Optional[int],
                  limits: Tuple[Optional[int], Optional[int]]) -> Optional[AddressLimit]:
    """The virtual-memory limit with the least room left, from the process's counters.

    Args:
        vm_size: ``VmSize`` (bytes; counted by ``RLIMIT_AS``).
        vm_data: ``VmData + VmStk`` (bytes; counted by ``RLIMIT_DATA``).
        limits: soft ``(RLIMIT_AS, RLIMIT_DATA)`` in bytes, None for unlimited
            (:func:`read_rlimits`).

    Returns:
        :class:`AddressLimit`, or None when no limit is set or its counter is unknown.

    How it becomes a budget: the headroom is virtual address space, not resident memory. The
    probe caps ``available_bytes`` at it and ``total_bytes`` at the limit; the monitor's effective
    budget is ``(process RSS + available) x safety_ratio``, i.e. RSS + headroom at most. That is
    the conservative translation to the resident figures the monitor compares: a fresh allocation
    (torch's CPU tensors above glibc's mmap threshold are fresh mappings, unmapped again when
    freed) needs as much new mapping as it will make resident, while mapped-but-untouched
    memory (reserved arenas, thread stacks) counts against the limit without being resident.
    """
    cands = []
    as_lim, data_lim = limits
    if as_lim is not None and vm_size is not None:
        cands.append(AddressLimit("RLIMIT_AS", as_lim, int(vm_size), max(0, as_lim - int(vm_size))))
    if data_lim is not None and vm_data is not None:
        cands.append(AddressLimit("RLIMIT_DATA", data_lim, int(vm_data), max(0, data_lim - int(vm_data))))
    if not cands:
        return None
    return min(cands, key=lambda c: c.headroom)


_VM_KEYS = frozenset(("VmSize", "VmData", "VmStk"))


def _address_limit_now(proc_root: str) -> Optional[AddressLimit]:
    """This process's :func:`address_limit` now (only for the real /proc: the limits read are this
    process's own). Never raises."""
    if proc_root != "/proc":
        return None
    try:
        limits = _cached_rlimits()
        if limits == (None, None):
            return None
        vm = read_status(proc_root, keys=_VM_KEYS)
        data = vm.get("VmData")
        if data is not None:
            data += vm.get("VmStk", 0)
        return address_limit(vm.get("VmSize"), data, limits)
    except Exception as exc:  # defensive: a probe never raises
        _warn_once("linux.address_limit", "memguard: reading the address-space limits failed: %r", exc)
        return None


# ----------------------------------------------------------------------------------------------
# this process's resident set on the per-step path: /proc/self/statm and getrusage

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
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: ``ru_maxrss`` reads the batched per-CPU RSS counters, VmHWM their exact sum: a reading this far
#: above VmHWM is the floor, not drift (the batch is a few hundred KiB per CPU that ran the process).
_RU_DRIFT_BYTES = 4 << 20


try:
    import resource as _resource
except ImportError:   # not on Windows; this module is only used on Linux, but must import anywhere
    _resource = None


def reset_peak() -> bool:
    """Reset this process's peak resident set (VmHWM := VmRSS) by writing ``5`` to
    ``/proc/self/clear_refs`` (kernel Documentation/filesystems/proc.rst, "clear_refs"), through a
    descriptor kept open, and note the bound of the ``ru_maxrss`` floor (see above).

    Returns:
        True when the kernel took the reset; False where ``clear_refs`` cannot be written
        (old kernel, seccomp, read-only /proc). Never raises.
    """
    global _clear_refs_fd, _clear_refs_tried, _ru_floor_kib
    try:
        fd = _clear_refs_fd
        if fd is None:
            if _clear_refs_tried:
                return False
            _clear_refs_tried = True
            fd = _clear_refs_fd = os.open("/proc/self/clear_refs", os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        os.write(fd, b"5")
    except OSError:
        _clear_refs_fd = None
        return False
    try:
        after = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
        # max(floor, RSS now): the floor is at most this; keep the tightest bound seen
        if _ru_floor_kib is None or after < _ru_floor_kib:
            _ru_floor_kib = after
    except Exception:
        pass
    return True


def _step_rss_and_peak() -> Tuple[Optional[int], Optional[int]]:
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
    status = read_status(keys=_STATUS_KEYS)
    hwm = status.get("VmHWM")
    if hwm is not None and floor is not None:
        try:
            peak_kib = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
            if peak_kib * 1024 > hwm + _RU_DRIFT_BYTES:
                _ru_floor_kib = min(floor, peak_kib)   # ru_maxrss reads the floor itself: its exact value
        except Exception:
            pass
    return status.get("VmRSS", rss), hwm


def step_figures() -> Optional[Tuple[float, int, int, int]]:
    """The per-step check's figures in the common case, without building a snapshot:
    ``(monotonic seconds, RSS, peak since the last reset, RSS + available)``, sizes in bytes, as
    :func:`probe` ``(cheap=True)`` would give them (the peak is ``max(RSS, ru_maxrss)``;
    ``available`` comes from the cached /proc/meminfo reading, moved by this process's growth
    since). The check runs at every micro-batch, right after a training step, when every cache is
    cold: this path skips the cheap probe's extra reads and its snapshot object.

    Returns None, and the caller takes :func:`probe`, when the common case does not hold: a limited
    cgroup level (its usage must be read), an ``RLIMIT_AS`` / ``RLIMIT_DATA`` in force, the cgroup levels or /proc/meminfo last read
    :data:`SLOW_FIGURES_MAX_AGE_S` or more ago (the cheap probe re-reads them), no peak reset yet,
    or an ambiguous ``ru_maxrss`` (see above). Never raises.
    """
    levels, floor, fd = _step_levels, _ru_floor_kib, _statm_fd
    if levels is None or levels[2] or floor is None or fd is None:
        return None
    if _cached_rlimits() != (None, None):
        return None   # a virtual-memory limit caps what is available: the cheap probe applies it
    now = time.monotonic()
    hit = _slow_cache.get(_MEMINFO_KEY)
    if hit is None or now - hit[0] >= SLOW_FIGURES_MAX_AGE_S or now - levels[0] >= SLOW_FIGURES_MAX_AGE_S:
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
    avail = max(0, min(avail - (rss - rss_then), total))   # _probe's rule where no cgroup level limits
    return now, rss, max(rss, peak_kib * 1024), rss + avail


def _forget_after_fork() -> None:
    """In a forked child (DataLoader workers, multiprocessing): the kept descriptors of
    /proc/self/* still name the parent (procfs binds a file to the task at open), and a kept
    ``clear_refs`` would reset the parent's peak. Drop them, and what was read through them."""
    global _kept_lock, _clear_refs_fd, _clear_refs_tried, _ru_floor_kib, _statm_fd, _step_levels
    _kept_lock = threading.Lock()   # another thread may have held it at the fork
    for fd in list(_kept_fds.values()) + [f for f in (_clear_refs_fd, _statm_fd) if f is not None]:
        try:
            os.close(fd)
        except OSError:
            pass
    _kept_fds.clear()
    _slow_cache.clear()
    _clear_refs_fd, _clear_refs_tried, _ru_floor_kib, _statm_fd, _step_levels = None, False, None, None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


class _Mallinfo2(ctypes.Structure):
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
            fn.restype, fn.argtypes = _Mallinfo2, []
        _mallinfo2 = fn
    if fn is False:
        return None
    try:
        info = fn()
        return int(info.uordblks) + int(info.hblkhd)
    except Exception as exc:  # defensive: a probe never raises
        _warn_once("linux.mallinfo2", "memguard: mallinfo2() failed: %r", exc)
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


def pressure() -> Optional[float]:
    """PSI ``some avg10`` of memory (percent) of this process's cgroup v2 (``memory.pressure``),
    else of the host (/proc/pressure/memory); None where the kernel has no PSI. Uses the cgroup
    location found by the last full :func:`probe` (no mountinfo parse): the monitor's background
    thread reads this alone between full samples. Never raises."""
    try:
        loc = _location("/proc", "", refresh=False)
        psi = read_psi("/proc", "", cgroup_dir=loc.v2_dir or "")
        return None if psi is None else psi.some_avg10
    except Exception as exc:  # defensive: a probe never raises
        _warn_once("linux.pressure", "memguard: reading PSI failed: %r", exc)
        return None


def step_reader() -> StepReader:
    """The runtime monitor's reader on Linux CPU: the cheap probe, the VmHWM reset through a kept
    ``clear_refs`` descriptor (:func:`reset_peak`), the snapshot-free per-step figures
    (:func:`step_figures`), PSI read alone (:func:`pressure`: the background thread reads it
    between full samples) and glibc's in-use bytes (:func:`malloc_in_use`). The module's functions
    are bound when the reader is built."""
    return StepReader("cpu", probe=probe, reset_peak=reset_peak, step_figures=step_figures,
                      pressure=pressure, live_bytes=malloc_in_use, pressure_kind="psi")


# ----------------------------------------------------------------------------------------------
# the probe

def probe(cheap: bool = False, *, proc_root: str = "/proc", sys_root: str = "") -> MemorySnapshot:
    """Linux host snapshot, container-aware.

    ``total = min(MemTotal, cgroup limit)``; ``available = min(MemAvailable, limit -
    working_set over the cgroup and its ancestors)``; ``process_bytes = VmRSS``;
    ``process_peak_bytes = VmHWM``; ``pressure = PSI some avg10`` (the cgroup's own v2
    ``memory.pressure`` where present, else /proc/pressure/memory). ``limit_bytes`` is the
    cgroup limit when it is below MemTotal (a larger one is not in force), else None.

    Under a soft ``RLIMIT_AS`` / ``RLIMIT_DATA`` (:func:`address_limit`), ``available`` is capped
    at the room left under it and ``total`` at the limit; ``address_limit_*`` report it.

    ``cheap=True`` (the per-step path) reuses the cached cgroup location (no mountinfo parse),
    reads through kept descriptors (:class:`_KeptFiles`), skips PSI (``pressure`` is None: the
    monitor reads PSI averages in its background thread only) and reuses readings of
    /proc/meminfo, memory.stat and the cgroup limit files younger than
    :data:`SLOW_FIGURES_MAX_AGE_S` (MemAvailable then moves with this process's RSS since that
    reading); the RSS (/proc/self/statm), the peak (``ru_maxrss`` after a :func:`reset_peak`, else
    VmHWM) and the cgroup usage files are read every time. Never raises.
    """
    if cheap and proc_root == "/proc" and sys_root == "":
        _kept.on = True
        try:
            return _probe(True, proc_root, sys_root)
        finally:
            _kept.on = False
    return _probe(cheap, proc_root, sys_root)


def _probe(cheap: bool, proc_root: str, sys_root: str) -> MemorySnapshot:
    now = time.monotonic()
    if _kept.on:
        rss, hwm = _step_rss_and_peak()
    else:
        status = read_status(proc_root, keys=_STATUS_KEYS)
        rss = status.get("VmRSS")
        hwm = status.get("VmHWM")
    hit = _slow_cache.get(_MEMINFO_KEY) if _kept.on else None
    if hit is not None and now - hit[0] < SLOW_FIGURES_MAX_AGE_S:
        mem, rss_then = hit[1]   # the per-step path: _slow_figure's rule, without its call
    else:
        mem, rss_then = _slow_figure(_MEMINFO_KEY if proc_root == "/proc" else "meminfo:" + proc_root,
                                     lambda: (read_meminfo(proc_root, _MEMINFO_KEYS), rss))
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
            _warn_once("linux.psutil", "memguard: psutil fallback failed: %r", exc)
            host_total = host_total or 0
            host_avail = host_avail or 0
            rss = rss or 0

    levels = _step_levels
    if _kept.on and levels is not None and not levels[2] and now - levels[0] < SLOW_FIGURES_MAX_AGE_S:
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
    vlim = _address_limit_now(proc_root)
    if vlim is not None:
        # virtual room, not RSS: capping what is available at it is the conservative translation
        # (see address_limit); RSS can never pass the limit itself
        avail = min(avail, vlim.headroom)
        total = vlim.limit if total <= 0 else min(total, vlim.limit)
    avail = max(0, min(avail, total)) if total > 0 else max(0, avail)

    pressure = None
    if not cheap:
        loc = _location(proc_root, sys_root, refresh=False)
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
