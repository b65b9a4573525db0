"""Real mlx_lm LoRA fine-tunes on MLX's CPU backend: ``memguard_mlx.train`` against
``mlx_lm.tuner.trainer.train`` itself.

Tiny Llama / Qwen2 shapes with random weights (memguard_testing/mlx_tiny.py); each run takes a few
seconds on 2 cores.
"""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.tuner.trainer import default_loss, iterate_batches  # noqa: E402

from memguard_mlx import LeakDetector, MlxGuard  # noqa: E402

from memguard_testing.mlx_tiny import (Recorder, TokenRows, assert_same_run, build_model,  # noqa: E402
                                      run_tiny, schedule_optimizer, training_args)


def _switching_batches(guard: MlxGuard, at: int, k: int):
    """mlx_lm's own iterate_batches; asks the guard for split k when batch ``at`` (0-based) is drawn,
    i.e. at that batch boundary -- the way the monitor's decision reaches the loop."""

    def batches(**kw):
        for i, b in enumerate(iterate_batches(**kw)):
            if i == at:
                guard.monitor.request_micro_batches(k, "test: switch mid-run")
            yield b

    return batches


def test_split_switch_mid_run_matches_unguarded_mlx_lm(tmp_path):
    ref = run_tiny(tmp_path, "ref", guarded=False)
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0)
    # iteration 6 (batch index 5) lies inside an accumulation window of 2: the switch happens
    # between the two batches of update 3
    run = run_tiny(tmp_path, "split", guarded=True, guard=guard, batches=_switching_batches(guard, 5, 4))
    print(f"\nunguarded mlx_lm: {ref['secs']:.1f}s, guarded with k 1->4 at it 6: {run['secs']:.1f}s")
    assert guard.micro_batches_history == [(1, 1), (6, 4)]
    assert guard.optimizer_steps == 5
    assert max(guard.micro_batch_rows) == 8 and min(guard.micro_batch_rows) < 8
    assert_same_run(ref, run)
    before = [p for it, k, p in guard.batch_peaks if k == 1]
    after = [p for it, k, p in guard.batch_peaks if k == 4]
    print("peak per batch (bytes) k=1:", before, " k=4:", after)
    assert len(before) == 5 and len(after) == 5
    assert max(after) < 0.75 * min(before), (before, after)


def test_qwen2_guarded_unsplit_and_split_from_start(tmp_path):
    ref = run_tiny(tmp_path, "ref", guarded=False, arch="qwen2")
    same = run_tiny(tmp_path, "k1", guarded=True, arch="qwen2", guard=MlxGuard(budget_bytes=2**30, monitor_interval_s=0))
    assert_same_run(ref, same, atol=1e-6)
    k2 = run_tiny(tmp_path, "k2", guarded=True, arch="qwen2",
              guard=MlxGuard(budget_bytes=2**30, monitor_interval_s=0, micro_batches=2))
    assert k2["guard"].micro_batches_history == [(1, 2)]
    assert_same_run(ref, k2)


def test_copied_loop_matches_upstream_train(tmp_path):
    """``memguard_mlx._mlx_lm_loop`` (the code copied from mlx-lm's ``train()``) driven without any
    guard, each batch through its two compiled halves of upstream's ``step``, trains exactly like
    upstream ``mlx_lm.tuner.trainer.train`` of the installed version: same updates, LR sequence,
    reported losses, tokens, validation, saved adapters and final weights."""
    import mlx.nn as nn

    from memguard_mlx import _compat
    from memguard_mlx._mlx_lm_loop import compile_halves, train_loop

    import importlib.metadata
    assert importlib.metadata.version("mlx-lm") == _compat.UPSTREAM_VERSION  # what the header says it copies
    ref = run_tiny(tmp_path, "ref", guarded=False)

    np.random.seed(0)
    model = build_model("llama")
    init = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    opt = schedule_optimizer()
    rec = Recorder()
    args = training_args(tmp_path, "copied")
    state, grad_step, update_step = compile_halves(model, opt, nn.value_and_grad(model, default_loss),
                                                   args.grad_accumulation_steps)

    def run_batch(batch, prev_grad, do_update, it):
        lvalue, toks, grad = grad_step(batch)
        return lvalue, toks, update_step(grad, None, prev_grad, do_update)

    last = train_loop(model, opt, TokenRows(), TokenRows(16, seed=5), args, default_loss, iterate_batches, rec,
                      state=state, run_batch=run_batch, world=mx.distributed.init())
    assert last == args.iters
    final = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    run = dict(model=model, opt=opt, rec=rec, init=init, final=final, args=args)
    assert_same_run(ref, run, atol=1e-6)


def test_allocation_failure_doubles_k_and_redoes_the_batch(tmp_path, monkeypatch):
    """The allocator's exception is faked at the thinnest boundary, the ``mx.eval`` of a batch's
    gradient (where MLX, being lazy, allocates): MLX's Linux CPU backend dies with SIGSEGV on a
    failed malloc instead of raising (see memguard_mlx/memory.py), so a forward of more than 2 rows
    raises MLX's own message ("[malloc] Unable to allocate ...", mlx/allocator.cpp) from iteration
    3 on."""
    import memguard_mlx.trainer as tr

    real = tr._eval_gradient
    calls = {"n": 0}

    def tight_eval(rows, *arrays):
        calls["n"] += 1
        if rows > 2 and calls["n"] > 2:
            raise RuntimeError(f"[malloc] Unable to allocate {rows * 1 << 20} bytes.")
        return real(rows, *arrays)

    ref = run_tiny(tmp_path, "ref", guarded=False)
    monkeypatch.setattr(tr, "_eval_gradient", tight_eval)
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0)
    run = run_tiny(tmp_path, "oom", guarded=True, guard=guard)
    ks = [k for _, k in guard.micro_batches_history]
    print("split history:", guard.micro_batches_history)
    # k doubled at each failure (token-balanced chunks may still hold 3 of 8 rows at k=4)
    assert ks[0] == 1 and ks[1:] == [2 ** i for i in range(1, len(ks))] and guard.oom_retries == len(ks) - 1
    assert {it for it, _ in guard.micro_batches_history[1:]} == {3}  # all on the same batch, redone
    rows_after = guard.micro_batch_rows[2:]  # batches 1-2 ran unsplit (8 rows each)
    assert guard.micro_batch_rows[:2] == [8, 8] and max(rows_after) <= 2
    assert_same_run(ref, run)


def _leaky_batches(store):
    def batches(**kw):
        for b in iterate_batches(**kw):
            x = mx.ones((128 * 1024,), dtype=mx.float32)  # 512 KiB kept alive per step
            mx.eval(x)
            store.append(x)
            yield b

    return batches


@pytest.mark.parametrize("leaky", [True, False], ids=["planted-leak", "normal-run"])
def test_leak_detector(tmp_path, leaky):
    store = []
    det = LeakDetector(window=4, min_growth_bytes=1 << 20, min_step_bytes=64 << 10, warmup=2)
    guard = MlxGuard(budget_bytes=2**30, monitor_interval_s=0, leak_detector=det)
    run_tiny(tmp_path, "leak", guarded=True, guard=guard, iters=12, grad_accumulation_steps=1, steps_per_report=4,
         steps_per_save=100, batches=_leaky_batches(store) if leaky else iterate_batches)
    actives = [a for _, a in det.samples]
    print("active memory after each update:", actives)
    if leaky:
        assert det.fired and guard.summary["leaks"] >= 1
        assert det.reports[0].per_step_bytes >= 400 * 1024
    else:
        assert not det.fired and guard.summary["leaks"] == 0
