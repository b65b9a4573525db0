"""Optimizer states allocated before the first step (memguard_torch.optim_state): the run is the
same as with the optimizer's lazy states, bit for bit, and a failed allocation leaves the optimizer
as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from memguard_torch import optim_state
from memguard_torch.optim_state import preallocate_optimizer_state, unwrap_optimizer


def _train(model, opt, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
], ids=["adamw", "adam-amsgrad", "adamw-single-tensor", "adamw-fused"])
def test_preallocated_states_give_the_same_run(make):
    torch.manual_seed(0)
    lazy = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    early = copy.deepcopy(lazy)
    opt_lazy, opt_early = make(lazy.parameters()), make(early.parameters())
    n_params = sum(p.numel() for p in early.parameters())
    per_param = 3 if opt_early.defaults.get("amsgrad") else 2
    assert preallocate_optimizer_state(opt_early) == per_param * n_params * 4
    _train(lazy, opt_lazy)
    _train(early, opt_early)
    for a, b in zip(lazy.parameters(), early.parameters()):
        assert torch.equal(a, b)
    assert preallocate_optimizer_state(opt_early) == 0   # states exist: left alone


def test_other_optimizers_keep_their_lazy_states():
    m = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    assert preallocate_optimizer_state(opt) == 0 and len(opt.state) == 0


def test_wrappers_are_unwrapped():
    opt = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters())

    class Wrapper:
        def __init__(self, inner):
            self.optimizer = inner

    assert unwrap_optimizer(Wrapper(Wrapper(opt))) is opt
    assert preallocate_optimizer_state(Wrapper(opt)) > 0


def test_a_failed_allocation_leaves_the_optimizer_lazy(monkeypatch):
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(m.parameters())
    real, calls = optim_state._adam_state, []

    def failing(p, group):
        calls.append(p)
        if len(calls) == 3:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(p, group)

    monkeypatch.setattr(optim_state, "_adam_state", failing)
    assert preallocate_optimizer_state(opt) == 0
    assert len(opt.state) == 0
    _train(m, opt, steps=1)   # the optimizer still creates its states at its first step
    assert len(opt.state) == 4


class _UpdateTemporaries(torch.optim.AdamW):
    """AdamW whose update asks the CPU allocator for a petabyte after the closure: a real
    allocation failure inside the step itself."""

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        torch.empty(2**50, dtype=torch.uint8)
        return loss


def _guard():
    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions

    return Guard(GuardOptions.from_kwargs(budget_bytes=2**30, preflight=False, monitor_interval_s=0))


def _is_oom(exc):
    return "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower()


def test_prepare_optimizer_names_an_oom_in_the_update_and_passes_the_closures_through():
    from memguard_core.errors import WindowOOMError

    model = torch.nn.Linear(6, 3)
    opt = _UpdateTemporaries(model.parameters(), lr=1e-2)
    optim_state.prepare_optimizer(opt, _guard(), lambda: 4, _is_oom)
    assert len(opt.state) == 2 and getattr(opt.step, "_memguard_step", False)   # states made up front
    model(torch.randn(4, 6)).sum().backward()
    with pytest.raises(WindowOOMError) as e:
        opt.step()
    assert e.value.phase == "optimizer step" and e.value.rows == 4

    def failing_closure():                      # the training step's own OOM is not the update's
        torch.empty(2**50, dtype=torch.uint8)

    with pytest.raises(RuntimeError) as e2:
        opt.step(failing_closure)
    assert not isinstance(e2.value, WindowOOMError) and _is_oom(e2.value)
    wrapped = opt.step
    optim_state.prepare_optimizer(opt, _guard(), lambda: 4, _is_oom)
    assert opt.step is wrapped                  # wrapped once
