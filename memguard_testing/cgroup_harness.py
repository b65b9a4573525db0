"""Test harness for REAL memory limits: run a command inside a child memory cgroup.

The container failure memguard must survive is the kernel's cgroup OOM killer: a process that
goes over its cgroup's memory limit gets SIGKILL (exit 137 through a shell, ``-9`` from
``subprocess``) with no Python exception. :class:`MemoryCgroup` reproduces that on a Linux
machine where the memory controller is writable (as root): it creates a child cgroup under the
test process's own memory cgroup, sets a limit, runs commands inside it and always removes it.
docs/design.md ("Real cgroup limits") says what the tests use it for.

Its parts: ``cgroup_locate`` finds the controller and the process's cgroup, ``cgroup_files``
reads and writes the v1/v2 kernel files (the table of them is there), ``cgroup_runner`` starts
and kills the processes inside and reports a run (:class:`~memguard_testing.cgroup_runner.CgroupRunResult`),
``cgroup_errors`` holds the errors.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import subprocess
import time
from typing import Mapping, Optional

from memguard_core.errors import ConfigError, require_positive_int
from memguard_testing.cgroup_errors import CgroupError
from memguard_testing.cgroup_files import CgroupFiles
from memguard_testing.cgroup_locate import (
    CgroupLocation,
    locate_memory_cgroup,
    v2_enable_memory_for_children,
)
from memguard_testing.cgroup_runner import CgroupRunner, CgroupRunResult, Command

logger = logging.getLogger("memguard.integration.cgroup_harness")

__all__ = ["MemoryCgroup", "cgroups_writable"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_NOT_ACTIVE = "MemoryCgroup is not active (use it as a context manager)"


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
            v2_enable_memory_for_children(loc.directory)
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

    The limit and counters are :class:`CgroupFiles`' (v1/v2 files), the processes
    :class:`CgroupRunner`'s; outside the ``with`` block they raise :class:`CgroupError`.

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
        # Both set while the directory exists (from creation until it is removed).
        self._files: Optional[CgroupFiles] = None
        self._runner: Optional[CgroupRunner] = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "MemoryCgroup":
        loc = self._location or locate_memory_cgroup()
        self._location = loc
        if loc.version == 2:
            v2_enable_memory_for_children(loc.directory)
        path = os.path.join(loc.directory,
                            f"{self._label}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
        except OSError as e:
            raise CgroupError(f"cannot create cgroup {path}: {e}") from e
        self._files = CgroupFiles(path, loc.version)
        self._runner = CgroupRunner(self._files, self._cleanup_timeout_s)
        try:
            self._files.disable_swap()
            self._files.set_limit(self._initial_limit)
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
        return self._active_files().path

    @property
    def version(self) -> int:
        """1 or 2 (cgroup version of the memory controller)."""
        if self._location is None:
            raise CgroupError(_NOT_ACTIVE)
        return self._location.version

    def _active_files(self) -> CgroupFiles:
        if self._files is None:
            raise CgroupError(_NOT_ACTIVE)
        return self._files

    def _active_runner(self) -> CgroupRunner:
        if self._runner is None:
            raise CgroupError(_NOT_ACTIVE)
        return self._runner

    # -- limits and counters (CgroupFiles) ---------------------------------------------------

    def set_limit(self, limit_bytes: int) -> None:
        """Set the memory limit (bytes), also while processes run inside.

        See :meth:`CgroupFiles.set_limit` (v1 lowering below usage -> CgroupLimitBusyError).

        Raises:
            ConfigError: not a positive int.
            CgroupLimitBusyError: v1 EBUSY.
            CgroupError: any other write failure.
        """
        self._active_files().set_limit(limit_bytes)

    def limit_bytes(self) -> Optional[int]:
        """The limit in force (bytes; page-rounded by the kernel); None when v2 says ``max``."""
        return self._active_files().limit_bytes()

    def usage_bytes(self) -> int:
        """Current charged memory (bytes): v1 memory.usage_in_bytes, v2 memory.current."""
        return self._active_files().usage_bytes()

    def max_usage_bytes(self) -> Optional[int]:
        """Peak charged memory (bytes), see :meth:`CgroupFiles.max_usage_bytes`."""
        return self._active_files().max_usage_bytes()

    def reset_max_usage(self) -> None:
        """Reset the peak to the current usage (v1; a no-op on v2, see :class:`CgroupFiles`)."""
        self._active_files().reset_max_usage()

    def oom_kill_count(self) -> int:
        """Processes the OOM killer killed in this cgroup (the kernel's ``oom_kill`` count)."""
        return self._active_files().oom_kill_count()

    def pids(self) -> list[int]:
        """Pids of the processes now in the cgroup (cgroup.procs)."""
        return self._active_files().pids()

    # -- running commands (CgroupRunner) -----------------------------------------------------

    def popen(self, cmd: Command, env: Optional[Mapping[str, str]] = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside the cgroup and return its ``Popen`` (see
        :meth:`CgroupRunner.popen`); killed on exit of the ``with`` block if still running."""
        return self._active_runner().popen(cmd, env=env, **popen_kwargs)

    def run(self, cmd: Command, env: Optional[Mapping[str, str]] = None,
            timeout: Optional[float] = 600.0) -> CgroupRunResult:
        """Run ``cmd`` inside the cgroup to completion and report how it ended.

        ``timeout`` in seconds (> 0) or None; see :meth:`CgroupRunner.run`.

        Raises:
            ConfigError: bad ``timeout`` or empty ``cmd``.
            CgroupError: the child could not join the cgroup.
        """
        return self._active_runner().run(cmd, env=env, timeout=timeout)

    def kill_all(self, timeout_s: Optional[float] = None) -> bool:
        """SIGKILL every process in the cgroup and wait until it is empty.

        Returns:
            True when the cgroup is empty (or already gone), False at the timeout
            (``cleanup_timeout_s`` by default).
        """
        if self._runner is None:
            return True
        return self._runner.kill_all(timeout_s)

    # -- cleanup -----------------------------------------------------------------------------

    def close(self, raise_errors: bool = True) -> None:
        """Kill what is left in the cgroup, then remove it (idempotent).

        Every step is tried even when an earlier one failed. Our own ``Popen`` children are
        waited for and their pipes closed.

        Raises:
            CgroupError: the directory could not be removed within ``cleanup_timeout_s``
                (only with ``raise_errors``; otherwise logged).
        """
        files, runner = self._files, self._runner
        if files is None or runner is None:
            return
        path = files.path
        problems = []
        try:
            if not runner.kill_all():
                problems.append(f"processes still in cgroup: {runner.safe_pids()}")
        except Exception as e:  # keep going: the rmdir below must still be tried
            problems.append(f"kill failed: {e!r}")
        problems += runner.reap()
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
                runner.kill_all(timeout_s=0.5)
                time.sleep(0.05)
        if removed:
            self._files = self._runner = None
            logger.info("removed memory cgroup %s", path)
            return
        msg = f"could not remove cgroup {path}: " + "; ".join(problems)
        logger.error(msg)
        if raise_errors:
            raise CgroupError(msg)
