"""A real mlx_lm LoRA run (MLX CPU backend) killed with a real SIGKILL after its adapter save at
iteration 8, restarted the way ``memguard run`` restarts it: ``MEMGUARD_RESUME_FROM`` naming the
save its mlx rule finds (``memguard_core.resume.mlx_latest_adapter``). Nothing is faked: the child
is ``memguard_testing/scripts/mlx_resume_run.py`` (``memguard_mlx.train`` on the tiny run: 10
iterations, accumulation 2 = 5 updates, saves at 4 and 8, validation at 1, 5, 10), which hangs in
its training callback at the report of iteration 9 so the test can kill it at a known point; the
kill is the test's ``os.kill(pid, SIGKILL)`` (not a cgroup's OOM kill: the supervisor's detection
of that is tested with the supervisor).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from memguard_core.resume import RESUME_ENV, mlx_latest_adapter  # noqa: E402

from memguard_testing import script, script_env  # noqa: E402


def _env(**extra):
    env = script_env(OMP_NUM_THREADS="1", **extra)
    for name in ("MEMGUARD_MICRO_BATCHES", "MEMGUARD_LOG_DIR") + (() if RESUME_ENV in extra else (RESUME_ENV,)):
        env.pop(name, None)
    return env


def _start(out, *flags, **env):
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "child.log", "a")
    return subprocess.Popen([sys.executable, script("mlx_resume_run.py"), str(out), *flags], env=_env(**env),
                            stdout=log, stderr=subprocess.STDOUT)


def _reports(out):
    with open(out / "reports.jsonl") as f:
        return [json.loads(line) for line in f]


def _finish(p, out, timeout=240):
    rc = p.wait(timeout=timeout)
    assert rc == 0, (out / "child.log").read_text()[-3000:]
    return json.loads((out / "result.json").read_text())


def test_killed_mlx_run_resumes_after_its_last_save_without_repeating_updates(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_p = _start(ref_dir)
    p = _start(run_dir, "--hang-at", "9")
    ref_result = _finish(ref_p, ref_dir)
    ref = {(r["kind"], r["iteration"]): r for r in _reports(ref_dir)}

    # the first attempt: wait for iteration 9's report (after the save of 8), then SIGKILL it
    deadline = time.time() + 240
    while not (run_dir / "hanging").exists():
        assert p.poll() is None, (run_dir / "child.log").read_text()[-3000:]
        assert time.time() < deadline
        time.sleep(0.2)
    os.kill(p.pid, signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
    assert not (run_dir / "result.json").exists()
    first = _reports(run_dir)
    assert [r["iteration"] for r in first if r["kind"] == "train"] == list(range(1, 10))
    saved = mlx_latest_adapter(str(run_dir))
    assert os.path.basename(saved) == "0000008_adapters.safetensors"
    mtime8 = os.stat(saved).st_mtime_ns

    # the restart, as memguard run does it
    p = _start(run_dir, **{RESUME_ENV: saved})
    result = _finish(p, run_dir)
    second = _reports(run_dir)[len(first):]
    print("resumed reports:", [(r["kind"], r["iteration"]) for r in second], "result:", result)
    # it went on at 9: iterations 1-8 (4 updates, saved) not repeated, the save of 8 not rewritten
    assert [(r["kind"], r["iteration"]) for r in second] == [("train", 9), ("val", 9), ("train", 10)]
    assert os.stat(saved).st_mtime_ns == mtime8
    assert result["resumed_from"] == saved and result["iterations"] == 10 and result["updates"] == 1
    # the same number of updates as the uninterrupted run: 4 saved + 1 = 5, and the optimizer's step
    # (what the LR schedule is evaluated at) ends at 5 as there
    assert ref_result["optimizer_step"] == result["optimizer_step"] == 5 and ref_result["updates"] == 5
    # the batches of 9 and 10 are the uninterrupted run's (same tokens) and so are the weights they
    # met (iteration 9's loss is computed on the loaded save of 8, and 10 follows no update)
    for it in (9, 10):
        r, q = ref[("train", it)], next(x for x in second if x["kind"] == "train" and x["iteration"] == it)
        ref_tokens = r["trained_tokens"] - ref[("train", it - 1)]["trained_tokens"]
        prev = [x for x in second if x["kind"] == "train" and x["iteration"] < it]
        tokens = q["trained_tokens"] - (prev[-1]["trained_tokens"] if prev else 0)
        assert tokens == ref_tokens, it
        assert q["train_loss"] == pytest.approx(r["train_loss"], rel=1e-6), it
        # the reported learning rate: the schedule's value after update 4 (step set to 4)
        assert q["learning_rate"] == pytest.approx(r["learning_rate"], rel=1e-6), it
