"""``memguard_lightning._compat``'s DDP accessors: their readings of Lightning's and DDP's state, and
their fallbacks when a private name is gone (the 2-rank runs are integration_tests/
test_lightning_ddp_redo.py)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("lightning")

from memguard_lightning import _compat  # noqa: E402


def test_window_ends_reads_lightnings_rule_or_none():
    loop = types.SimpleNamespace(_should_accumulate=lambda: True)
    assert _compat.window_ends(types.SimpleNamespace(fit_loop=loop)) is False
    loop = types.SimpleNamespace(_should_accumulate=lambda: False)
    assert _compat.window_ends(types.SimpleNamespace(fit_loop=loop)) is True
    assert _compat.window_ends(object()) is None   # gone: DDP keeps its own all-reduce


def test_own_reduction_named():
    from lightning.pytorch.strategies import DDPStrategy

    plain = types.SimpleNamespace(static_graph=False)
    assert _compat.ddp_reduces_its_own_way(DDPStrategy(), plain) is None
    assert "communication hook" in _compat.ddp_reduces_its_own_way(DDPStrategy(ddp_comm_hook=print), plain)
    assert "communication hook" in _compat.ddp_reduces_its_own_way(DDPStrategy(model_averaging_period=4), plain)
    assert "static_graph" in _compat.ddp_reduces_its_own_way(DDPStrategy(), types.SimpleNamespace(static_graph=True))
    assert _compat.ddp_reduces_its_own_way(object(), object()) is None   # names gone: read as unset


def test_sync_flags_set_and_put_back():
    ddp = types.SimpleNamespace(require_backward_grad_sync=True, require_forward_param_sync=False)
    was = _compat.ddp_sync_off(ddp)
    assert was is True and ddp.require_backward_grad_sync is False
    _compat.ddp_sync_restore(ddp, was)
    assert ddp.require_backward_grad_sync is True
    _compat.ddp_buffers_at_next_forward(ddp)
    assert ddp.require_forward_param_sync is True
    assert _compat.ddp_sync_off(object()) is None          # no flag: nothing changed, memguard does not average
    _compat.ddp_sync_restore(object.__new__(object), True)  # never raises
    _compat.ddp_buffers_at_next_forward(object())


def test_fsdp_strategies_split_or_name_the_plan():
    """Lightning's real strategy objects: ``FSDPStrategy`` (FSDP1) splits in place (its
    ``training_step`` is the one wrapped, integration_tests/test_lightning_fsdp.py), except with
    parameter offload, where the reason names the plan; DDP splits."""
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    from memguard_lightning.callback import MemGuardCallback, _is_fsdp1_strategy

    module = types.SimpleNamespace(automatic_optimization=True)

    def why(strategy):
        return MemGuardCallback._why_no_split(types.SimpleNamespace(strategy=strategy), module)

    assert _is_fsdp1_strategy(FSDPStrategy()) and not _is_fsdp1_strategy(DDPStrategy())
    assert why(FSDPStrategy()) is None
    assert why(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP")) is None
    reason = why(FSDPStrategy(cpu_offload=True))
    assert "parameter offload" in reason and "accumulate_grad_batches x k" in reason
    assert why(DDPStrategy()) is None


def test_forward_patch_undone_when_the_wrapper_fails_before_the_module():
    """Lightning's real forward redirection (what ``FSDPStrategy.training_step`` runs): a wrapper
    that fails before calling the module (an FSDP1 root whose unshard ran out of memory) leaves
    the module's ``forward`` patched to call ``training_step``; ``forward_patch_undone_on_error``
    puts it back."""
    import torch
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    class Module(torch.nn.Module):
        def forward(self, x):
            return x + 1

        def training_step(self, x):
            return self(x) * 2

    class Root(torch.nn.Module):
        """Stands for the FSDP1 root: fails once before it reaches the wrapped module."""

        def __init__(self, inner):
            super().__init__()
            self.inner, self.fail = inner, True

        def forward(self, *args):
            if self.fail:
                self.fail = False
                raise torch.OutOfMemoryError("before the wrapped module")
            return self.inner(*args)

    one = torch.ones(1)
    # without it, the patch stays: the module's forward now runs training_step
    bare = Module()
    with pytest.raises(torch.OutOfMemoryError):
        _ForwardRedirection()(Root(bare), bare, "training_step", one)
    assert bare(one).item() == 4
    m = Module()
    root = Root(m)
    with pytest.raises(torch.OutOfMemoryError):
        with _compat.forward_patch_undone_on_error(m):
            _ForwardRedirection()(root, m, "training_step", one)
    assert m(one).item() == 2
    assert _ForwardRedirection()(root, m, "training_step", one).item() == 4   # (1 + 1) * 2
    assert m(one).item() == 2
