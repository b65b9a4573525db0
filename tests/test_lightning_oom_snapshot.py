"""The Lightning adapter asks for the guard's out-of-memory snapshot (``Guard.snapshot_oom``: the
CUDA allocator's snapshot with ``cuda_snapshots`` on) inside its ``except`` block, while the failed
micro-batch's tensors are still referenced by the error's frames, as the HF adapter and
``TorchGuard`` do: in a training forward, in a backward (the window redo) and in an evaluation
forward. Real tiny Lightning fits on CPU; the failures are the CPU allocator's error raised from
hooks at chosen points (no limit places a failure there on this model). What the snapshot writes
needs CUDA (tests/test_events_report.py fakes ``torch.cuda`` for it); here the guard's own method is
wrapped to see when it is called."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from memguard_lightning import MemGuardCallback  # noqa: E402
from memguard_testing.lightning_tiny import fit, make_val_loader  # noqa: E402
from memguard_testing.train_scripts import alloc_fails_at  # noqa: E402

ALLOC = ("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: "
         "you tried to allocate 1073741824 bytes.")


def _watched_guard(seen):
    """A guard whose ``snapshot_oom`` records (step, whether an exception is being handled) and
    whose recoveries record their order."""
    guard = MemGuardCallback(preflight=False, budget_bytes=2**40, monitor_interval_s=0)
    g = guard.guard
    snapshot, after_oom, after_window = g.snapshot_oom, g.after_oom, g.after_window_oom

    def snapshot_oom(step, *, peer=False):
        seen.append(("snapshot", step, sys.exc_info()[0] is not None))
        return snapshot(step, peer=peer)

    def recovered(name, fn):
        def wrapper(*a, **kw):
            seen.append((name,))
            return fn(*a, **kw)
        return wrapper

    g.snapshot_oom = snapshot_oom
    g.after_oom = recovered("after_oom", after_oom)
    g.after_window_oom = recovered("after_window_oom", after_window)
    return guard


def test_a_backward_oom_is_snapshotted_inside_the_except_block():
    seen = []
    guard = _watched_guard(seen)
    fit(guard=guard, max_steps=4, module_hook=lambda m: m.model.model.layers[0].register_full_backward_hook(
        alloc_fails_at([3])))
    assert guard.oom_retries == 1
    # the adapter's call, inside the except block (an exception being handled), comes first; the
    # guard's own call inside after_window_oom then dumps nothing more (the flag it sets)
    assert seen[0][0] == "snapshot" and seen[0][2] is True
    assert seen.index(("after_window_oom",)) > 0


def test_a_forward_oom_is_snapshotted_inside_the_except_block():
    seen = []
    state = {"n": 0}

    def hook(m):
        def fail_once(module, args, kwargs):
            if torch.is_grad_enabled():
                state["n"] += 1
                if state["n"] == 2:   # the second training forward
                    raise RuntimeError(ALLOC)
        m.model.register_forward_pre_hook(fail_once, with_kwargs=True)

    guard = _watched_guard(seen)
    fit(guard=guard, max_steps=2, module_hook=hook)
    assert guard.oom_retries == 1
    assert seen[0] == ("snapshot", 0, True) and ("after_oom",) in seen[1:]


def test_an_evaluation_oom_is_snapshotted_and_the_next_one_too():
    seen = []

    def hook(m):
        def too_big(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not torch.is_grad_enabled() and ids is not None and ids.shape[0] > 3:
                raise RuntimeError(ALLOC)
        m.model.register_forward_pre_hook(too_big, with_kwargs=True)

    guard = _watched_guard(seen)
    fit(guard=guard, val_loader=make_val_loader(), val_check_interval=4, module_hook=hook)
    assert guard.evals.oom_retries == 2
    snaps = [s for s in seen if s[0] == "snapshot"]
    # one per caught failure (12 rows, then 6), each inside its except block; the second is a dump
    # of its own (the first was marked handled)
    assert len(snaps) == 2 and all(s[2] for s in snaps)
    assert guard.guard._oom_snapshot_taken is False
