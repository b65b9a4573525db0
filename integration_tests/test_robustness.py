"""Robustness of the HF guard in real ``Trainer`` runs (CPU): the monitor thread lives exactly as
long as the run, also when the run dies of an exception, and a failing probe never stops training.
"""

from __future__ import annotations

import threading

import pytest

from memguard_testing.hf_tiny import make_trainer
from memguard_hf import MemGuardCallback


def _monitor_threads():
    return [t for t in threading.enumerate() if t.name == "memguard-monitor" and t.is_alive()]


class _SeeThread:
    """Records, at every optimizer step, whether the monitor thread is alive."""

    def __init__(self):
        self.alive = []

    def __call__(self, *a, **kw):
        self.alive.append(bool(_monitor_threads()))


def test_monitor_thread_runs_with_the_run_and_is_gone_after(tmp_path):
    from transformers import TrainerCallback

    seen = _SeeThread()

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen()

    guard = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0.01)
    trainer = make_trainer(str(tmp_path), guard=guard, extra_callbacks=[Watch()], max_steps=4)
    assert not _monitor_threads()
    trainer.train()
    assert seen.alive == [True] * 4
    assert not _monitor_threads() and not guard.monitor.running
    assert guard.monitor.samples > 0


def test_monitor_thread_stops_when_the_run_dies_of_an_exception(tmp_path):
    from transformers import TrainerCallback

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                # the next training step raises inside the model's forward, as a user bug would
                trainer.model.model.embed_tokens.forward = lambda *a, **k: (_ for _ in ()).throw(
                    RuntimeError("user bug in forward"))

    guard = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0.01)
    trainer = make_trainer(str(tmp_path), guard=guard, extra_callbacks=[Boom()], max_steps=5)
    with pytest.raises(RuntimeError, match="user bug in forward"):
        trainer.train()
    assert not _monitor_threads() and not guard.monitor.running


def test_a_probe_that_raises_or_returns_garbage_never_stops_training(tmp_path, caplog):
    calls = {"n": 0}

    def bad_probe(cheap):
        calls["n"] += 1
        if calls["n"] % 2:
            raise OSError("cannot read memory.usage_in_bytes")
        return object()  # garbage: no fields at all

    guard = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0.01, preflight=False)
    trainer = make_trainer(str(tmp_path), guard=guard, max_steps=3)
    orig_begin = guard.on_train_begin

    def begin(*a, **kw):
        orig_begin(*a, **kw)
        guard.monitor._probe_fn = bad_probe  # the probe breaks once the run is going

    guard.on_train_begin = begin
    with caplog.at_level("WARNING", logger="memguard.monitor"):
        trainer.train()
    assert trainer.state.global_step == 3 and calls["n"] > 2
    failures = [r.message for r in caplog.records if "failed" in r.message]
    # each failure is logged once per path (step, background, final) and kind (raise, garbage)
    assert failures and len(failures) == len(set(failures)) and len(failures) <= 6
    assert not _monitor_threads()
