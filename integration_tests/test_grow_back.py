"""Grow-back on real runs: pressure comes, k rises; pressure goes, k halves back to 1, with no
oscillation, every optimizer step done and the effective batch kept.

1. ``test_grow_back_after_a_cotenant_leaves`` (the real thing): ``grow_train.py`` (HF ``Trainer``,
   Llama architecture, 16 x 128-token micro-batches; measured peaks here ~1.09 GiB at k=1,
   ~0.92 GiB at k=2, ~0.78 GiB at k=4) runs in a real memory cgroup (2000 MiB, no swap). After
   step 2 a co-tenant process in the same cgroup takes 800 MiB: the guard's effective budget drops
   to ~0.8 x 1.2 GiB and k rises before the next forward. After step 5 the co-tenant is killed: k
   halves back, one halving per calm stretch (``GrowPolicy(steps=2, seconds=0)``), to 1.
   Skipped, with the reason, where child memory cgroups cannot be created.
2. ``test_grow_back_after_the_budget_returns`` (any machine): the tiny in-process HF run of
   ``hf_tiny``; a callback lowers the monitor's budget under the measured peak for a few steps (as
   ``memguard demo``'s squeeze does) and then restores it.
"""

from __future__ import annotations

import os
import sys

from transformers import TrainerCallback

from memguard_core.monitor import GrowPolicy
from memguard_hf import MemGuardCallback
from memguard_testing import script
from memguard_testing.hf_tiny import make_trainer
from memguard_testing.train_scripts import read_result, start_cotenant, start_trainer, wait_for

MiB = 1 << 20
TRAIN = script("grow_train.py")


def _rows_by_step(out):
    """{global_step: [rows of each forward]} from forwards.log."""
    rows = {}
    with open(os.path.join(out, "forwards.log")) as f:
        for line in f:
            _, step, n = line.split()
            rows.setdefault(int(step), []).append(int(n))
    return rows


def _is_valley(ks):
    """True when ``ks`` rises (or stays), then falls (or stays), and never rises again."""
    i = 0
    while i + 1 < len(ks) and ks[i + 1] >= ks[i]:
        i += 1
    return all(ks[j + 1] <= ks[j] for j in range(i, len(ks) - 1))


def test_grow_back_after_a_cotenant_leaves(memory_cgroup, tmp_path):
    limit, take, steps, arrive, leave = 2000 * MiB, 800 * MiB, 11, 2, 5
    cg = memory_cgroup(limit, name="grow-back")
    out = str(tmp_path / "run")
    os.makedirs(out)
    cmd = [sys.executable, TRAIN, "--output-dir", out, "--steps", str(steps), "--seq-len", "128",
           "--pause-at", f"{arrive},{leave}", "--grow-steps", "2", "--grow-seconds", "0"]
    oom0 = cg.oom_kill_count()
    # the trainer, not the co-tenant, is what an over-limit cgroup would lose
    trainer, log = start_trainer(cg, cmd, out)
    cotenant = None
    try:
        wait_for(os.path.join(out, f"step-{arrive}.done"), trainer)
        cotenant = start_cotenant(cg, take)
        open(os.path.join(out, f"go-{arrive}"), "w").close()
        wait_for(os.path.join(out, f"step-{leave}.done"), trainer)
        assert cotenant.poll() is None
        cotenant.kill()
        cotenant.wait(10)
        open(os.path.join(out, f"go-{leave}"), "w").close()
        rc = trainer.wait(timeout=400)
    finally:
        log.close()
        for p in (trainer, cotenant):
            if p is not None and p.poll() is None:
                p.kill()
    tail = open(os.path.join(out, "trainer.log")).read()[-3000:]
    assert rc == 0 and cg.oom_kill_count() == oom0, tail
    r = read_result(out)
    g = r["guard"]
    assert r["global_step"] == steps                              # the same optimizer step count
    assert g["samples_per_step"] == [16] * steps                  # the effective batch kept
    rows = _rows_by_step(out)
    assert rows[arrive - 1] == [16]                               # unsplit before the co-tenant
    assert max(rows[arrive]) < 16                                 # split from the next forward on
    acts = [(e["action"], e["micro_batches"]) for e in g["events"] if e["action"] in ("split", "grow")]
    first_grow = next(i for i, (a, _) in enumerate(acts) if a == "grow")
    assert all(a == "split" for a, _ in acts[:first_grow])
    assert all(a == "grow" for a, _ in acts[first_grow:]), acts    # no undo, no re-split
    assert acts[-1] == ("grow", 1) and g["micro_batches"] == 1
    ks = [16 // max(rows[s]) for s in sorted(rows)]               # k of each optimizer step
    assert _is_valley(ks) and ks[-1] == 1 and max(ks) >= 2, ks
    print(f"\ngrow-back (cgroup {limit // MiB} MiB, co-tenant {take // MiB} MiB steps {arrive}-{leave}): "
          f"k per step {ks}; peaks {g['peak_at_micro_batches']}; wall {r['wall_s']} s")


class Squeeze(TrainerCallback):
    """Lowers the monitor's budget to 0.9 x the largest step peak measured so far at step ``at``
    (usage >= 100 %: emergency), and restores it at step ``until``."""

    def __init__(self, guard, at, until):
        self.guard, self.at, self.until, self.saved = guard, at, until, None

    def on_step_begin(self, args, state, control, **kw):
        mon = self.guard.monitor
        if state.global_step == self.at:
            self.saved = mon.budget_bytes
            mon.budget_bytes = int(mon.max_step_peak_bytes * 0.9)
        elif state.global_step == self.until:
            mon.budget_bytes = self.saved


def test_grow_back_after_the_budget_returns(tmp_path):
    guard = MemGuardCallback(budget_bytes=8 << 30, preflight=False, monitor_interval_s=0)
    guard.grow = GrowPolicy(steps=2, seconds=0)
    steps = 14
    trainer = make_trainer(str(tmp_path), guard=guard, batch_size=8, grad_accum=1, max_steps=steps,
                           n_rows=8 * steps)
    trainer.add_callback(Squeeze(guard, at=2, until=5))
    trainer.train()
    assert trainer.state.global_step == steps and guard.samples_per_step == [8] * steps
    ev = guard.events
    acts = [(e["action"], e["micro_batches"]) for e in ev if e["action"] in ("split", "grow")]
    assert acts[0][0] == "split"
    first_grow = next(i for i, (a, _) in enumerate(acts) if a == "grow")
    assert all(a == "split" for a, _ in acts[:first_grow])
    assert all(a == "grow" for a, _ in acts[first_grow:]), acts
    assert guard.monitor.micro_batches == 1 and acts[-1] == ("grow", 1)
    # one forward per row chunk: k of each optimizer step from the rows of its forwards
    ks, i = [], 0
    fr = guard.micro_batch_rows
    while i < len(fr):
        n, k = 0, 0
        while n < 8:
            n += fr[i]
            i += 1
            k += 1
        ks.append(k)
    assert len(ks) == steps and _is_valley(ks) and max(ks) >= 2 and ks[-1] == 1, ks
