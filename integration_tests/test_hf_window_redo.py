"""The accumulation-window redo in a real HF ``Trainer`` on CPU, fast: an out-of-memory error (the
CPU allocator's message) raised from inside a backward at a chosen point of a 2-batch window. The
run must redo the whole window from the kept batches and end with the optimizer steps, LR sequence,
samples per step and final parameters of the unsplit run. (The failures are real, under
``RLIMIT_AS``, in integration_tests/test_rlimit_oom.py; here the point of failure is chosen exactly,
the second batch of a window included.)"""

from __future__ import annotations

import pytest

from memguard_core.errors import WindowOOMError
from memguard_hf import MemGuardCallback
from memguard_testing.hf_tiny import loss_sequence, lr_sequence, make_trainer, params

OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"


class FailBackward:
    """A backward hook on the model's last norm that raises the allocator's error at the backward
    calls listed in ``at`` (0-based, counted over the run), or at every call with ``always``."""

    def __init__(self, model, at=(), always=False):
        self.calls, self.at, self.always = 0, set(at), always
        model.model.norm.register_full_backward_hook(self.hook)

    def hook(self, module, grad_in, grad_out):
        n = self.calls
        self.calls += 1
        if self.always or n in self.at:
            raise RuntimeError(OOM)


def _guard(**kw):
    return MemGuardCallback(preflight=False, budget_bytes=64 * 2**30, monitor_interval_s=0, **kw)


@pytest.mark.parametrize("at, k0", [((5,), 1), ((2,), 1), ((9,), 2)],
                         ids=["second-batch-of-window", "first-batch-of-window", "split-run-last-chunk"])
def test_backward_oom_redoes_the_window(tmp_path, at, k0):
    base = make_trainer(str(tmp_path / "base"))
    base.train()
    guard = _guard(micro_batches=k0)
    run = make_trainer(str(tmp_path / "run"), guard=guard)
    FailBackward(run.model, at=at)
    run.train()
    assert run.state.global_step == base.state.global_step == 6
    assert guard.oom_retries == 1
    assert guard.samples_per_step == [16] * 6
    assert lr_sequence(run) == pytest.approx(lr_sequence(base), rel=1e-9)
    assert loss_sequence(run) == pytest.approx(loss_sequence(base), rel=1e-4)
    pb, pr = params(base), params(run)
    worst = max((pb[n] - pr[n]).abs().max().item() for n in pb)
    assert worst < 2e-5, f"parameters differ by {worst}"
    assert guard.monitor.micro_batches == 2 * k0


def test_backward_oom_at_one_row_raises_the_plan(tmp_path):
    guard = _guard()
    run = make_trainer(str(tmp_path / "run"), guard=guard, max_steps=2)
    FailBackward(run.model, always=True)
    with pytest.raises(WindowOOMError) as info:
        run.train()
    err = info.value
    assert err.phase == "backward" and err.micro_batches == err.rows == 8
    assert "out of memory" in str(err) and "A plan that would fit" in str(err) and err.plan


def test_adam_states_exist_before_the_first_step(tmp_path):
    """AdamW's states are allocated before the first forward (a step OOM is not redoable)."""
    guard = _guard()
    run = make_trainer(str(tmp_path / "run"), guard=guard, max_steps=1)
    seen = {}

    def hook(module, args):
        if not seen:
            opt = run.optimizer.optimizer
            seen["states"] = sum(len(opt.state[p]) > 0 for g in opt.param_groups for p in g["params"])
            seen["params"] = sum(len(g["params"]) for g in opt.param_groups)

    run.model.register_forward_pre_hook(hook)
    run.train()
    assert seen["states"] == seen["params"] > 0
