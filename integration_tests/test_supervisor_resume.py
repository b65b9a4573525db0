"""``memguard run`` resumes a real Lightning fit after a real cgroup OOM kill.

``lightning_resume_run.py`` (the container scenarios' Llama in a ``LightningModule``, a checkpoint
every optimizer step with ``last.ckpt``, a CSV logger, a stateful loader) runs under the supervisor
inside a child memory cgroup of this test (``cgroup_harness.MemoryCgroup``: a real v1/v2 limit, no
swap). Its rows are 32 tokens long for steps 1-2 and 256 tokens from step 3 (sequential data), so
step 3 unsplit needs more than the limit and the kernel's OOM killer takes the process (SIGKILL,
the cgroup's ``oom_kill`` count up): nothing in the script can catch it. The supervisor then starts
it again with ``MEMGUARD_MICRO_BATCHES=2`` and ``MEMGUARD_RESUME_FROM`` naming the latest Lightning
checkpoint, found by :mod:`memguard_core.resume` in the logger's ``version_0/checkpoints``; the
script passes it to ``trainer.fit(ckpt_path=memguard_lightning.resume_checkpoint())``.

Asserted from what really happened (the script's per-step log written by a Lightning callback, a
forward pre-hook on the model, the checkpoint files themselves): attempt 1 finished steps 1-2 and
was OOM-killed; attempt 2 began at the restored ``global_step`` 2, ran step 3 only (no finished
optimizer step repeated), on the 256-token rows (the loader resumed after the consumed batches),
in two forwards of 8 rows (the doubled micro-batches, the effective batch of 16 kept), with the
LR the uninterrupted schedule has at step 3 (the scheduler state was restored).

The limit comes from the script's measured per-step peaks (resident set; the page cache the
checkpoint writes is reclaimable): steps 1-2 about 0.8 GiB, step 3 unsplit about 1.6 GiB, step 3
in two micro-batches after a restore about 1.2 GiB. Skipped, with the reason, where child memory
cgroups cannot be created.
"""

from __future__ import annotations

import json
import os
import sys

from memguard_core.resume import checkpoint_step
from memguard_testing import script
from memguard_testing.train_scripts import child_env, read_result

MiB = 1 << 20
TRAIN = script("lightning_resume_run.py")
LIMIT = 1400 * MiB  # 16 x 32-token steps and a 16 x 256-token step in 2 micro-batches fit; unsplit it does not
STEPS, LONG_FROM = 3, 3


def _steps_log(root):
    """(pid, step, lr, tokens per row, [rows of each forward]) per finished optimizer step."""
    path = os.path.join(root, "steps.log")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            pid, step, lr, seq, *rows = line.split()
            out.append((int(pid), int(step), float(lr), int(seq), [int(r) for r in rows]))
    return out


def _scheduled_lr(step):
    """The LR of optimizer step ``step`` (1-based) under the script's schedule, run without a break."""
    import torch

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=STEPS)
    for _ in range(step - 1):
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


def test_supervisor_resumes_a_killed_lightning_run_from_its_latest_checkpoint(memory_cgroup, tmp_path):
    import torch

    root = str(tmp_path / "run")
    report = str(tmp_path / "report.json")
    train = [sys.executable, TRAIN, "--default-root-dir", root, "--steps", str(STEPS), "--seq-len", "32",
             "--long-seq-len", "256", "--long-from-step", str(LONG_FROM), "--layers", "2"]
    cg = memory_cgroup(LIMIT, name="lightning-supervisor")
    res = cg.run([sys.executable, "-m", "memguard_core.supervisor", "--max-restarts", "2", "--report", report,
                  "--", *train], env=child_env(), timeout=500)
    assert res.returncode == 0, res.stderr[-4000:]
    with open(report) as f:
        rep = json.load(f)
    a1, a2 = rep["attempts"]
    # attempt 1: the kernel's OOM killer, counted by the cgroup
    assert a1["returncode"] == -9 and a1["killed_for_memory"] and "oom_kill" in a1["reason"], a1
    assert res.oom_kills == 1
    # the resume point: Lightning's last.ckpt of the killed attempt's logger version, saved at step 2
    last = os.path.join(root, "lightning_logs", "version_0", "checkpoints", "last.ckpt")
    assert a1["resume_framework"] == "lightning"
    assert a2["returncode"] == 0 and a2["micro_batches"] == 2 and a2["resume_from"] == last, a2
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == LONG_FROM - 1
    assert f"restart 1/2 with MEMGUARD_MICRO_BATCHES=2, resuming from {last} (lightning)" in res.stderr

    with open(os.path.join(root, "attempts.jsonl")) as f:
        starts = [json.loads(line) for line in f]
    assert [(s["start_step"], s["ckpt_path"], s["micro_batches"]) for s in starts] == [
        (0, None, None), (LONG_FROM - 1, last, "2")]

    log = _steps_log(root)
    pid1, pid2 = starts[0]["pid"], starts[1]["pid"]
    assert {p for p, *_ in log} == {pid1, pid2}
    # no finished optimizer step repeated: attempt 1 did 1, 2 (killed in 3); attempt 2 did 3 only
    assert [s for p, s, *_ in log if p == pid1] == [1, 2]
    assert [s for p, s, *_ in log if p == pid2] == [3]
    # attempt 1 ran its steps unsplit on the short rows
    assert [(seq, rows) for p, _, _, seq, rows in log if p == pid1] == [(32, [16]), (32, [16])]
    # attempt 2: step 3's own rows (the loader resumed after the 2 consumed batches), in 2 micro-batches of 8
    (_, _, _, seq3, rows3), = [e for e in log if e[0] == pid2]
    assert seq3 == 256 and rows3 == [8, 8]
    # the LR schedule went on from its restored state
    for _, step, lr, *_ in log:  # the log keeps 6 significant digits
        assert abs(lr - _scheduled_lr(step)) <= 1e-6 * _scheduled_lr(step), (step, lr, _scheduled_lr(step))

    r = read_result(root)
    assert r is not None and r["global_step"] == STEPS and r["resumed_from"] == last
    assert r["rows_per_step"] == [16] and r["micro_batch_rows"] == [8, 8]
    # the finished run's own checkpoint, in the restarted attempt's logger version
    final = os.path.join(root, "lightning_logs", "version_1", "checkpoints", f"epoch=0-step={STEPS}.ckpt")
    assert os.path.isfile(final) and checkpoint_step(final) == STEPS
    print(f"\n[lightning supervisor] limit_mib={LIMIT // MiB}, attempt1=rc {a1['returncode']} ({a1['reason']}) "
          f"after {a1['wall_s']}s, attempt2=rc 0 MEMGUARD_MICRO_BATCHES=2 from {os.path.relpath(last, root)}, "
          f"cgroup_peak_mib={round(res.max_usage_bytes / MiB)}, wall_s={round(res.wall_s, 1)}", flush=True)
