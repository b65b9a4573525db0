"""``memguard_testing.forkserver``, what the integration tests launch their single-process
training children with: a forked child behaves as ``subprocess.run([python, SCRIPT, ...])`` would
(arguments, environment, working folder, stdout / stderr, exit status, a signal, a timeout), each
child starts from the server's state (nothing a previous child did is seen), and the script's top
level runs once per server. A tiny script stands in for the training scripts: the server's job is
the same whatever the script imports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from memguard_testing import forkserver, script_env

# the tests that use the server are Linux's (RLIMIT_AS, glibc); so is os.waitid and /proc
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux: fork, os.waitid, /proc")

SCRIPT = textwrap.dedent("""
    import os, sys, time
    with open(os.environ["TOP_LEVEL_LOG"], "a") as f:   # one line per run of the top level
        f.write(f"{os.getpid()}\\n")
    STATE = []

    def main():
        STATE.append(sys.argv[1])
        print("args", sys.argv[1:], "X", os.environ.get("X"), "cwd", os.getcwd(), "state", STATE)
        print("to stderr", file=sys.stderr)
        what = sys.argv[1]
        if what == "exit3":
            sys.exit(3)
        if what == "raise":
            raise ValueError("boom")
        if what == "sleep":
            time.sleep(60)
        if what == "kill":
            os.kill(os.getpid(), 9)
        if what == "spawn":   # leaves a process running behind it
            import subprocess
            print("spawned", subprocess.Popen(["sleep", "60"]).pid)
        if what == "preloaded":
            print("preloaded", "preload_mod" in sys.modules)
        if what == "thread":   # a non-daemon thread still working when main returns
            import threading
            threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()

    if __name__ == "__main__":
        main()
""")


@pytest.fixture
def child(tmp_path):
    path = tmp_path / "child.py"
    path.write_text(SCRIPT)
    log = tmp_path / "top.log"
    # a module the server can preload: it logs each import, as the top level does
    (tmp_path / "preload_mod.py").write_text(
        "import os\nwith open(os.environ['PRELOAD_LOG'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    yield lambda *args, timeout=60, preload=(), **env: forkserver.run_script(
        str(path), *args, env=script_env(TOP_LEVEL_LOG=str(log), PRELOAD_LOG=str(tmp_path / "preload.log"), **env),
        cwd=str(tmp_path), timeout=timeout, preload=preload)
    forkserver.close_all()


def test_a_preloaded_module_is_imported_once_by_the_server(child, tmp_path):
    # the script's folder is on the server's sys.path (as `python SCRIPT` has it), so it finds the module
    assert "preloaded False" in child("preloaded").stdout
    for _ in range(2):
        assert "preloaded True" in child("preloaded", preload=("preload_mod",)).stdout
    assert len(forkserver._SERVERS) == 2                   # another preload, another server
    assert len((tmp_path / "preload.log").read_text().split()) == 1   # imported once, in that server


def test_a_child_runs_as_the_script_would(child, tmp_path):
    first = child("a", X="1")
    assert first.returncode == 0
    assert f"args ['a'] X 1 cwd {tmp_path} state ['a']" in first.stdout
    assert first.stderr.strip() == "to stderr"
    second = child("b", X="1")
    assert "state ['b']" in second.stdout   # a fresh copy of the server, not the first child's state
    pids = (tmp_path / "top.log").read_text().split()
    # the top level ran in the server (once) and in each child as __main__ (imports already loaded)
    assert len(pids) == 3 and len(set(pids)) == 3


def test_exit_status_exception_and_signal(child):
    assert child("exit3").returncode == 3
    raised = child("raise")
    assert raised.returncode == 1 and "ValueError: boom" in raised.stderr
    assert child("kill").returncode == -signal.SIGKILL


def test_another_environment_gets_another_server(child, tmp_path):
    assert "X 1" in child("a", X="1").stdout
    assert "X 2" in child("a", X="2").stdout
    assert "X 1" in child("a", X="1").stdout
    assert len(forkserver._SERVERS) == 2
    # each server ran the top level once; five runs in all
    assert len((tmp_path / "top.log").read_text().split()) == 5


def _ended(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie within 5 s (whoever adopted it may not reap it at once)."""
    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_what_a_child_leaves_running_is_killed_and_its_threads_are_joined(child):
    spawned = int(child("spawn").stdout.split("spawned ")[1].split()[0])
    assert _ended(spawned)   # killed with the child's process group (reaped or a zombie)
    assert "thread done" in child("thread").stdout   # as an interpreter's exit waits for it


def test_a_hung_child_is_killed_at_its_timeout_and_the_server_serves_on(child):
    with pytest.raises(subprocess.TimeoutExpired):
        child("sleep", timeout=3)
    assert child("a").returncode == 0


def test_the_server_is_gone_after_close_all(child):
    child("a")
    server = next(iter(forkserver._SERVERS.values()))
    forkserver.close_all()
    assert server.proc.poll() is not None and not forkserver._SERVERS
    with pytest.raises(ProcessLookupError):
        os.kill(server.proc.pid, 0)
