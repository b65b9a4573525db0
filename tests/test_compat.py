"""Each adapter's ``_compat`` module: the installed frameworks lie inside the versions its private
names were checked on, and each accessor falls back as documented when the private name is gone."""

from __future__ import annotations

import types

import pytest

from memguard_core import versions


def _checked(module, dist):
    ver = versions.installed_version(dist)
    assert ver is not None and versions.in_range(ver, module.CHECKED), (dist, ver, module.CHECKED)
    assert module.check_version()


def test_hf_compat():
    pytest.importorskip("transformers")
    from memguard_hf import _compat

    _checked(_compat, "transformers")
    assert _compat.loss_shifts_labels(types.SimpleNamespace(_loss_shifts_labels=False)) is False
    # without the Trainer's own rule (transformers < 5): a causal LM that is no encoder-decoder
    causal = type("TinyForCausalLM", (), {"config": types.SimpleNamespace(is_encoder_decoder=False)})
    seq2seq = type("TinyForConditionalGeneration", (), {"config": types.SimpleNamespace(is_encoder_decoder=True)})
    assert _compat.loss_shifts_labels(types.SimpleNamespace(model=causal())) is True
    assert _compat.loss_shifts_labels(types.SimpleNamespace(model=seq2seq())) is False
    assert _compat.loss_shifts_labels(object()) is False
    assert _compat.attn_implementation(object()) is None
    cb, other = object(), object()
    trainer = types.SimpleNamespace(callback_handler=types.SimpleNamespace(callbacks=[other, cb]))
    _compat.move_callback_first(trainer, cb)
    assert trainer.callback_handler.callbacks == [cb, other]
    _compat.move_callback_first(object(), cb)  # no handler: nothing to do, no error


def test_lightning_compat():
    pytest.importorskip("lightning")
    from memguard_lightning import _compat

    _checked(_compat, "lightning")
    assert _compat.should_update_logs(object()) is True
    conn = types.SimpleNamespace(should_update_logs=False)
    assert _compat.should_update_logs(types.SimpleNamespace(_logger_connector=conn)) is False
    assert _compat.skip_backward(object()) is None
    loop = types.SimpleNamespace(_skip_backward=True)
    trainer = types.SimpleNamespace(fit_loop=types.SimpleNamespace(
        epoch_loop=types.SimpleNamespace(automatic_optimization=loop)))
    assert _compat.skip_backward(trainer) is True


def test_mlx_compat(monkeypatch):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    from mlx_lm.tuner import trainer as mlt

    from memguard_mlx import _compat

    _checked(_compat, "mlx-lm")
    assert versions.in_range(_compat.UPSTREAM_VERSION, _compat.CHECKED)
    calls = []
    monkeypatch.setattr(mlt, "_clear_cache", lambda threshold: calls.append(threshold))
    _compat.clear_cache(123)
    assert calls == [123]
    monkeypatch.delattr(mlt, "_clear_cache")
    _compat.clear_cache(2**62)  # the same rule written out: nothing to clear below the threshold
    printed = []
    _compat.print_muted(types.SimpleNamespace(_console=types.SimpleNamespace(print=printed.append)), "k=2")
    assert printed == ["  [ui.muted]k=2[/ui.muted]"]


def test_torch_compat():
    pytest.importorskip("torch")
    from memguard_torch import _compat

    _checked(_compat, "torch")
