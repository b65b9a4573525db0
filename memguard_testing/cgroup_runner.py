"""Child processes inside one memory cgroup: start them in it, run one to completion, kill them all.

Part of the real-memory-limit harness (``memguard_testing.cgroup_harness``, docs/design.md,
"Real cgroup limits"). The child joins the cgroup itself before ``exec`` (so the command never
runs outside it); a run reports the exit status, the kernel's ``oom_kill`` count during the run
and the cgroup's peak usage.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from memguard_core.errors import ConfigError
from memguard_testing.cgroup_errors import CgroupError
from memguard_testing.cgroup_files import CgroupFiles

logger = logging.getLogger("memguard.integration.cgroup_harness")

__all__ = ["JOIN_FAILED_EXIT", "CgroupRunResult", "CgroupRunner", "Command"]

#: Exit status of the join wrapper when the child could not write its pid to cgroup.procs.
JOIN_FAILED_EXIT = 125
_JOIN_FAILED_MARKER = "memguard-cgroup-harness: could not join cgroup"
# The child joins the cgroup itself before exec: ``$$`` is the shell's pid, which ``exec`` keeps,
# so the command runs in the cgroup from its first instruction and never outside it.
_JOIN_SCRIPT = (
    'echo $$ > "$0" || { echo "' + _JOIN_FAILED_MARKER + ' $0" >&2; exit '
    + str(JOIN_FAILED_EXIT) + '; }; exec "$@"'
)
_KILLED_RETURNCODES = (-signal.SIGKILL, 128 + signal.SIGKILL)

Command = Union[Sequence[str], str]


@dataclass
class CgroupRunResult:
    """Outcome of :meth:`CgroupRunner.run` (``MemoryCgroup.run``).

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


class CgroupRunner:
    """Starts, runs and kills the processes of the cgroup whose files are ``files``.

    Args:
        files: the cgroup (its directory must exist while processes are started).
        cleanup_timeout_s: default seconds :meth:`kill_all` and :meth:`reap` wait.
    """

    def __init__(self, files: CgroupFiles, cleanup_timeout_s: float):
        self._files = files
        self._cleanup_timeout_s = cleanup_timeout_s
        self._procs: list[subprocess.Popen] = []

    def _wrap(self, cmd: Command) -> list[str]:
        if isinstance(cmd, str):
            argv = ["/bin/sh", "-c", cmd]
        else:
            argv = [str(a) for a in cmd]
        if not argv:
            raise ConfigError("cmd", "a non-empty argument list or shell string", cmd)
        return ["/bin/sh", "-c", _JOIN_SCRIPT, self._files.file("cgroup.procs"), *argv]

    def popen(self, cmd: Command, env: Optional[Mapping[str, str]] = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside the cgroup and return its ``Popen`` (for long-running children).

        The child is a tiny ``sh`` that writes its own pid to cgroup.procs and then ``exec``s
        ``cmd`` (same pid), so ``cmd`` runs inside the cgroup from its first instruction. If the
        join fails the command is never run and the child exits with ``JOIN_FAILED_EXIT`` (125)
        and a message on stderr. A ``str`` cmd runs under ``/bin/sh -c``; an OOM kill is then
        reported as 137 unless the shell execs the command itself. The process is killed by
        :meth:`kill_all` / waited for by :meth:`reap` if still running.

        Args:
            cmd: argument list, or a shell command string.
            env: environment for the child (default: inherited).
            **popen_kwargs: passed to ``subprocess.Popen`` (stdout, stderr, stdin, text, cwd...).

        Raises:
            ConfigError: empty ``cmd``.
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
        files = self._files
        files.reset_max_usage()
        ooms_before = files.oom_kill_count()
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
            raise CgroupError(f"child could not join {files.path}: {err.strip()}")
        ooms = files.oom_kill_count() - ooms_before
        return CgroupRunResult(
            returncode=rc,
            killed_by_oom=rc in _KILLED_RETURNCODES and ooms > 0 and not timed_out,
            oom_kills=ooms,
            max_usage_bytes=files.max_usage_bytes(),
            stdout=out,
            stderr=err,
            wall_s=wall,
            timed_out=timed_out,
        )

    def kill_all(self, timeout_s: Optional[float] = None) -> bool:
        """SIGKILL every process in the cgroup and wait until it is empty.

        Also reaps this runner's own children (a zombie still counts on some kernels).

        Returns:
            True when the cgroup is empty (or already gone), False at the timeout
            (``cleanup_timeout_s`` by default).
        """
        deadline = time.monotonic() + (self._cleanup_timeout_s if timeout_s is None
                                       else timeout_s)
        files = self._files
        if not os.path.isdir(files.path):
            return True
        if files.version == 2 and os.path.exists(files.file("cgroup.kill")):
            try:
                files.write("cgroup.kill", "1")
            except OSError as e:
                logger.info("cgroup.kill failed in %s: %s", files.path, e)
        while True:
            pids = self.safe_pids()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                except OSError as e:
                    logger.warning("cannot kill pid %d in %s: %s", pid, files.path, e)
            for p in self._procs:
                p.poll()  # reap our own children
            if not pids:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def safe_pids(self) -> list[int]:
        """Pids now in the cgroup; ``[]`` when cgroup.procs cannot be read (gone already)."""
        try:
            return self._files.pids()
        except (OSError, ValueError):
            return []

    def reap(self) -> list[str]:
        """Wait for this runner's own children (``cleanup_timeout_s`` each) and close their pipes.

        Returns:
            the problems met (a child not reaped), as messages; the children are forgotten.
        """
        problems = []
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
        return problems
