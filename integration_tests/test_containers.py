"""Container scenarios: real HF ``Trainer`` fine-tunes on CPU inside real memory cgroups.

Each scenario runs ``container_train.py`` (a Llama-architecture model from config numbers, random
weights; fp32 logits of 16 x 256 x 16384 dominate the peak) as a subprocess inside a child cgroup
of this test (``cgroup_harness.MemoryCgroup``: a real v1/v2 limit, no swap), once unguarded and
once guarded, and asserts that the unguarded twin was really killed by the kernel's OOM killer
(SIGKILL AND the cgroup's oom_kill count up, no ``result.json``) while the guarded run really
completed (exit 0, every optimizer step done, the effective batch kept).

Measured on this machine (2 cores, cgroup v1, no swap), micro-batch 16 x 256 tokens: unsplit it
is OOM-killed at a 1100 MiB limit; split in k >= 2 row-chunks it completes there (cgroup peak
~655-765 MiB with the preflight's plan). The runtime co-tenant leaves 1100 MiB of a 2400 MiB limit.
Each scenario file run prints its figures (``pytest -s``).

Skipped, with the reason, where child memory cgroups cannot be created.
"""

from __future__ import annotations

import json
import os
import sys
import time

from memguard_testing import script
from memguard_testing.train_scripts import child_env, read_result, start_cotenant, start_trainer, wait_for

MiB = 1 << 20
TRAIN = script("container_train.py")

RT = ["--batch-size", "16", "--grad-accum", "1", "--seq-len", "256", "--layers", "2"]
PREFLIGHT_LIMIT = 1100 * MiB    # 16 x 256: k=1 is killed below ~1.3 GiB; k=2 needs ~0.87 GiB
RUNTIME_LIMIT = 2400 * MiB      # 16 x 256 at k=1 fits with room to spare
RUNTIME_ROOM_LEFT = 1100 * MiB  # what the co-tenant leaves: 16 x 256 at k=1 needs more, k=2 less
SUPERVISOR_LIMIT = 1100 * MiB   # 16 x 32-token steps fit; a 16 x 256-token step at k=1 does not


def _steps_log(out_dir):
    path = os.path.join(out_dir, "steps.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(int(x) for x in line.split()) for line in f if line.strip()]


def _report(name, **figures):
    """Print the measured figures (pytest -s shows them; the README quotes them)."""
    print(f"\n[{name}] " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def _assert_oom_killed(res, out_dir):
    assert res.returncode in (-9, 137), (res.returncode, res.stderr[-2000:])
    assert res.oom_kills >= 1 and res.killed_by_oom, res
    assert read_result(out_dir) is None  # train() never returned


def _assert_completed(res, out_dir, steps):
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.oom_kills == 0
    r = read_result(out_dir)
    assert r is not None and r["completed"] and r["global_step"] == steps
    g = r["guard"]
    # the effective batch is kept: every optimizer step ran all 16 rows, in smaller forwards
    assert g["samples_per_step"] == [16] * steps
    return r


def test_preflight_fits_the_run_to_the_container_limit(memory_cgroup, tmp_path):
    steps = 3
    limit = PREFLIGHT_LIMIT
    cg = memory_cgroup(limit, name="preflight-unguarded")
    out_u = str(tmp_path / "unguarded")
    res_u = cg.run([sys.executable, TRAIN, "--output-dir", out_u, "--steps", str(steps), *RT],
                   env=child_env(), timeout=300)
    _assert_oom_killed(res_u, out_u)
    assert _steps_log(out_u) == []  # died in its first step

    cg = memory_cgroup(limit, name="preflight-guarded")
    out_g = str(tmp_path / "guarded")
    res_g = cg.run([sys.executable, TRAIN, "--output-dir", out_g, "--steps", str(steps), "--guard", *RT],
                   env=child_env(), timeout=300)
    r = _assert_completed(res_g, out_g, steps)
    g = r["guard"]
    assert g["preflight_micro_batches"] >= 2 and g["max_forward_rows"] <= 8, g
    assert g["budget_bytes"] < limit  # the default budget came from the container, not the host
    assert res_g.max_usage_bytes < limit
    _report("preflight", limit_mib=limit // MiB,
            unguarded=f"rc={res_u.returncode} oom_kills={res_u.oom_kills} after {res_u.wall_s:.1f}s",
            guarded=f"rc=0 split={g['micro_batches']} preflight_micro_batches={g['preflight_micro_batches']} "
                    f"changes={g['preflight_changes']} steps={r['global_step']}",
            guarded_cgroup_peak_mib=round(res_g.max_usage_bytes / MiB),
            guarded_step_peak_mib=round((g["summary"]["measured_peak_bytes"] or 0) / MiB),
            budget_mib=round(g["budget_bytes"] / MiB), wall_s=round(res_u.wall_s + res_g.wall_s, 1))


def _run_with_cotenant(cg, out_dir, guard, steps, pause_at, take_bytes):
    """Start the trainer in ``cg``; when it has finished ``pause_at`` steps (it then waits for the
    go file), start a co-tenant in the same cgroup that takes ``take_bytes`` and holds them, then
    let the trainer go on. Returns (returncode, oom_kills, cgroup peak, wall_s, cotenant alive)."""
    go = os.path.join(out_dir, "go")
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, TRAIN, "--output-dir", out_dir, "--steps", str(steps), "--pause-at-step",
           str(pause_at), "--go-file", go, *RT] + (["--guard"] if guard else [])
    cg.reset_max_usage()
    oom0 = cg.oom_kill_count()
    t0 = time.monotonic()
    trainer, log = start_trainer(cg, cmd, out_dir)  # the process the OOM killer should take
    wait_for(os.path.join(out_dir, f"step-{pause_at}.done"), trainer, timeout_s=240, poll_s=0.1)
    cotenant = start_cotenant(cg, take_bytes)
    open(go, "w").close()
    try:
        rc = trainer.wait(timeout=300)
    finally:
        log.close()
    alive = cotenant.poll() is None
    return rc, cg.oom_kill_count() - oom0, cg.max_usage_bytes(), time.monotonic() - t0, alive


def test_runtime_cotenant_takes_memory_mid_run(memory_cgroup, tmp_path):
    steps, pause_at = 5, 2
    take = RUNTIME_LIMIT - RUNTIME_ROOM_LEFT
    cg = memory_cgroup(RUNTIME_LIMIT, name="runtime-unguarded")
    out_u = str(tmp_path / "unguarded")
    rc_u, oom_u, peak_u, wall_u, co_u = _run_with_cotenant(cg, out_u, False, steps, pause_at, take)
    assert rc_u in (-9, 137) and oom_u >= 1, (rc_u, oom_u)
    assert co_u, "the OOM killer should have taken the trainer, not the co-tenant"
    assert read_result(out_u) is None
    assert [s for _, s, _ in _steps_log(out_u)] == list(range(1, pause_at + 1))  # died right after

    cg = memory_cgroup(RUNTIME_LIMIT, name="runtime-guarded")
    out_g = str(tmp_path / "guarded")
    rc_g, oom_g, peak_g, wall_g, co_g = _run_with_cotenant(cg, out_g, True, steps, pause_at, take)
    assert rc_g == 0 and oom_g == 0, open(os.path.join(out_g, "trainer.log")).read()[-3000:]
    assert co_g
    r = read_result(out_g)
    assert r is not None and r["global_step"] == steps
    g = r["guard"]
    assert g["preflight_micro_batches"] == 1  # it started fitting, unsplit
    splits = [e for e in g["events"] if e["action"] == "split"]
    assert splits and splits[0]["step"] == pause_at, g["events"]  # split at the first step after
    assert g["micro_batches"] >= 2 and g["samples_per_step"] == [16] * steps
    assert peak_g < RUNTIME_LIMIT
    _report("runtime", limit_mib=RUNTIME_LIMIT // MiB, cotenant_mib=take // MiB,
            unguarded=f"rc={rc_u} oom_kills={oom_u} at step {pause_at + 1}",
            guarded=f"rc=0 split 1->{g['micro_batches']} at step {splits[0]['step']} steps={r['global_step']}",
            guarded_cgroup_peak_mib=round(peak_g / MiB), wall_s=round(wall_u + wall_g, 1))


def test_supervisor_restarts_a_killed_run_without_repeating_steps(memory_cgroup, tmp_path):
    """A 32-token run whose rows become 256 tokens long from step 3 (sequential data): the guard
    (told seq_length 32) cannot see it coming, the kernel kills the step; ``memguard run``
    restarts it with MEMGUARD_MICRO_BATCHES=2 from checkpoint-2, and it completes."""
    steps = 4
    out = str(tmp_path / "supervised")
    report = str(tmp_path / "report.json")
    train = [sys.executable, TRAIN, "--output-dir", out, "--steps", str(steps), "--guard", "--resume",
             "--save-steps", "1", "--guard-seq-length", "32", "--batch-size", "16", "--grad-accum", "1",
             "--seq-len", "32", "--long-seq-len", "256", "--long-from-step", "3", "--layers", "2"]
    cg = memory_cgroup(SUPERVISOR_LIMIT, name="supervisor")
    res = cg.run([sys.executable, "-m", "memguard_core.supervisor", "--max-restarts", "2", "--report", report,
                  "--", *train], env=child_env(), timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    with open(report) as f:
        rep = json.load(f)
    a1, a2 = rep["attempts"]
    assert a1["returncode"] == -9 and a1["killed_for_memory"] and "oom_kill" in a1["reason"]
    assert a2["returncode"] == 0 and a2["micro_batches"] == 2
    assert a2["resume_from"] == os.path.join(out, "checkpoint-2")
    assert res.oom_kills == 1
    assert "restart 1/2 with MEMGUARD_MICRO_BATCHES=2, resuming from" in res.stderr
    # no finished optimizer step repeated: attempt 1 did 1, 2; attempt 2 did 3, 4
    log = _steps_log(out)
    pids = sorted({p for p, _, _ in log}, key=[p for p, _, _ in log].index)
    assert len(pids) == 2
    assert [s for p, s, _ in log if p == pids[0]] == [1, 2]
    assert [s for p, s, _ in log if p == pids[1]] == [3, 4]
    r = read_result(out)
    assert r["global_step"] == steps and r["resumed_from"].endswith("checkpoint-2")
    assert r["log_steps"] == [1, 2, 3, 4]  # trainer_state's history: each step once
    assert r["guard"]["max_forward_rows"] <= 8
    with open(os.path.join(out, f"checkpoint-{steps}", "trainer_state.json")) as f:
        assert [h["step"] for h in json.load(f)["log_history"] if "loss" in h] == [1, 2, 3, 4]
    _report("supervisor", limit_mib=SUPERVISOR_LIMIT // MiB,
            attempt1=f"rc={a1['returncode']} ({a1['reason']}) after {a1['wall_s']}s",
            attempt2="rc=0 MEMGUARD_MICRO_BATCHES=2 from checkpoint-2, steps 3-4",
            cgroup_peak_mib=round(res.max_usage_bytes / MiB), wall_s=round(res.wall_s, 1))
