"""The HF and Lightning paths with ``device="mps"`` (PyTorch on Apple Silicon).

NOT validated on a Mac: this machine has no Apple GPU. The training is real (a tiny Llama on the
CPU: ``use_cpu=True`` / ``accelerator="cpu"``); the thinnest fake stands in for what a Mac has and
this machine has not -- ``torch.backends.mps.is_available`` and the four ``torch.mps`` calls memguard
makes (``current_allocated_memory``, ``driver_allocated_memory``, ``recommended_max_memory``,
``empty_cache``), set on the real ``torch`` module. The fake's allocated figure is this process's
RSS (what the CPU run really holds), its cache what was allocated since the last clean.
What is checked: the option is taken, the preflight estimates the ``mps`` counter, the monitor reads
the fake's counters, a clean calls ``torch.mps.empty_cache`` and a split run keeps its steps.
"""

from __future__ import annotations

import psutil
import pytest
import torch

pytest.importorskip("transformers")


class FakeMps:
    """``torch.mps``'s counters over this process's real RSS (bytes)."""

    def __init__(self, recommended: int):
        self.recommended = recommended
        self.cleans = 0
        self._proc = psutil.Process()
        self._cached = 0

    def current_allocated_memory(self) -> int:
        return self._proc.memory_info().rss

    def driver_allocated_memory(self) -> int:
        self._cached = max(self._cached, 64 << 20)   # blocks kept for reuse until a clean
        return self.current_allocated_memory() + self._cached

    def recommended_max_memory(self) -> int:
        return self.recommended

    def empty_cache(self) -> None:
        self.cleans += 1
        self._cached = 0


@pytest.fixture
def fake_mps(monkeypatch):
    from memguard_core.probes.common import reset_warned

    reset_warned()
    fake = FakeMps(recommended=psutil.virtual_memory().total // 2)
    for name in ("current_allocated_memory", "driver_allocated_memory", "recommended_max_memory", "empty_cache"):
        monkeypatch.setattr(torch.mps, name, getattr(fake, name))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    return fake


def test_hf_trainer_guard_on_mps(fake_mps, tmp_path):
    from memguard_hf import MemGuardCallback
    from memguard_testing.hf_tiny import make_trainer

    # a budget just above what the process holds: the monitor sees pressure at once and acts
    budget = fake_mps.driver_allocated_memory() + (16 << 20)
    cb = MemGuardCallback(device="mps", budget_bytes=budget, monitor_interval_s=0, seq_length=32)
    trainer = make_trainer(str(tmp_path), guard=cb, max_steps=4, grad_accum=1)
    trainer.train()
    assert trainer.state.global_step == 4
    assert cb.preflight is not None and cb.preflight.estimate.counter == "mps"
    assert cb.monitor.device == "mps"
    assert fake_mps.cleans >= 1                       # the monitor's clean is torch.mps.empty_cache
    assert set(cb.samples_per_step) == {8}            # whatever the split, the effective batch stays
    logged = [h for h in trainer.state.log_history if "memguard_peak_gib" in h]
    assert logged and all(h["memguard_budget_gib"] == pytest.approx(budget / 2**30, rel=1e-3) for h in logged)


def test_lightning_guard_on_mps(fake_mps):
    pytest.importorskip("lightning")
    from memguard_lightning import MemGuardCallback
    from memguard_testing.lightning_tiny import fit

    cb = MemGuardCallback(device="mps", budget_gib=64, monitor_interval_s=0, seq_length=32)
    trainer, module, rec = fit(guard=cb, max_steps=3, accumulate=1)
    assert trainer.global_step == 3
    assert cb.preflight is not None and cb.preflight.estimate.counter == "mps"
    assert cb.monitor.device == "mps"
    assert cb.summary["optimizer_steps"] == 3
