"""``memguard run`` supervisor: exit classification, checkpoint discovery, the restart loop.

The restart loop runs real child processes. A real cgroup OOM kill is in
integration_tests/test_containers.py; here the memory failure is a real ``MemoryError`` escaping
a child (a path the supervisor also restarts on), and a real SIGKILL that the OOM killer did not
send. macOS / Windows exits are classified from their documented status values (this machine
cannot produce them).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from memguard_core.errors import ConfigError
from memguard_core.supervisor import (OomCounters, classify_exit, detect_output_dir, latest_checkpoint,
                                      main, supervise)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

C0 = OomCounters(cgroup=3, host=7)


@pytest.mark.parametrize("rc,before,after,tail,plat,expect,word", [
    (0, C0, C0, "", "linux", False, "normally"),
    (-9, C0, OomCounters(4, 7), "", "linux", True, "cgroup's oom_kill"),
    (137, C0, OomCounters(4, 7), "", "linux", True, "cgroup's oom_kill"),
    (-9, C0, OomCounters(3, 8), "", "linux", True, "host's oom_kill"),
    (-9, C0, C0, "", "linux", False, "someone else"),
    (-9, OomCounters(), OomCounters(), "", "linux", True, "assumed"),
    (1, C0, OomCounters(4, 8), "", "linux", False, "status 1"),  # not SIGKILL: not the OOM killer
    (-9, OomCounters(), OomCounters(), "", "darwin", True, "jetsam"),
    (-6, OomCounters(), OomCounters(), "[METAL] Command buffer execution failed: Insufficient Memory "
     "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)", "darwin", True, "Metal"),
    (-6, OomCounters(), OomCounters(), "assertion failed", "darwin", False, "status -6"),
    (0xC0000017, OomCounters(), OomCounters(), "", "win32", True, "0xc0000017"),
    (-1073741801, OomCounters(), OomCounters(), "", "win32", True, "0xc0000017"),  # same, signed
    (1, C0, C0, "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory.",
     "linux", True, "escaped"),
    (1, C0, C0, "Traceback (most recent call last):\nRuntimeError: DefaultCPUAllocator: can't allocate memory",
     "linux", True, "escaped"),
    (1, C0, C0, "Traceback (most recent call last):\nValueError: bad shape", "linux", False, "status 1"),
])
def test_classify_exit(rc, before, after, tail, plat, expect, word):
    got, reason = classify_exit(rc, before, after, stderr_tail=tail, platform=plat)
    assert got is expect and word in reason, reason


def test_latest_checkpoint_takes_the_largest_step_not_the_name_order(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    for n in (2, 10, 9):
        (tmp_path / f"checkpoint-{n}").mkdir()
    (tmp_path / "checkpoint-99").write_text("a file, not a checkpoint")
    (tmp_path / "checkpoint-x").mkdir()
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


@pytest.mark.parametrize("cmd,out", [
    (["python", "t.py", "--output-dir", "o1"], "o1"),
    (["python", "t.py", "--output_dir", "o2", "--x"], "o2"),
    (["python", "t.py", "--output-dir=o3"], "o3"),
    (["python", "t.py"], None),
])
def test_detect_output_dir(cmd, out):
    assert detect_output_dir(cmd) == out


# a child that fails with MemoryError on its first attempt and records what it was given
CHILD = r"""
import json, os, sys
out = sys.argv[1]
rec = {k: os.environ.get(k) for k in ("MEMGUARD_ATTEMPT", "MEMGUARD_MICRO_BATCHES", "MEMGUARD_RESUME_FROM")}
with open(os.path.join(out, "seen.jsonl"), "a") as f:
    f.write(json.dumps(rec) + "\n")
if int(rec["MEMGUARD_ATTEMPT"]) < int(sys.argv[2]):
    os.makedirs(os.path.join(out, "checkpoint-%d" % (3 * int(rec["MEMGUARD_ATTEMPT"]))), exist_ok=True)
    raise MemoryError("simulated allocation failure")
"""


def _seen(tmp_path):
    with open(tmp_path / "seen.jsonl") as f:
        return [json.loads(line) for line in f]


def test_restarts_with_doubled_split_and_latest_checkpoint(tmp_path):
    lines = []
    res = supervise([sys.executable, "-c", CHILD, str(tmp_path), "3", "--output-dir", str(tmp_path)],
                    env={k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")},
                    report=lines.append)
    assert res.returncode == 0 and res.restarts == 2 and not res.gave_up
    seen = _seen(tmp_path)
    assert [s["MEMGUARD_MICRO_BATCHES"] for s in seen] == [None, "2", "4"]
    assert [s["MEMGUARD_RESUME_FROM"] for s in seen] == [None, str(tmp_path / "checkpoint-3"),
                                                        str(tmp_path / "checkpoint-6")]
    assert [a.killed_for_memory for a in res.attempts] == [True, True, False]
    assert len([l for l in lines if "killed for memory" in l]) == 2
    assert "restart 2/3 with MEMGUARD_MICRO_BATCHES=4, resuming from" in lines[1]


def test_bounded_retries_then_gives_up_with_the_childs_status(tmp_path):
    lines = []
    res = supervise([sys.executable, "-c", CHILD, str(tmp_path), "99"], output_dir=str(tmp_path),
                    max_restarts=1, split=4, env=dict(os.environ), report=lines.append)
    assert res.gave_up and res.restarts == 1 and res.returncode == 1
    assert [s["MEMGUARD_MICRO_BATCHES"] for s in _seen(tmp_path)] == ["4", "8"]
    assert "no restart left" in lines[-1]


def test_a_sigkill_the_oom_killer_did_not_send_is_not_restarted(tmp_path):
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    res = supervise([sys.executable, "-c", code], report=lambda line: None)
    assert res.restarts == 0 and res.returncode == 128 + signal.SIGKILL
    assert not res.attempts[0].killed_for_memory  # this machine has readable OOM counters


def test_main_reports_json_and_returns_the_status(tmp_path, capsys):
    report = tmp_path / "r.json"
    code = main(["--report", str(report), "--", sys.executable, "-c", "import sys; sys.exit(5)"])
    assert code == 5
    assert json.loads(report.read_text())["attempts"][0]["returncode"] == 5


@pytest.mark.parametrize("argv,flag", [
    (["--max-restarts", "-1", "--", "true"], "--max-restarts"),
    (["--split", "0", "--", "true"], "--split"),
    (["--"], "command"),
    ([], "command"),
])
def test_main_bad_arguments_name_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert f"invalid {flag}" in capsys.readouterr().err


def test_supervise_validates():
    with pytest.raises(ConfigError) as e:
        supervise("python train.py")
    assert e.value.field == "command"
    with pytest.raises(ConfigError) as e:
        supervise(["true"], env={"MEMGUARD_MICRO_BATCHES": "two"})
    assert e.value.field == "MEMGUARD_MICRO_BATCHES"
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError) as e:
        supervise(["true"], env={"MEMGUARD_SPLIT": "two"})  # the deprecated name still read
    assert e.value.field == "MEMGUARD_SPLIT"


# a child that writes to the run's event log as a guarded run does (same run id in every attempt)
LOGGING_CHILD = r"""
import os, sys
from memguard_core.events import EventLog
log = EventLog(os.environ["MEMGUARD_LOG_DIR"])
attempt = int(os.environ["MEMGUARD_ATTEMPT"])
log.step(3 * attempt, peak_bytes=attempt << 30, budget_bytes=4 << 30, micro_batches=attempt)
if attempt < 2:
    os.makedirs(os.path.join(sys.argv[1], "checkpoint-3"), exist_ok=True)
    raise MemoryError("simulated allocation failure")
log.close()
"""


def test_restarts_are_appended_to_the_runs_event_log(tmp_path):
    from memguard_core.events import read_events

    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
    env.update(MEMGUARD_LOG_DIR=str(tmp_path / "log"), PYTHONPATH=ROOT)
    res = supervise([sys.executable, "-c", LOGGING_CHILD, str(tmp_path)], output_dir=str(tmp_path), env=env,
                    report=lambda line: None)
    assert res.returncode == 0 and res.restarts == 1
    files = os.listdir(tmp_path / "log")
    assert len(files) == 1  # both attempts and the supervisor wrote one file
    recs = read_events(str(tmp_path / "log" / files[0]))
    assert [(r["type"], r.get("kind")) for r in recs] == [
        ("start", None), ("step", None), ("decision", "restart"), ("start", None), ("step", None), ("end", None)]
    restart = recs[2]
    assert restart["step"] == 3 and restart["micro_batches"] == 2 and "killed for memory" in restart["message"]
