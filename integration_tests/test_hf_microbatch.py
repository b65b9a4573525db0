"""Virtual micro-batches in a real HF ``Trainer`` on CPU: switching the split factor k mid-epoch
(and mid accumulation window) must shrink the forward batches as asked while keeping the number of
optimizer steps, the LR sequence, the logged loss and the final parameters of the unsplit run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import memguard_testing
from memguard_hf import MemGuardCallback
from memguard_testing.hf_tiny import SwitchSplit, loss_sequence, lr_sequence, make_trainer, packed_collate, params

BIG_BUDGET = 64 * 2**30  # the switches here are requested by the test, not by memory pressure


def _guard():
    return MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0)


def _assert_same_run(base, split, atol=2e-5):
    assert split.state.global_step == base.state.global_step
    assert lr_sequence(split) == pytest.approx(lr_sequence(base), rel=1e-9)
    assert loss_sequence(split) == pytest.approx(loss_sequence(base), rel=1e-4)
    pb, ps = params(base), params(split)
    assert pb.keys() == ps.keys()
    worst = max((pb[n] - ps[n]).abs().max().item() for n in pb)
    assert worst < atol, f"parameters differ by {worst}"
    # and the runs really trained (parameters moved from the initial ones)
    return worst


@pytest.mark.parametrize("mean_loss", [False, True], ids=["token-count-loss", "mean-loss"])
@pytest.mark.parametrize("grad_checkpoint", [False, True], ids=["no-ckpt", "ckpt"])
def test_switching_k_mid_epoch_keeps_the_run(tmp_path, mean_loss, grad_checkpoint):
    base = make_trainer(str(tmp_path / "base"), mean_loss=mean_loss, grad_checkpoint=grad_checkpoint)
    base.train()

    guard = _guard()
    # k=2 from step 1, k=4 mid-window in step 3 (after the first micro-batch), back to 1 at step 5
    switch = SwitchSplit(guard, at_step={1: 2, 5: 1}, at_substep={3: 4})
    split = make_trainer(str(tmp_path / "split"), guard=guard, extra_callbacks=[switch],
                         mean_loss=mean_loss, grad_checkpoint=grad_checkpoint)
    split.train()

    # 6 steps x 2 micro-batches of 8 rows: step 0 unsplit (2 forwards of 8), steps 1-2 k=2
    # (4-row chunks), step 3: first micro-batch k=2, second k=4 (2-row chunks), step 4 k=4, step 5 k=1
    rows = guard.micro_batch_rows
    assert rows[:2] == [8, 8]
    assert rows[2:10] == [4] * 8
    assert rows[10:12] == [4, 4] and rows[12:16] == [2] * 4
    assert rows[16:24] == [2] * 8
    assert rows[24:] == [8, 8]
    assert guard.samples_per_step == [16] * 6  # effective batch kept at every optimizer step
    _assert_same_run(base, split)
    init = params(make_trainer(str(tmp_path / "init")))
    assert any((init[n] - params(split)[n]).abs().max() > 1e-3 for n in init)


def test_equal_chunk_weights_would_be_wrong(tmp_path):
    """Guards the test above: with a mean loss, equal 1/k weights give different parameters,
    so the equality really depends on the token-share weighting."""
    base = make_trainer(str(tmp_path / "base"), mean_loss=True, max_steps=2)
    base.train()
    guard = MemGuardCallback(preflight=False, budget_bytes=BIG_BUDGET, monitor_interval_s=0,
                             loss_weighting="rows", micro_batches=4)
    split = make_trainer(str(tmp_path / "split"), guard=guard, mean_loss=True, max_steps=2)
    split.train()
    pb, ps = params(base), params(split)
    worst = max((pb[n] - ps[n]).abs().max().item() for n in pb)
    assert worst > 1e-4


def test_packed_batches_split_at_sequence_boundaries(tmp_path):
    base = make_trainer(str(tmp_path / "base"), collate=packed_collate, max_steps=4)
    base.train()
    guard = _guard()
    switch = SwitchSplit(guard, at_step={1: 3}, at_substep={2: 8})
    split = make_trainer(str(tmp_path / "split"), guard=guard, extra_callbacks=[switch],
                         collate=packed_collate, max_steps=4)
    split.train()
    rows = guard.micro_batch_rows  # sequences per forward
    assert rows[:2] == [8, 8]
    assert max(rows[2:]) < 8 and sum(rows) == 8 * 2 * 4
    _assert_same_run(base, split)


def test_oom_in_forward_is_retried_with_a_finer_split(tmp_path):
    """A forward that runs out of memory is redone on smaller chunks, and the result equals the
    unsplit run. The out-of-memory error is injected at the model's forward (no device here can be
    made to run out at a chosen batch size without killing the test process): any forward over 4
    rows raises the CPU allocator's error message, as torch does when malloc fails."""
    base = make_trainer(str(tmp_path / "base"), max_steps=3)
    base.train()
    guard = _guard()
    split = make_trainer(str(tmp_path / "split"), guard=guard, max_steps=3)

    def too_big(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[0] > 4:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")

    split.model.register_forward_pre_hook(too_big, with_kwargs=True)
    split.train()
    assert guard.oom_retries == 1
    assert guard.monitor.micro_batches == 2
    assert guard.micro_batch_rows[:3] == [8, 4, 4]  # the failed forward, then its two halves
    assert guard.samples_per_step == [16] * 3
    _assert_same_run(base, split)


def _ddp_runs(tmp_path, modes, port_base: int, timeout: int = 600) -> dict:
    """``ddp_worker.py`` on 2 gloo ranks once per mode; each mode's per-rank results."""
    script = memguard_testing.script("ddp_worker.py")
    outs = {}
    for i, mode in enumerate(modes):
        out = tmp_path / mode
        env = memguard_testing.script_env(OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-m", "memguard_testing.torchrun", "--nproc_per_node=2",
                               "--master_port", str(port_base + (os.getpid() % 1000) + i),
                               script, mode, str(out)], env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-4000:]
        outs[mode] = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    return outs


def test_ddp_gloo_two_ranks_agree(tmp_path):
    """2-process DDP (gloo): rank 0 alone asks for k=2 then k=4; rank 1 follows through the
    all-reduce; parameters equal the unsplit DDP run."""
    outs = _ddp_runs(tmp_path, ("base", "split"), 29500)
    for r in (0, 1):
        s = outs["split"][r]
        b = outs["base"][r]
        assert s["global_step"] == b["global_step"]
        assert s["lr"] == pytest.approx(b["lr"])
        worst = max((s["params"][n] - b["params"][n]).abs().max().item() for n in b["params"])
        assert worst < 2e-5
        assert s["samples_per_step"] == b["samples_per_step"]
    # both ranks cut alike although only rank 0 asked
    assert outs["split"][0]["forward_rows"] == outs["split"][1]["forward_rows"]
    # the preflight of the base run read DDP and its bucket size from the Trainer (a per-rank estimate)
    for r in (0, 1):
        assert outs["base"][r]["layout"] == {"world_size": 2, "sharding": "ddp", "bucket_cap_mb": 10,
                                             "gradient_as_bucket_view": False, "applied": [], "micro_batches": 1}
    assert min(outs["split"][1]["forward_rows"]) < max(outs["split"][1]["forward_rows"])


def test_ddp_one_rank_oom_in_the_synchronised_backward(tmp_path):
    """2-process DDP (gloo): rank 1 alone fails in the backward DDP would all-reduce in (the last
    batch of step 2's window). Every micro-batch runs under no_sync and the gradients are averaged
    only once both ranks went through, so rank 0 is not left waiting in an all-reduce: both redo the
    window and finish every step with the unsplit run's parameters."""
    outs = _ddp_runs(tmp_path, ("base", "oom"), 29700, timeout=300)   # a hang ends in the timeout
    for r in (0, 1):
        o, b = outs["oom"][r], outs["base"][r]
        assert o["global_step"] == b["global_step"] == 4
        assert o["lr"] == pytest.approx(b["lr"])
        assert o["oom_retries"] == 1                       # rank 0 redid the window with rank 1
        assert o["samples_per_step"] == b["samples_per_step"]
        worst = max((o["params"][n] - b["params"][n]).abs().max().item() for n in b["params"])
        assert worst < 2e-5
    assert outs["oom"][0]["forward_rows"] == outs["oom"][1]["forward_rows"]
