"""Where this process's memory cgroup lives: parse /proc/self/cgroup and /proc/self/mountinfo.

Part of the real-memory-limit harness (``memguard_testing.cgroup_harness``, docs/design.md,
"Real cgroup limits"). Nothing is a fixed path:
- the process's memory cgroup: the ``memory`` line (v1) or the ``0::`` line (v2) of
  ``/proc/self/cgroup`` (proc(5), "/proc/pid/cgroup");
- the controller's mount: ``/proc/self/mountinfo`` (proc(5), "/proc/pid/mountinfo"): fstype
  ``cgroup`` with ``memory`` in the super options (v1), or fstype ``cgroup2`` whose root
  ``cgroup.controllers`` lists ``memory`` (v2). A cgroup path maps to a directory as
  ``mountpoint + (path minus the mount's root)``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from memguard_testing.cgroup_errors import CgroupError

__all__ = [
    "CgroupLocation",
    "MountEntry",
    "locate_memory_cgroup",
    "map_cgroup_path",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "read_text",
    "swap_total_bytes",
    "v2_enable_memory_for_children",
]


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (only the fields the harness needs)."""

    root: str           # the path inside the filesystem that is mounted (field 4)
    mountpoint: str     # where it is mounted (field 5)
    fstype: str         # after the " - " separator
    super_options: tuple[str, ...]


@dataclass(frozen=True)
class CgroupLocation:
    """Where the test process's memory cgroup lives.

    Attributes:
        version: 1 (memory controller on a v1 hierarchy) or 2 (unified hierarchy).
        mountpoint: the mount of that hierarchy, e.g. ``/sys/fs/cgroup/memory``.
        cgroup_path: the path from ``/proc/self/cgroup``, e.g. ``/process_api/af18...``.
        directory: the absolute directory of that cgroup, where children are created.
    """

    version: int
    mountpoint: str
    cgroup_path: str
    directory: str


def _unescape_mountinfo(field: str) -> str:
    """Undo the octal escapes of mountinfo (space is ``\\040``, proc(5))."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[MountEntry]:
    """Parse /proc/self/mountinfo text (format: proc(5)); malformed lines are skipped."""
    entries = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
            entries.append(MountEntry(
                root=_unescape_mountinfo(fields[3]),
                mountpoint=_unescape_mountinfo(fields[4]),
                fstype=fields[sep + 1],
                super_options=tuple(fields[sep + 3].split(",")) if len(fields) > sep + 3 else (),
            ))
        except (ValueError, IndexError):
            continue
    return entries


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Parse /proc/self/cgroup (``id:controllers:path`` per line, proc(5)).

    Returns:
        controller name -> cgroup path; the v2 line (``0::/path``) is under the key ``""``.
        A v1 line naming several controllers (``cpu,cpuacct``) gives one key per controller.
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hid, controllers, path = parts
        if controllers == "":
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def map_cgroup_path(mount: MountEntry, cgroup_path: str) -> Optional[str]:
    """Directory of ``cgroup_path`` (from /proc/self/cgroup) under ``mount``.

    ``mountpoint + (cgroup_path minus the mount's root)``; None if the mount (a bind mount of a
    sub-tree, e.g. in a container) does not contain ``cgroup_path``.
    """
    root = mount.root.rstrip("/")
    if root and not (cgroup_path == root or cgroup_path.startswith(root + "/")):
        return None
    rel = cgroup_path[len(root):].lstrip("/")
    return os.path.join(mount.mountpoint, rel) if rel else mount.mountpoint


def read_text(path: str) -> str:
    """The whole text of ``path`` (a /proc or cgroup file). Raises OSError as ``open`` does."""
    with open(path, "r") as f:
        return f.read()


def locate_memory_cgroup(proc_cgroup_text: Optional[str] = None,
                         mountinfo_text: Optional[str] = None) -> CgroupLocation:
    """Find the directory of this process's memory cgroup (v1 preferred if bound there).

    Args:
        proc_cgroup_text: content of /proc/self/cgroup (read from the system if None).
        mountinfo_text: content of /proc/self/mountinfo (read from the system if None).

    A controller is bound to at most one hierarchy (cgroups(7)), so a v1 ``memory`` mount, when
    present, is where memory is controlled; otherwise a cgroup2 mount whose root
    ``cgroup.controllers`` lists ``memory``.

    Raises:
        CgroupError: no memory controller, or this process's cgroup is not reachable through any
            mount (the message says which).
    """
    if proc_cgroup_text is None:
        proc_cgroup_text = read_text("/proc/self/cgroup")
    if mountinfo_text is None:
        mountinfo_text = read_text("/proc/self/mountinfo")
    own = parse_proc_cgroup(proc_cgroup_text)
    mounts = parse_mountinfo(mountinfo_text)

    v1_mounts = [m for m in mounts if m.fstype == "cgroup" and "memory" in m.super_options]
    if v1_mounts:
        if "memory" not in own:
            raise CgroupError("a v1 memory hierarchy is mounted but /proc/self/cgroup has no "
                              "memory line")
        for m in v1_mounts:
            d = map_cgroup_path(m, own["memory"])
            if d is not None and os.path.isdir(d):
                return CgroupLocation(1, m.mountpoint, own["memory"], d)
        raise CgroupError(f"own v1 memory cgroup {own['memory']!r} is not visible under any "
                          f"memory mount ({', '.join(m.mountpoint for m in v1_mounts)})")

    v2_mounts = [m for m in mounts if m.fstype == "cgroup2"]
    for m in v2_mounts:
        try:
            controllers = read_text(os.path.join(m.mountpoint, "cgroup.controllers")).split()
        except OSError:
            continue
        if "memory" not in controllers:
            continue
        if "" not in own:
            raise CgroupError("a cgroup2 hierarchy with memory is mounted but /proc/self/cgroup "
                              "has no 0:: line")
        d = map_cgroup_path(m, own[""])
        if d is not None and os.path.isdir(d):
            return CgroupLocation(2, m.mountpoint, own[""], d)
    if v2_mounts:
        raise CgroupError("no memory controller: no v1 memory mount, and no cgroup2 mount "
                          "(" + ", ".join(m.mountpoint for m in v2_mounts) + ") lists memory "
                          "in cgroup.controllers or contains this process's cgroup")
    raise CgroupError("no cgroup filesystem with a memory controller is mounted")


def v2_enable_memory_for_children(directory: str) -> None:
    """Make ``memory`` available to children of a v2 cgroup (``+memory`` in subtree_control).

    Raises:
        CgroupError: the parent does not offer memory, or the kernel refuses (EBUSY: the
            "no internal processes" rule of cgroup-v2.rst forbids it while ``directory`` itself
            holds processes, unless it is the root).
    """
    sub = os.path.join(directory, "cgroup.subtree_control")
    if "memory" in read_text(sub).split():
        return
    if "memory" not in read_text(os.path.join(directory, "cgroup.controllers")).split():
        raise CgroupError(f"memory controller is not enabled for {directory} by its parent")
    try:
        with open(sub, "w") as f:
            f.write("+memory")
    except OSError as e:
        raise CgroupError(f"cannot enable memory for children of {directory}: {e} (cgroup v2 "
                          f"refuses while the cgroup itself holds processes)") from e


def swap_total_bytes() -> int:
    """SwapTotal from /proc/meminfo, in bytes (0 = no swap: a cgroup limit is a hard wall)."""
    for line in read_text("/proc/meminfo").splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) * 1024
    return 0
