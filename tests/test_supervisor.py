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
    (1, C0, C0, "Traceback (most recent call last):\nRuntimeError: [metal::malloc] Attempting to allocate "
     "21474836480 bytes which is greater than the maximum allowed buffer size", "darwin", True, "escaped"),
    (1, C0, C0, "Traceback (most recent call last):\nRuntimeError: [malloc] Unable to allocate 1024 bytes.",
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


def _restarts(lines):
    """The supervisor's lines about attempts (without the allocator-setting line before them)."""
    return [line for line in lines if "PYTORCH_CUDA_ALLOC_CONF" not in line]


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
    assert "restart 2/3 with MEMGUARD_MICRO_BATCHES=4, resuming from" in _restarts(lines)[1]


def test_bounded_retries_then_gives_up_with_the_childs_status(tmp_path):
    lines = []
    res = supervise([sys.executable, "-c", CHILD, str(tmp_path), "99"], output_dir=str(tmp_path),
                    max_restarts=1, micro_batches=4, env=dict(os.environ), report=lines.append)
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
    (["--micro-batches", "0", "--", "true"], "--micro-batches"),
    (["--"], "command"),
    ([], "command"),
])
def test_main_bad_arguments_name_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert f"invalid {flag}" in capsys.readouterr().err


def test_the_flag_has_one_name(capsys):
    # --split, the flag's name before issue 32, is no longer taken
    with pytest.raises(SystemExit) as e:
        main(["--split", "2", "--", "true"])
    assert e.value.code == 2 and "unrecognized arguments: --split" in capsys.readouterr().err


def test_supervise_validates():
    with pytest.raises(ConfigError) as e:
        supervise("python train.py")
    assert e.value.field == "command"
    with pytest.raises(ConfigError) as e:
        supervise(["true"], env={"MEMGUARD_MICRO_BATCHES": "two"})
    assert e.value.field == "MEMGUARD_MICRO_BATCHES"
    with pytest.raises(ConfigError) as e:
        supervise(["true"], env={"MEMGUARD_MICRO_BATCHES": "0"})
    assert e.value.field == "MEMGUARD_MICRO_BATCHES"


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


# ------------------------------------------------------------------------------------------- resume rules
# Lightning checkpoints below are real torch.save archives (the format ModelCheckpoint writes);
# the rules only read names, file times and the archive's completeness.

from memguard_core import resume as R  # noqa: E402


def _ckpt(path, step, mtime=None):
    import torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"global_step": step, "state_dict": {"w": torch.zeros(2)}}, str(path))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return str(path)


@pytest.mark.parametrize("path,step", [
    ("out/checkpoint-12", 12), ("out/checkpoint-12/", 12), ("out/checkpoint-x", None),
    ("ck/epoch=0-step=7.ckpt", 7), ("ck/step=31-v1.ckpt", 31), ("ck/epoch=1-step=40-val_loss=0.12.ckpt", 40),
    ("ck/last.ckpt", None), ("ck/laststep=5.ckpt", None), ("ck/mystep=5.ckpt", None), ("ck/epoch=3.ckpt", None),
    ("ad/0000200_adapters.safetensors", 200), ("ad/adapters.safetensors", None), (None, None), ("", None),
])
def test_checkpoint_step_reads_the_name(path, step):
    assert R.checkpoint_step(path) == step


def test_checkpoint_step_rejects_a_non_path():
    with pytest.raises(ConfigError) as e:
        R.checkpoint_step(12)
    assert e.value.field == "path"


def test_lightning_last_ckpt_wins_over_newer_step_files(tmp_path):
    d = tmp_path / "checkpoints"
    _ckpt(d / "epoch=0-step=3.ckpt", 3, mtime=1000)
    last = _ckpt(d / "last.ckpt", 3, mtime=1001)
    _ckpt(d / "epoch=0-step=9.ckpt", 9, mtime=2000)  # newer and larger, but ckpt_path="last" takes last*
    assert R.lightning_latest_checkpoint(str(tmp_path)) == last


def test_lightning_newest_of_several_last_files(tmp_path):
    # save_last with the version counter writes last-v1.ckpt next to an old last.ckpt
    d = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    _ckpt(d / "last.ckpt", 2, mtime=1000)
    newer = _ckpt(d / "last-v1.ckpt", 4, mtime=1500)
    assert R.lightning_latest_checkpoint(str(tmp_path)) == newer


def test_lightning_without_last_takes_the_largest_step_not_the_newest(tmp_path):
    d = tmp_path / "ck"
    _ckpt(d / "epoch=0-step=9.ckpt", 9, mtime=1000)
    _ckpt(d / "epoch=0-step=10.ckpt", 10, mtime=900)  # numeric, not name or time order
    _ckpt(d / "epoch=0-step=2.ckpt", 2, mtime=3000)
    _ckpt(d / "best.ckpt", 0, mtime=4000)  # no step in the name: only when nothing else is there
    assert R.lightning_latest_checkpoint(str(d)) == str(d / "epoch=0-step=10.ckpt")
    os.remove(d / "epoch=0-step=9.ckpt"), os.remove(d / "epoch=0-step=10.ckpt"), os.remove(d / "epoch=0-step=2.ckpt")
    assert R.lightning_latest_checkpoint(str(d)) == str(d / "best.ckpt")


def test_lightning_searches_the_logger_version_folders(tmp_path):
    # the killed attempt wrote version_0, the restarted one version_1 (a new logger version per run)
    _ckpt(tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=4.ckpt", 4)
    _ckpt(tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=0-step=6.ckpt", 6)
    _ckpt(tmp_path / "elsewhere" / "deep" / "er" / "checkpoints" / "epoch=0-step=99.ckpt", 99)  # not where Lightning writes
    assert R.lightning_latest_checkpoint(str(tmp_path)) == str(
        tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=0-step=6.ckpt")


def test_lightning_passes_over_a_save_cut_short(tmp_path, caplog):
    d = tmp_path / "checkpoints"
    good = _ckpt(d / "epoch=0-step=3.ckpt", 3)
    full = open(_ckpt(d / "epoch=0-step=4.ckpt", 4), "rb").read()
    with open(d / "epoch=0-step=4.ckpt", "wb") as f:
        f.write(full[:len(full) // 2])  # the kill came while it was written
    assert R.lightning_latest_checkpoint(str(tmp_path)) == good
    assert "not a complete checkpoint archive" in caplog.text


def test_finders_on_empty_missing_and_unrelated_dirs(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "adapters.safetensors").write_bytes(b"x")
    (tmp_path / "notes.ckpt.txt").write_text("x")
    (tmp_path / "checkpoint-3").write_text("a file, not a checkpoint")
    for root in (str(tmp_path), str(tmp_path / "missing"), None):
        assert R.hf_latest_checkpoint(root) is None
        assert R.lightning_latest_checkpoint(root) is None
        assert R.mlx_latest_adapter(root) is None


def test_mlx_takes_the_largest_numbered_adapter_file(tmp_path):
    for n in (100, 300, 200):
        (tmp_path / f"{n:07d}_adapters.safetensors").write_bytes(b"x")
    (tmp_path / "adapters.safetensors").write_bytes(b"x")  # the final/latest save: no iteration in it
    (tmp_path / "0000999_adapters.safetensors.tmp").write_bytes(b"x")
    (tmp_path / "0000400_adapters.safetensors").mkdir()
    assert R.mlx_latest_adapter(str(tmp_path)) == str(tmp_path / "0000300_adapters.safetensors")
    (tmp_path / "12000000_adapters.safetensors").write_bytes(b"x")  # past 7 digits: the number decides
    assert R.mlx_latest_adapter(str(tmp_path)) == str(tmp_path / "12000000_adapters.safetensors")


@pytest.mark.parametrize("cmd,fw,out", [
    (["python", "t.py", "--output-dir", "o"], "hf", "o"),
    (["python", "t.py", "--default_root_dir", "r", "--output-dir", "o"], "lightning", "r"),
    (["python", "t.py", "--default-root-dir=r", "--ckpt-dir", "c"], "lightning", "c"),
    (["python", "-m", "pkg.cli", "fit", "--trainer.default_root_dir", "r"], "lightning", "r"),
    (["python", "t.py", "--output_dir", "o"], "lightning", "o"),
    (["python", "-m", "mlx_lm.lora", "--adapter-path", "a"], "mlx", "a"),
    (["python", "-m", "mlx_lm", "lora", "--train"], "mlx", "adapters"),  # mlx_lm.lora's default
    (["python", "t.py", "--output-dir", "o"], "mlx", "o"),
    (["python", "t.py"], "lightning", None),
])
def test_detect_checkpoint_dir_per_framework(cmd, fw, out):
    assert R.detect_checkpoint_dir(cmd, fw) == out
    assert detect_output_dir(cmd, fw) == out


@pytest.mark.parametrize("cmd,fw", [
    (["python", "t.py", "--output-dir", "o"], "hf"),
    (["python", "t.py", "--default_root_dir", "r"], "lightning"),
    (["python", "t.py", "--ckpt-dir=c", "--output-dir", "o"], "lightning"),
    (["python", "-m", "mlx_lm.lora", "--train"], "mlx"),
    (["python", "t.py", "--adapter_path", "a"], "mlx"),
    (["python", "t.py"], None),
])
def test_command_framework(cmd, fw):
    assert R.command_framework(cmd) == fw


def test_find_resume_checkpoint_auto_and_forced(tmp_path):
    root = tmp_path / "root"
    ck = _ckpt(root / "checkpoints" / "epoch=0-step=5.ckpt", 5)
    lcmd = ["python", "t.py", "--default_root_dir", str(root)]
    assert R.find_resume_checkpoint(lcmd) == (ck, "lightning", str(root))
    assert R.find_resume_checkpoint(lcmd, "hf") == (None, "hf", None)  # no --output-dir in the command
    # a generic --output-dir: the hf rule finds nothing there, the lightning one does
    gcmd = ["python", "t.py", "--output-dir", str(root)]
    assert R.find_resume_checkpoint(gcmd) == (ck, "lightning", str(root))
    ad = tmp_path / "ad"
    ad.mkdir()
    (ad / "0000020_adapters.safetensors").write_bytes(b"x")
    mcmd = ["python", "-m", "mlx_lm.lora", "--adapter-path", str(ad)]
    assert R.find_resume_checkpoint(mcmd) == (str(ad / "0000020_adapters.safetensors"), "mlx", str(ad))
    # the supervisor's --output-dir overrides the command's flags
    assert R.find_resume_checkpoint(["python", "t.py"], "auto", str(ad))[:2] == (
        str(ad / "0000020_adapters.safetensors"), "mlx")
    # nothing saved yet: no path, the command's framework and the directory searched
    empty = tmp_path / "empty"
    empty.mkdir()
    assert R.find_resume_checkpoint(["python", "t.py", "--ckpt-dir", str(empty)]) == (None, "lightning", str(empty))
    assert R.find_resume_checkpoint(["python", "t.py"]) == (None, None, None)
    with pytest.raises(ConfigError) as e:
        R.find_resume_checkpoint(lcmd, "keras")
    assert e.value.field == "framework"


def test_resume_from_env_takes_only_the_frameworks_kind(tmp_path, caplog):
    import memguard_hf
    import memguard_lightning

    ck = _ckpt(tmp_path / "last.ckpt", 1)
    hf_dir = tmp_path / "checkpoint-4"
    hf_dir.mkdir()
    ad = tmp_path / "0000010_adapters.safetensors"
    ad.write_bytes(b"x")
    env = {R.RESUME_ENV: ck}
    assert R.resume_from_env("lightning", env=env) == ck
    assert R.resume_from_env("hf", "d", env={R.RESUME_ENV: str(hf_dir)}) == str(hf_dir)
    assert R.resume_from_env("mlx", env={R.RESUME_ENV: str(ad)}) == str(ad)
    assert R.resume_from_env("lightning", "last", env={}) == "last"
    assert R.resume_from_env("lightning", "last", env={R.RESUME_ENV: str(hf_dir)}) == "last"  # another kind
    assert R.resume_from_env("mlx", None, env={R.RESUME_ENV: str(tmp_path / "gone.safetensors")}) is None
    assert "not resuming from it" in caplog.text
    with pytest.raises(ConfigError):
        R.resume_from_env("auto")
    # the adapters' entry points read the real environment
    os.environ[R.RESUME_ENV] = ck
    try:
        assert memguard_lightning.resume_checkpoint() == ck
        assert memguard_hf.resume_checkpoint("mine") == "mine"  # a .ckpt file is not an HF checkpoint
        os.environ[R.RESUME_ENV] = str(hf_dir)
        assert memguard_hf.resume_checkpoint() == str(hf_dir)
        assert memguard_lightning.resume_checkpoint() is None
    finally:
        del os.environ[R.RESUME_ENV]


# children that save a checkpoint the way each framework names it, then fail for memory
LIGHTNING_CHILD = r"""
import json, os, sys, torch
root = sys.argv[1]
attempt = int(os.environ["MEMGUARD_ATTEMPT"])
with open(os.path.join(root, "seen.jsonl"), "a") as f:
    f.write(json.dumps({k: os.environ.get(k) for k in ("MEMGUARD_MICRO_BATCHES", "MEMGUARD_RESUME_FROM")}) + "\n")
if attempt < 3:
    d = os.path.join(root, "lightning_logs", "version_%d" % (attempt - 1), "checkpoints")
    os.makedirs(d, exist_ok=True)
    torch.save({"global_step": 2 * attempt}, os.path.join(d, "epoch=0-step=%d.ckpt" % (2 * attempt)))
    raise MemoryError("simulated allocation failure")
"""

MLX_CHILD = r"""
import json, os, sys
ad = sys.argv[sys.argv.index("--adapter-path") + 1]
os.makedirs(ad, exist_ok=True)
with open(os.path.join(ad, "seen.jsonl"), "a") as f:
    f.write(json.dumps({k: os.environ.get(k) for k in ("MEMGUARD_MICRO_BATCHES", "MEMGUARD_RESUME_FROM")}) + "\n")
if os.environ["MEMGUARD_ATTEMPT"] == "1":
    for it in (10, 20):
        open(os.path.join(ad, "%07d_adapters.safetensors" % it), "wb").close()
    raise MemoryError("simulated allocation failure")
"""


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
    env["PYTHONPATH"] = ROOT
    return env


def test_restarts_a_lightning_run_from_its_latest_ckpt(tmp_path):
    lines = []
    res = supervise([sys.executable, "-c", LIGHTNING_CHILD, str(tmp_path), "--default_root_dir", str(tmp_path)],
                    env=_clean_env(), report=lines.append)
    assert res.returncode == 0 and res.restarts == 2, lines
    seen = _seen(tmp_path)
    ck = lambda v, s: str(tmp_path / "lightning_logs" / f"version_{v}" / "checkpoints" / f"epoch=0-step={s}.ckpt")
    assert [s["MEMGUARD_RESUME_FROM"] for s in seen] == [None, ck(0, 2), ck(1, 4)]
    assert [s["MEMGUARD_MICRO_BATCHES"] for s in seen] == [None, "2", "4"]
    assert [a.resume_framework for a in res.attempts] == ["lightning", "lightning", None]
    assert "resuming from" in _restarts(lines)[0] and "(lightning)" in _restarts(lines)[0]


def test_restarts_an_mlx_run_from_its_latest_adapter_file(tmp_path):
    ad = tmp_path / "ad"
    lines = []
    res = supervise([sys.executable, "-c", MLX_CHILD, "--adapter-path", str(ad)], env=_clean_env(),
                    report=lines.append)
    assert res.returncode == 0 and res.restarts == 1
    assert [s["MEMGUARD_RESUME_FROM"] for s in _seen(ad)] == [None, str(ad / "0000020_adapters.safetensors")]


def test_no_checkpoint_is_reported_with_the_directory_searched(tmp_path):
    lines = []
    child = "import os, sys\nif os.environ['MEMGUARD_ATTEMPT'] == '1': raise MemoryError('x')"
    res = supervise([sys.executable, "-c", child, "--ckpt-dir", str(tmp_path)], env=_clean_env(),
                    report=lines.append)
    assert res.returncode == 0 and res.attempts[1].resume_from is None
    assert f"no lightning checkpoint found in {tmp_path}: restarting from step 0" in _restarts(lines)[0]
    lines.clear()
    res = supervise([sys.executable, "-c", child], env=_clean_env(), report=lines.append)
    assert res.returncode == 0 and res.attempts[1].resume_from is None
    assert "no checkpoint found (no --output-dir / --default_root_dir / --ckpt-dir / --adapter-path given" in \
        _restarts(lines)[0]


@pytest.mark.parametrize("argv,flag", [
    (["--framework", "keras", "--", "true"], "--framework"),
    (["--framework", "", "--", "true"], "--framework"),
    (["--output-dir", os.path.abspath(__file__), "--", "true"], "--output-dir"),
])
def test_main_bad_resume_arguments_name_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert f"invalid {flag}" in capsys.readouterr().err


def test_help_names_the_frameworks_and_the_env_contract(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--framework {auto,hf,lightning,mlx}" in out
    assert "memguard_lightning.resume_checkpoint()" in out and "NNNNNNN_adapters.safetensors" in out


def test_lightning_rule_agrees_with_fit_ckpt_path_last(tmp_path):
    """Real Lightning checkpoints of a tiny fit: the rule picks what ``trainer.fit(ckpt_path="last")``
    resolves to (``trainer.ckpt_path``) where Lightning can see it, and still finds the checkpoint
    where Lightning cannot: a restarted trainer whose logger gives it a new, empty version folder."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)

    def trainer(root, logger):
        return pl.Trainer(max_steps=3, default_root_dir=str(root), logger=logger, accelerator="cpu",
                          callbacks=[ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=True)],
                          enable_progress_bar=False, enable_model_summary=False)

    root = tmp_path / "nolog"
    trainer(root, False).fit(Tiny(), data)
    again = trainer(root, False)
    again.fit(Tiny(), data, ckpt_path="last")  # restores step 3 = max_steps: nothing left to train
    assert again.ckpt_path == R.lightning_latest_checkpoint(str(root)) == str(root / "checkpoints" / "last.ckpt")
    assert R.checkpoint_step(R.lightning_latest_checkpoint(str(root / "checkpoints"))) is None  # last: no step
    os.remove(root / "checkpoints" / "last.ckpt")  # save_last off: the largest step=N, where "last" finds none
    assert R.lightning_latest_checkpoint(str(root)) == str(root / "checkpoints" / "epoch=0-step=3.ckpt")

    root = tmp_path / "csv"
    trainer(root, CSVLogger(str(root))).fit(Tiny(), data)
    assert R.lightning_latest_checkpoint(str(root)) == str(
        root / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt")
    restarted = trainer(root, CSVLogger(str(root)))
    with pytest.warns(UserWarning, match="no last checkpoint"):
        restarted.fit(Tiny(), data, ckpt_path="last")  # looks only in the new version_1/checkpoints
    assert restarted.ckpt_path is None  # and so it trained steps 1-3 again
    assert sorted(os.listdir(root / "lightning_logs" / "version_1" / "checkpoints")) == [
        "epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=3.ckpt", "last.ckpt"]


# ---------------------------------------------------------------- the child's allocator setting

def test_child_alloc_conf_sets_expandable_segments_unless_the_user_named_a_setting():
    from memguard_core.supervisor import child_alloc_conf

    env = {"PATH": "/usr/bin"}
    line = child_alloc_conf(env, platform="linux")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert line.startswith("memguard run: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") and "\n" not in line
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        for value in ("max_split_size_mb:128", "expandable_segments:False", ""):
            env = {name: value}
            assert child_alloc_conf(env, platform="linux") is None and env == {name: value}
    for plat in ("darwin", "win32"):      # no expandable segments in torch's allocator there
        env = {}
        assert child_alloc_conf(env, platform=plat) is None and env == {}


ENV_CHILD = r"""
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump({k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}, f)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="set on Linux only")
def test_memguard_run_gives_the_child_expandable_segments_and_says_so_once(tmp_path, capsys, monkeypatch):
    seen = tmp_path / "env.json"
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert main(["--", sys.executable, "-c", ENV_CHILD, str(seen)]) == 0
    assert json.loads(seen.read_text()) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                            "PYTORCH_ALLOC_CONF": None}
    err = [line for line in capsys.readouterr().err.splitlines() if "PYTORCH_CUDA_ALLOC_CONF" in line]
    assert len(err) == 1 and "expandable_segments:True" in err[0]
    # the user's own setting, under the newer name: left alone, nothing said
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128")
    assert main(["--", sys.executable, "-c", ENV_CHILD, str(seen)]) == 0
    assert json.loads(seen.read_text()) == {"PYTORCH_CUDA_ALLOC_CONF": None, "PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in capsys.readouterr().err
