"""``mps`` (PyTorch on Apple Silicon) on the probe side: device selection, the probe's arithmetic,
the step reader, the monitor's clean. NOT validated on a Mac: this machine has no Apple GPU, so
``torch`` is replaced (``memguard_testing.fakes.use_fake_torch``) by the thinnest fake that has what
memguard calls (``torch.mps``'s three
counters and ``empty_cache``, ``torch.backends.mps.is_available``, ``torch.cuda.is_available``);
the values are what a 16 GB M2 reports in shape (recommended working set ~ 2/3 of RAM).
"""

from __future__ import annotations

import logging
import types

import pytest

import memguard_core.probes as probes
from memguard_core import stats
from memguard_core.errors import ConfigError
from memguard_core.monitor import Action, MemoryMonitor, default_clean
from memguard_core.probes import MemorySnapshot, host, probe, resolve_device, step_reader
from memguard_core.probes.common import reset_warned
from memguard_testing.fakes import use_fake_torch
from memguard_torch import probes_mps as mps

GiB = 1 << 30


class FakeMps:
    """``torch.mps``: the counters memguard reads and the clean it calls."""

    def __init__(self, allocated=5 * GiB, driver=7 * GiB, recommended=int(10.67 * GiB)):
        self.allocated, self.driver, self.recommended = allocated, driver, recommended
        self.cleans = 0

    def current_allocated_memory(self): return self.allocated
    def driver_allocated_memory(self): return self.driver
    def recommended_max_memory(self): return self.recommended

    def empty_cache(self):
        self.cleans += 1
        self.driver = self.allocated       # the cached blocks go back to the driver


def fake_torch(m, available=True, cuda=False):
    return types.SimpleNamespace(
        mps=m, backends=types.SimpleNamespace(mps=types.SimpleNamespace(is_available=lambda: available)),
        cuda=types.SimpleNamespace(is_available=lambda: cuda, is_initialized=lambda: cuda,
                                   current_device=lambda: 0, empty_cache=lambda: None))


HOST = MemorySnapshot("cpu", 16 * GiB, 3 * GiB, GiB, None, 40.0, None, "host", "darwin", 0.0,
                      pressure_kind="memorystatus", kernel_pressure="normal", swap_used_bytes=0)


@pytest.fixture
def torch_mps(monkeypatch):
    reset_warned()
    m = FakeMps()
    use_fake_torch(monkeypatch, fake_torch(m))
    monkeypatch.setattr(host, "host_probe", lambda cheap: HOST)   # the host is not what is tested
    return m


def test_device_selection(torch_mps, monkeypatch):
    assert resolve_device("mps") == "mps"
    assert resolve_device("auto") == "mps"                     # torch imported, MPS available
    use_fake_torch(monkeypatch, fake_torch(torch_mps, cuda=True))
    assert resolve_device("auto") == "cuda:0"                  # CUDA first
    use_fake_torch(monkeypatch, fake_torch(torch_mps, available=False))
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ConfigError):
        probe("mps")                                           # named, but no MPS


def test_probe_arithmetic(torch_mps):
    s = mps.probe(mps=torch_mps, host=HOST)
    assert (s.device, s.source, s.limit_source) == ("mps", "mps", "mps")
    assert s.total_bytes == s.limit_bytes == int(10.67 * GiB)  # Metal's recommended working set
    # min(recommended - allocated, host available + the 2 GiB of cached blocks)
    assert s.available_bytes == min(int(10.67 * GiB) - 5 * GiB, 3 * GiB + 2 * GiB)
    assert s.process_bytes == 7 * GiB and s.process_peak_bytes is None
    assert (s.pressure, s.pressure_kind, s.kernel_pressure) == (40.0, "memorystatus", "normal")
    assert probe("mps").total_bytes == int(10.67 * GiB)        # through the package
    # torch < 2.5: no recommended_max_memory -> the host's total and limit
    del FakeMps.recommended_max_memory
    try:
        old = types.SimpleNamespace(current_allocated_memory=lambda: GiB, driver_allocated_memory=lambda: GiB)
        s = mps.probe(mps=old, host=HOST)
        assert s.total_bytes == 16 * GiB and s.limit_source == "host"
    finally:
        FakeMps.recommended_max_memory = lambda self: self.recommended


def test_counter_failure_falls_back_and_is_logged(torch_mps, caplog):
    def boom():
        raise RuntimeError("MPS backend failure")
    torch_mps.current_allocated_memory = boom
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        s = probe("mps")
        assert step_reader("mps").live_bytes() is None
    assert s.device == "mps" and s.source in ("psutil", "none") and "MPS probe failed" in caplog.text


def test_step_reader_and_live_bytes(torch_mps):
    r = step_reader("mps")
    assert r.device == "mps" and r.live_bytes() == 5 * GiB and probes.live_bytes("mps") == 5 * GiB
    assert r.reset_peak() is False and r.step_figures() is None and not r.pressure_alone


def test_monitor_on_mps_cleans_with_empty_cache_and_splits(torch_mps):
    torch_mps.allocated, torch_mps.driver = int(6.5 * GiB), int(7.4 * GiB)
    mon = MemoryMonitor(8 * GiB, device="mps", interval_s=0, max_micro_batches=8)
    # 7.4 of 8 GiB (the effective budget: min(8, (7.4 + 3 + 0.9) x 0.8)) = 92.5 %: critical ->
    # a clean; it frees only cached blocks, no live tensor, so the next micro-batch's predicted
    # peak is still critical -> split in the same sample
    assert mon.step_sample(step=0) is Action.SPLIT
    assert torch_mps.cleans == 1 and mon.micro_batches == 2
    assert [e.action for e in mon.events] == [Action.CLEAN, Action.SPLIT]


def test_default_clean_calls_empty_cache_only_where_mps_is_available(torch_mps, monkeypatch):
    default_clean()
    assert torch_mps.cleans == 1
    use_fake_torch(monkeypatch, fake_torch(torch_mps, available=False))
    default_clean()
    assert torch_mps.cleans == 1

    def boom():
        raise RuntimeError("MPS error")
    use_fake_torch(monkeypatch, fake_torch(torch_mps))
    torch_mps.empty_cache = boom
    default_clean()                                            # logged, never raised


def test_stats_on_mps(torch_mps):
    st = stats.memory_stats("mps")
    assert (st["device"], st["source"]) == ("mps", "mps")
    assert (st["allocated_bytes"], st["reserved_bytes"], st["peak_bytes"]) == (5 * GiB, 7 * GiB, 7 * GiB)
    assert stats.reset_peak_memory("mps") == "none"
    assert stats.format_memory_stats("mps").startswith("mps mem: 5.0 GiB allocated, 7.0 GiB driver")
