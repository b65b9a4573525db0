"""Test harness for REAL memory limits: run a command inside a child memory cgroup.

The container failure memguard must survive is the kernel's cgroup OOM killer: a process that
goes over its cgroup's memory limit gets SIGKILL (exit 137 through a shell, ``-9`` from
``subprocess``) with no Python exception. This module reproduces that on a Linux machine where
the memory controller is writable (as root): it creates a child cgroup under the test process's
own memory cgroup, sets a limit, runs a command inside it and reports the exit status, the
kernel's ``oom_kill`` count and the cgroup's peak usage, and always removes the cgroup.

Where things are found (nothing is a fixed path):
- the test process's memory cgroup: the ``memory`` line (v1) or the ``0::`` line (v2) of
  ``/proc/self/cgroup`` (proc(5), "/proc/pid/cgroup");
- the controller's mount: ``/proc/self/mountinfo`` (proc(5), "/proc/pid/mountinfo"): fstype
  ``cgroup`` with ``memory`` in the super options (v1), or fstype ``cgroup2`` whose root
  ``cgroup.controllers`` lists ``memory`` (v2). A cgroup path maps to a directory as
  ``mountpoint + (path minus the mount's root)``.

Kernel files used (Documentation/admin-guide/cgroup-v1/memory.rst and cgroup-v2.rst):

==================  ===================================  ==========================
what                v1                                   v2
==================  ===================================  ==========================
limit               memory.limit_in_bytes                memory.max
swap off            memory.memsw.limit_in_bytes (=limit) memory.swap.max = 0
                    + memory.swappiness = 0
usage               memory.usage_in_bytes                memory.current
peak usage          memory.max_usage_in_bytes            memory.peak (kernel >= 5.19)
OOM kills           memory.oom_control ``oom_kill``      memory.events ``oom_kill``
members             cgroup.procs                         cgroup.procs
==================  ===================================  ==========================

Lowering the limit below the current usage (``MemoryCgroup.set_limit``) differs by version:
- v1: the kernel reclaims (mm/memcontrol-v1.c ``mem_cgroup_resize_max``); anonymous memory
  cannot be reclaimed without swap, so after its retries the write fails with ``EBUSY``, the
  limit stays as it was and no process is killed. The harness raises
  :class:`CgroupLimitBusyError` (``integration_tests/test_cgroup_harness.py`` lowers a limit below a
  child's resident memory and checks exactly that).
- v2: the kernel reclaims and then invokes the OOM killer until usage fits
  (mm/memcontrol.c ``memory_max_write``): the write succeeds and processes are killed.

With no swap (``free`` shows ``Swap: 0`` here) the limit is a hard wall: a process that
touches more than the limit is OOM-killed, reliably.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from memguard_core.errors import ConfigError, require_positive_int

logger = logging.getLogger("memguard.integration.cgroup_harness")

__all__ = [
    "CgroupError",
    "CgroupLimitBusyError",
    "CgroupLocation",
    "CgroupRunResult",
    "MemoryCgroup",
    "cgroups_writable",
    "locate_memory_cgroup",
    "map_cgroup_path",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "swap_total_bytes",
]

#: Exit status of the join wrapper when the child could not write its pid to cgroup.procs.
JOIN_FAILED_EXIT = 125
_JOIN_FAILED_MARKER = "memguard-cgroup-harness: could not join cgroup"
# The child joins the cgroup itself before exec: ``$$`` is the shell's pid, which ``exec`` keeps,
# so the command runs in the cgroup from its first instruction and never outside it.
_JOIN_SCRIPT = (
    'echo $$ > "$0" || { echo "' + _JOIN_FAILED_MARKER + ' $0" >&2; exit '
    + str(JOIN_FAILED_EXIT) + '; }; exec "$@"'
)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KILLED_RETURNCODES = (-signal.SIGKILL, 128 + signal.SIGKILL)


class CgroupError(RuntimeError):
    """A cgroup operation of the harness failed (create, join, write, remove)."""


class CgroupLimitBusyError(CgroupError):
    """The kernel refused to lower a v1 limit below the current usage (``EBUSY``).

    cgroup v1 reclaims before it accepts a lower ``memory.limit_in_bytes``; when it cannot
    reclaim enough (anonymous memory, no swap) the write fails with EBUSY and the old limit
    stays (Documentation/admin-guide/cgroup-v1/memory.rst, section 2.5 / mm/memcontrol-v1.c).

    Attributes:
        requested_bytes: the limit that was asked for.
        limit_bytes: the limit still in force (bytes).
        usage_bytes: the cgroup's usage when the write failed (bytes).
    """

    def __init__(self, requested_bytes: int, limit_bytes: int, usage_bytes: int):
        self.requested_bytes = requested_bytes
        self.limit_bytes = limit_bytes
        self.usage_bytes = usage_bytes
        super().__init__(
            f"kernel refused to lower the memory limit to {requested_bytes} bytes (EBUSY): "
            f"usage {usage_bytes} bytes could not be reclaimed; the limit stays {limit_bytes} bytes"
        )


# ---------------------------------------------------------------------------------------------
# Locating the memory controller
# ---------------------------------------------------------------------------------------------

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


def _read(path: str) -> str:
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
        proc_cgroup_text = _read("/proc/self/cgroup")
    if mountinfo_text is None:
        mountinfo_text = _read("/proc/self/mountinfo")
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
            controllers = _read(os.path.join(m.mountpoint, "cgroup.controllers")).split()
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


def _v2_enable_memory_for_children(directory: str) -> None:
    """Make ``memory`` available to children of a v2 cgroup (``+memory`` in subtree_control).

    Raises:
        CgroupError: the parent does not offer memory, or the kernel refuses (EBUSY: the
            "no internal processes" rule of cgroup-v2.rst forbids it while ``directory`` itself
            holds processes, unless it is the root).
    """
    sub = os.path.join(directory, "cgroup.subtree_control")
    if "memory" in _read(sub).split():
        return
    if "memory" not in _read(os.path.join(directory, "cgroup.controllers")).split():
        raise CgroupError(f"memory controller is not enabled for {directory} by its parent")
    try:
        with open(sub, "w") as f:
            f.write("+memory")
    except OSError as e:
        raise CgroupError(f"cannot enable memory for children of {directory}: {e} (cgroup v2 "
                          f"refuses while the cgroup itself holds processes)") from e


def swap_total_bytes() -> int:
    """SwapTotal from /proc/meminfo, in bytes (0 = no swap: a cgroup limit is a hard wall)."""
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def cgroups_writable() -> tuple[bool, str]:
    """Whether a child memory cgroup can be created (and limited) under this process's own.

    Actually tries: creates a probe child, writes a limit into it, removes it.

    Returns:
        (True, description of where) or (False, the reason, fit for ``pytest.skip``).
    """
    try:
        loc = locate_memory_cgroup()
    except (CgroupError, OSError) as e:
        return False, f"cgroup memory controller not usable: {e}"
    probe = os.path.join(loc.directory, f"memguard-probe-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        if loc.version == 2:
            _v2_enable_memory_for_children(loc.directory)
        os.mkdir(probe)
    except (CgroupError, OSError) as e:
        return False, (f"cannot create a child memory cgroup under {loc.directory} "
                       f"(v{loc.version}): {e}")
    try:
        limit_file = "memory.limit_in_bytes" if loc.version == 1 else "memory.max"
        with open(os.path.join(probe, limit_file), "w") as f:
            f.write(str(64 << 20))
    except OSError as e:
        return False, f"cannot write {limit_file} in a child cgroup of {loc.directory}: {e}"
    finally:
        try:
            os.rmdir(probe)
        except OSError as e:  # an empty fresh cgroup should always go; say so if not
            logger.warning("could not remove probe cgroup %s: %s", probe, e)
    return True, f"cgroup v{loc.version} memory controller writable at {loc.directory}"


# ---------------------------------------------------------------------------------------------
# The cgroup
# ---------------------------------------------------------------------------------------------

@dataclass
class CgroupRunResult:
    """Outcome of :meth:`MemoryCgroup.run`.

    Attributes:
        returncode: the child's exit status as ``subprocess`` reports it (``-9`` when SIGKILLed;
            ``137`` when a shell in between reports the kill).
        killed_by_oom: the child was SIGKILLed (-9 / 137) AND the cgroup's oom_kill count rose
            during the run: the kernel's cgroup OOM killer, not something else.
        oom_kills: how many OOM kills the cgroup recorded during the run.
        max_usage_bytes: the cgroup's peak usage (bytes) during the run (v1: reset at start;
            v2: memory.peak since creation; None where the kernel has no peak file).
        stdout, stderr: the child's output (text).
        wall_s: wall-clock seconds from start to exit.
        timed_out: the run passed ``timeout`` and the harness killed it.
    """

    returncode: int
    killed_by_oom: bool
    oom_kills: int
    max_usage_bytes: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool = False


Command = Union[Sequence[str], str]


class MemoryCgroup:
    """A uniquely named child memory cgroup with a limit, removed on exit.

    Use as a context manager::

        with MemoryCgroup(200 * 2**20) as cg:
            res = cg.run([sys.executable, "train.py"], timeout=300)
            assert res.killed_by_oom

    Args:
        limit_bytes: the memory limit (bytes, > 0; the kernel rounds it down to a page).
        name: a label for the directory name ([A-Za-z0-9_.-], <= 64 chars); a unique suffix
            (pid + random hex) is always appended, so concurrent tests never collide.
        location: where to create it (default: :func:`locate_memory_cgroup`).

    On entry: creates ``<own cgroup>/<name>-<pid>-<hex>``, sets the limit, turns swap off for it
    (v1: memsw limit = limit where the kernel has memsw, swappiness 0 where writable; v2:
    memory.swap.max 0 where present). On exit (also when the body raised): SIGKILLs every process
    left in it, waits for them to leave, then rmdirs it, retrying on EBUSY for ``cleanup_timeout_s``.

    Raises:
        ConfigError: ``limit_bytes`` not a positive int, or a bad ``name``.
        CgroupError: the cgroup cannot be located / created / limited (on entry), or cannot be
            removed (on exit, only when the body did not raise; otherwise it is logged).
    """

    def __init__(self, limit_bytes: int, name: Optional[str] = None, *,
                 location: Optional[CgroupLocation] = None, cleanup_timeout_s: float = 10.0):
        self._initial_limit = require_positive_int("limit_bytes", limit_bytes)
        if name is not None and (not isinstance(name, str) or not _NAME_RE.match(name)):
            raise ConfigError("name", "1-64 characters from [A-Za-z0-9_.-]", name)
        self._label = name or "memguard-test"
        self._location = location
        self._cleanup_timeout_s = float(cleanup_timeout_s)
        self._path: Optional[str] = None
        self._procs: list[subprocess.Popen] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "MemoryCgroup":
        loc = self._location or locate_memory_cgroup()
        self._location = loc
        if loc.version == 2:
            _v2_enable_memory_for_children(loc.directory)
        path = os.path.join(loc.directory,
                            f"{self._label}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
        except OSError as e:
            raise CgroupError(f"cannot create cgroup {path}: {e}") from e
        self._path = path
        try:
            self._disable_swap()
            self.set_limit(self._initial_limit)
        except BaseException:
            self.close(raise_errors=False)
            raise
        logger.info("created memory cgroup %s (v%d) limit=%d", path, loc.version,
                    self._initial_limit)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(raise_errors=exc_type is None)

    @property
    def path(self) -> str:
        """Absolute directory of the cgroup. Raises CgroupError outside the ``with`` block."""
        if self._path is None:
            raise CgroupError("MemoryCgroup is not active (use it as a context manager)")
        return self._path

    @property
    def version(self) -> int:
        """1 or 2 (cgroup version of the memory controller)."""
        if self._location is None:
            raise CgroupError("MemoryCgroup is not active (use it as a context manager)")
        return self._location.version

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _write(self, name: str, value: str) -> None:
        with open(self._file(name), "w") as f:
            f.write(value)

    def _read_int(self, name: str) -> int:
        return int(_read(self._file(name)).split()[0])

    def _read_keyed(self, name: str, key: str) -> int:
        for line in _read(self._file(name)).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
        raise CgroupError(f"{name} of {self.path} has no {key!r} line (kernel too old?)")

    def _disable_swap(self) -> None:
        if self.version == 1:
            try:
                self._write("memory.swappiness", "0")
            except OSError as e:  # not fatal: with memsw = limit swap cannot extend the limit
                logger.info("memory.swappiness not writable in %s: %s", self.path, e)
        elif os.path.exists(self._file("memory.swap.max")):
            self._write("memory.swap.max", "0")

    # -- limits and counters -----------------------------------------------------------------

    def set_limit(self, limit_bytes: int) -> None:
        """Set the memory limit (bytes), also while processes run inside.

        v1 writes memory.limit_in_bytes and memory.memsw.limit_in_bytes (where the kernel has
        it) in the order the kernel requires (memsw >= limit at all times: memory first when
        lowering, memsw first when raising). v2 writes memory.max.

        Lowering below the current usage: v1 -> :class:`CgroupLimitBusyError` (the kernel could
        not reclaim; the old limit stays, nobody is killed); v2 -> the write succeeds and the
        kernel OOM-kills processes in the cgroup until usage fits.

        Raises:
            ConfigError: not a positive int.
            CgroupLimitBusyError: v1 EBUSY, see above.
            CgroupError: any other write failure.
        """
        limit_bytes = require_positive_int("limit_bytes", limit_bytes)
        try:
            if self.version == 2:
                self._write("memory.max", str(limit_bytes))
                return
            has_memsw = os.path.exists(self._file("memory.memsw.limit_in_bytes"))
            lowering = limit_bytes < self.limit_bytes()
            order = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            if not lowering:
                order.reverse()
            for f in order:
                if f == "memory.memsw.limit_in_bytes" and not has_memsw:
                    continue
                try:
                    self._write(f, str(limit_bytes))
                except OSError as e:
                    if e.errno == errno.EBUSY:
                        raise CgroupLimitBusyError(limit_bytes, self.limit_bytes(),
                                                   self.usage_bytes()) from e
                    raise
        except CgroupError:
            raise
        except OSError as e:
            raise CgroupError(f"cannot set memory limit {limit_bytes} on {self.path}: {e}") from e

    def limit_bytes(self) -> Optional[int]:
        """The limit in force (bytes; page-rounded by the kernel); None when v2 says ``max``."""
        if self.version == 1:
            return self._read_int("memory.limit_in_bytes")
        raw = _read(self._file("memory.max")).strip()
        return None if raw == "max" else int(raw)

    def usage_bytes(self) -> int:
        """Current charged memory (bytes): v1 memory.usage_in_bytes, v2 memory.current."""
        return self._read_int("memory.usage_in_bytes" if self.version == 1 else "memory.current")

    def max_usage_bytes(self) -> Optional[int]:
        """Peak charged memory (bytes): v1 memory.max_usage_in_bytes (since creation or the
        last :meth:`reset_max_usage`), v2 memory.peak (since creation; None if absent)."""
        if self.version == 1:
            return self._read_int("memory.max_usage_in_bytes")
        try:
            return self._read_int("memory.peak")
        except FileNotFoundError:
            return None

    def reset_max_usage(self) -> None:
        """Reset the peak to the current usage (v1: write to memory.max_usage_in_bytes).

        v2's memory.peak can only be reset per open file (kernel >= 6.12), so this is a no-op
        there and :meth:`max_usage_bytes` stays the peak since creation.
        """
        if self.version == 1:
            self._write("memory.max_usage_in_bytes", "0")

    def oom_kill_count(self) -> int:
        """Processes the OOM killer killed in this cgroup (v1: memory.oom_control ``oom_kill``,
        kernel >= 4.13; v2: memory.events ``oom_kill``)."""
        if self.version == 1:
            return self._read_keyed("memory.oom_control", "oom_kill")
        return self._read_keyed("memory.events", "oom_kill")

    def pids(self) -> list[int]:
        """Pids of the processes now in the cgroup (cgroup.procs)."""
        return [int(x) for x in _read(self._file("cgroup.procs")).split()]

    # -- running commands --------------------------------------------------------------------

    def _wrap(self, cmd: Command) -> list[str]:
        if isinstance(cmd, str):
            argv = ["/bin/sh", "-c", cmd]
        else:
            argv = [str(a) for a in cmd]
        if not argv:
            raise ConfigError("cmd", "a non-empty argument list or shell string", cmd)
        return ["/bin/sh", "-c", _JOIN_SCRIPT, self._file("cgroup.procs"), *argv]

    def popen(self, cmd: Command, env: Optional[Mapping[str, str]] = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside the cgroup and return its ``Popen`` (for long-running children).

        The child is a tiny ``sh`` that writes its own pid to cgroup.procs and then ``exec``s
        ``cmd`` (same pid), so ``cmd`` runs inside the cgroup from its first instruction. If the
        join fails the command is never run and the child exits with ``JOIN_FAILED_EXIT`` (125)
        and a message on stderr. A ``str`` cmd runs under ``/bin/sh -c``; an OOM kill is then
        reported as 137 unless the shell execs the command itself. The process is killed on
        exit of the ``with`` block if still running.

        Args:
            cmd: argument list, or a shell command string.
            env: environment for the child (default: inherited).
            **popen_kwargs: passed to ``subprocess.Popen`` (stdout, stderr, stdin, text, cwd...).
        """
        proc = subprocess.Popen(self._wrap(cmd), env=None if env is None else dict(env),
                                **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, cmd: Command, env: Optional[Mapping[str, str]] = None,
            timeout: Optional[float] = 600.0) -> CgroupRunResult:
        """Run ``cmd`` inside the cgroup to completion and report how it ended.

        Args:
            cmd: argument list, or a shell command string (see :meth:`popen`).
            env: environment for the child (default: inherited).
            timeout: seconds (> 0) before every process in the cgroup is SIGKILLed and the
                result comes back with ``timed_out=True``; None waits forever.

        Raises:
            ConfigError: bad ``timeout`` or empty ``cmd``.
            CgroupError: the child could not join the cgroup.
        """
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ConfigError("timeout", "a number of seconds > 0, or None", timeout)
        self.reset_max_usage()
        ooms_before = self.oom_kill_count()
        t0 = time.monotonic()
        proc = self.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, errors="replace")
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill_all()
            out, err = proc.communicate()
        wall = time.monotonic() - t0
        rc = proc.returncode
        if rc == JOIN_FAILED_EXIT and _JOIN_FAILED_MARKER in err:
            raise CgroupError(f"child could not join {self.path}: {err.strip()}")
        ooms = self.oom_kill_count() - ooms_before
        return CgroupRunResult(
            returncode=rc,
            killed_by_oom=rc in _KILLED_RETURNCODES and ooms > 0 and not timed_out,
            oom_kills=ooms,
            max_usage_bytes=self.max_usage_bytes(),
            stdout=out,
            stderr=err,
            wall_s=wall,
            timed_out=timed_out,
        )

    # -- cleanup -----------------------------------------------------------------------------

    def kill_all(self, timeout_s: Optional[float] = None) -> bool:
        """SIGKILL every process in the cgroup and wait until it is empty.

        Also reaps this harness's own children (a zombie still counts on some kernels).

        Returns:
            True when the cgroup is empty (or already gone), False at the timeout
            (``cleanup_timeout_s`` by default).
        """
        deadline = time.monotonic() + (self._cleanup_timeout_s if timeout_s is None
                                       else timeout_s)
        if self._path is None or not os.path.isdir(self._path):
            return True
        if self.version == 2 and os.path.exists(self._file("cgroup.kill")):
            try:
                self._write("cgroup.kill", "1")
            except OSError as e:
                logger.info("cgroup.kill failed in %s: %s", self.path, e)
        while True:
            pids = self._safe_pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                except OSError as e:
                    logger.warning("cannot kill pid %d in %s: %s", pid, self.path, e)
            for p in self._procs:
                p.poll()  # reap our own children
            if not pids:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _safe_pids(self) -> list[int]:
        try:
            return self.pids()
        except (OSError, ValueError):
            return []

    def close(self, raise_errors: bool = True) -> None:
        """Kill what is left in the cgroup, then remove it (idempotent).

        Every step is tried even when an earlier one failed. Our own ``Popen`` children are
        waited for and their pipes closed.

        Raises:
            CgroupError: the directory could not be removed within ``cleanup_timeout_s``
                (only with ``raise_errors``; otherwise logged).
        """
        path = self._path
        if path is None:
            return
        problems = []
        try:
            if not self.kill_all():
                problems.append(f"processes still in cgroup: {self._safe_pids()}")
        except Exception as e:  # keep going: the rmdir below must still be tried
            problems.append(f"kill failed: {e!r}")
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, self._cleanup_timeout_s))
            except Exception as e:
                problems.append(f"pid {p.pid} not reaped: {e!r}")
            for stream in (p.stdin, p.stdout, p.stderr):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        self._procs = []
        deadline = time.monotonic() + self._cleanup_timeout_s
        removed = False
        while True:
            try:
                os.rmdir(path)
                removed = True
                break
            except FileNotFoundError:
                removed = True
                break
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                    problems.append(f"rmdir failed: {e}")
                    break
                self.kill_all(timeout_s=0.5)
                time.sleep(0.05)
        if removed:
            self._path = None
            logger.info("removed memory cgroup %s", path)
            return
        msg = f"could not remove cgroup {path}: " + "; ".join(problems)
        logger.error(msg)
        if raise_errors:
            raise CgroupError(msg)
