"""Single-process child runs of a test script, forked from a server that has already imported
what the script imports: :func:`run_script` is ``subprocess.run([python, SCRIPT, *ARGS])`` without
the framework imports each new interpreter pays (``import torch`` about 3 s of CPU on a small
machine, ``from transformers import Trainer`` about 9 s, ``import lightning.pytorch`` about 8 s;
the tests start dozens of such children).

    python -m memguard_testing.forkserver SCRIPT [MODULE ...]   (started by run_script; one request per line)

The server imports the ``preload`` modules, if any, and runs the script's top level once (its
imports and definitions, not its ``__main__`` block), then forks one child per request; the child runs the script as ``__main__`` with the
request's arguments, its stdout and stderr going to files the caller reads back. It is the same
arrangement as :mod:`memguard_testing.torchrun` for the multi-process runs, with the same rules:

- Nothing runs a parallel region before the fork (importing torch starts no OpenMP threads).
- What a library reads when it loads (``OMP_NUM_THREADS``, ``MALLOC_ARENA_MAX``, ``PYTHONPATH``)
  is the server's environment, so a server serves one environment: a request with a different
  one (``PYTEST_*`` aside) gets a server of its own.
- A child's address space and resident set start with what the server mapped and touched before
  the fork, much as a fresh interpreter's after the same imports but not byte for byte (measured:
  ~8 MiB less address space at the model's build), so an address-space limit a script sets on
  itself (``RLIMIT_AS``) is placed for children started this way: from a reference run launched
  the same way, or, where a test hard-codes one, found again (docs/ci_time.md).
- A child's exit is an interpreter's: non-daemon threads joined, then the ``atexit`` handlers,
  those the script's imports registered in the server included (they run in every child and in
  the server). What the top level prints goes to the server's stderr, once.
- The caller gets the child's status when the child exits; whatever it started and left running
  is killed then (its process group), as a timeout kills the child and its group.

A pytest worker keeps one server per script and environment until the test file ends
(``conftest.py`` calls :func:`close_all`); a server also ends when its stdin closes, so it never
outlives the worker.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Dict, Optional, Sequence, Tuple

#: Environment variables that differ between the tests of one worker and that nothing reads at
#: import (memguard reads its data dir when it records; conftest.py gives each test its own).
_PER_TEST = ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_TESTRUNUID", "MEMGUARD_DATA_DIR")
#: How long a server may take to import the script's top level (torch, transformers, Lightning) on
#: a loaded machine, seconds; not part of a run's timeout.
_START_TIMEOUT_S = 600


def _child(script: str, request: dict, reply_fd: int) -> None:
    """The forked child: the request's stdio, environment, working folder and ``argv``, then the
    script as ``__main__``; exits with the script's status (1 on an uncaught exception, printed),
    after what an interpreter's exit runs (non-daemon threads joined, the ``atexit`` handlers).
    Never returns."""
    status = 1
    try:
        os.setpgid(0, 0)   # its own process group (the server sets it too: whichever runs first)
        os.close(reply_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(out, fd)
            os.close(out)
        os.environ.clear()
        os.environ.update(request["env"])
        if request.get("cwd"):
            os.chdir(request["cwd"])
        sys.argv = [script, *request["args"]]
        status = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                status = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        threading._shutdown()   # as Py_FinalizeEx: wait for the non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(status)


def serve(script: str, preload: Sequence[str] = ()) -> None:
    """The server: the ``preload`` modules and the script's top level, ``ready`` on stdout, then per
    request line (JSON:
    ``args``, ``env``, ``cwd``, ``stdout``, ``stderr`` paths) a forked child, its pid and then its
    exit code (negative: the signal that ended it) written back as JSON lines."""
    script = os.path.abspath(script)
    # replies go on their own descriptor; what the server itself prints goes to its stderr
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    reply = os.fdopen(reply_fd, "w")
    sys.path.insert(0, os.path.dirname(script))   # as `python SCRIPT` puts the script's folder first
    sys.argv = [script]
    for name in preload:   # what a script that imports its framework inside a function will use
        importlib.import_module(name)
    runpy.run_path(script, run_name="__memguard_forkserver__")   # its imports and definitions only
    reply.write("ready\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(script, request, reply_fd)
        try:   # here as in the child, so the group exists before the caller can signal it
            os.setpgid(pid, pid)
        except OSError:   # the child set it already and exec'd / exited (EACCES, ESRCH)
            pass
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        # wait for the exit without reaping: the zombie keeps its pid and group id, so the kill of
        # what it started and left running cannot reach a process that took them over
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


def _kill_group(pid: int) -> None:
    """SIGKILL to process group ``pid`` (a child's not yet reaped), and to ``pid`` itself if the
    group is not there (the child had not set it yet)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class _Server:
    """One server process for ``script`` in ``env``."""

    def __init__(self, script: str, env: Dict[str, str], preload: Sequence[str] = ()):
        self.script = script
        self._err = tempfile.TemporaryFile()   # a file, not a pipe: warnings at import cannot fill it
        self.proc = subprocess.Popen([sys.executable, "-m", "memguard_testing.forkserver", script, *preload], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                     bufsize=0, start_new_session=True)
        self.ready = False
        self._buffer = b""

    def _line(self, deadline: Optional[float]) -> Optional[str]:
        """The server's next reply line; None when ``deadline`` (``time.monotonic``) passed first."""
        # read from the pipe's descriptor, not a buffered reader: select() sees only the descriptor,
        # so a second line already in a reader's buffer would look like no reply
        while b"\n" not in self._buffer:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], timeout)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                self.proc.wait()
                self._err.seek(0)
                err = self._err.read().decode(errors="replace")
                raise RuntimeError(f"the fork server for {self.script} ended: {err[-3000:]}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode() + "\n"

    def run(self, args: Sequence[str], env: Dict[str, str], cwd: Optional[str],
            timeout: Optional[float]) -> Tuple[Optional[int], str, str]:
        """(exit code or None after ``timeout`` s, stdout, stderr) of one child. The server's own
        start (its imports) does not count against ``timeout``."""
        if not self.ready:
            if self._line(time.monotonic() + _START_TIMEOUT_S) != "ready\n":
                raise RuntimeError(f"the fork server for {self.script} did not start in {_START_TIMEOUT_S} s")
            self.ready = True
        deadline = None if timeout is None else time.monotonic() + timeout
        with tempfile.TemporaryDirectory(prefix="memguard_fork_") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            self.proc.stdin.write(json.dumps({"args": list(args), "env": env, "cwd": cwd,
                                              "stdout": out, "stderr": err}).encode() + b"\n")
            pid = json.loads(self._line(None))["pid"]
            rc, done = None, False
            try:
                line = self._line(deadline)
                if line is None:   # a hang: the child and what it started are killed, the server reaps it
                    _kill_group(pid)
                    self._line(None)
                else:
                    rc = json.loads(line)["rc"]
                done = True
            finally:
                if not done:   # interrupted (Ctrl-C, a test timeout) or the server died: no orphan left
                    _kill_group(pid)
            read = lambda p: open(p, errors="replace").read() if os.path.exists(p) else ""   # noqa: E731
            return rc, read(out), read(err)

    def close(self) -> None:
        """Ends the server. Killed, not let exit: it holds nothing to save, its children have all
        been reaped, and an interpreter holding torch and Lightning takes seconds to finalize."""
        try:
            self.proc.stdin.close()
            self.proc.kill()
            self.proc.wait()
        finally:
            self.proc.stdout.close()
            self._err.close()


_SERVERS: Dict[str, _Server] = {}


def close_all() -> None:
    """End every server this process started (conftest.py calls it after each test file)."""
    while _SERVERS:
        _SERVERS.popitem()[1].close()


atexit.register(close_all)


def run_script(script: str, *args: str, env: Dict[str, str], cwd: Optional[str] = None,
               timeout: Optional[float] = 600, preload: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)``, the child forked from a server that already imported the
    script's top level (module docstring); one server per script, environment (the variables in
    ``_PER_TEST`` aside) and ``preload``, kept until :func:`close_all`. ``preload``: modules the
    server imports first, for a script that imports its framework inside a function (never one
    that starts threads a child would need: a fork keeps only the forking thread; MLX's CPU stream
    runs on one). ``env`` needs this repository on
    ``PYTHONPATH`` (``memguard_testing.script_env``). Returns a ``CompletedProcess``
    (``returncode`` negative for a signal). Raises ``subprocess.TimeoutExpired`` after ``timeout``
    seconds (the child and its process group killed), ``RuntimeError`` when the server could not
    start or ended."""
    script = os.path.abspath(script)
    server_env = {k: v for k, v in env.items() if k not in _PER_TEST}
    key = json.dumps([script, sorted(server_env.items()), list(preload)])
    if key not in _SERVERS:
        _SERVERS[key] = _Server(script, server_env, preload)
    try:
        rc, out, err = _SERVERS[key].run(args, dict(env), cwd, timeout)
    except BaseException:   # a server whose replies are out of step is not used again
        _SERVERS.pop(key).close()
        raise
    argv = [sys.executable, script, *args]
    if rc is None:
        raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err)
    return subprocess.CompletedProcess(argv, rc, out, err)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
