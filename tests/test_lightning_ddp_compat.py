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
