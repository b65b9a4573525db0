"""The monitor's reads (``memguard_core.monitor_sampler``) and the backends' step readers
(``memguard_core.probes.step_reader``), on fake reader functions: what is read, reset and
skipped. The real Linux reader against the kernel is in test_probes_linux.py and test_monitor.py.
"""

from __future__ import annotations

import threading
import time
import types
from dataclasses import dataclass

import pytest

import memguard_core.probes as probes
from memguard_core.monitor_sampler import SamplerThread, StepSampler
from memguard_core.probes import StepReader

GiB = 2**30


@dataclass
class Snap:
    process_bytes: int
    available_bytes: int
    process_peak_bytes: int = None
    timestamp: float = 0.0


class Calls:
    """Fake backend functions that count their calls."""

    def __init__(self, figures=(1.0, 2 * GiB, 3 * GiB, 10 * GiB), reset_ok=True):
        self.figures, self.reset_ok = figures, reset_ok
        self.n = {"probe": 0, "reset": 0, "figures": 0, "pressure": 0}

    def probe(self, cheap):
        self.n["probe"] += 1
        return Snap(2 * GiB, 6 * GiB, process_peak_bytes=5 * GiB, timestamp=7.0)

    def reset(self):
        self.n["reset"] += 1
        return self.reset_ok

    def step_figures(self):
        self.n["figures"] += 1
        return self.figures

    def pressure(self):
        self.n["pressure"] += 1
        return 12.5

    def reader(self, **kw):
        fns = dict(probe=self.probe, reset_peak=self.reset, step_figures=self.step_figures,
                   pressure=self.pressure, live_bytes=lambda: 4 * GiB)
        fns.update(kw)
        return StepReader("cpu", **fns)


def sampler_on(reader, **kw):
    s = StepSampler("cpu", **kw)
    s._reader = reader          # the reader step_reader("cpu") would build, faked
    return s


def test_step_figures_are_the_fast_path_and_restart_the_peak():
    c = Calls()
    s = sampler_on(c.reader())
    assert s.read_step() == (1.0, 2 * GiB, 3 * GiB, 10 * GiB)
    assert c.n == {"probe": 0, "reset": 1, "figures": 1, "pressure": 0}
    assert s.pressure_alone and s.pressure() == 12.5 and s.live() == 4 * GiB


def test_without_step_figures_the_cheap_probe_gives_the_peak():
    c = Calls(figures=None)
    s = sampler_on(c.reader())
    assert s.read_step() == (7.0, 2 * GiB, 5 * GiB, 8 * GiB)     # peak 5, capacity = RSS + available
    assert (c.n["figures"], c.n["probe"], c.n["reset"]) == (1, 1, 1)


def test_a_failed_reset_turns_the_fast_path_off_and_keeps_a_software_baseline(monkeypatch):
    soft = []
    monkeypatch.setattr("memguard_core.stats.reset_peak_memory", lambda dev: soft.append(dev))
    c = Calls(reset_ok=False)
    s = sampler_on(c.reader())
    s.read_step()                 # figures read, then the reset fails: a peak not reset is no step peak
    assert soft == ["cpu"]
    s.read_step()
    assert c.n["figures"] == 1 and c.n["probe"] == 1


def test_given_functions_replace_the_reader_and_its_fast_paths():
    c = Calls()
    peaks = [9 * GiB, 8 * GiB]
    s = sampler_on(c.reader(), probe_fn=lambda cheap: Snap(GiB, GiB), peak_fn=lambda: peaks.pop(),
                   live_fn=lambda: None)
    s.prime()                     # with peak_fn, priming calls it (its reset)
    assert peaks == [9 * GiB]
    assert s.read_step()[1:] == (GiB, 9 * GiB, 2 * GiB)
    assert c.n == {"probe": 0, "reset": 0, "figures": 0, "pressure": 0}
    assert not s.pressure_alone and s.live() is None
    s.probe_fn = None             # replaced while running: the reader's probe again
    assert s.probe(False).timestamp == 7.0


def test_prime_resets_through_the_reader():
    c = Calls()
    sampler_on(c.reader()).prime()
    assert c.n["reset"] == 1


def test_reader_functions_that_fail_read_as_absent(caplog):
    def boom():
        raise OSError("gone")
    r = StepReader("cpu", reset_peak=boom, step_figures=boom, pressure=boom, live_bytes=boom)
    with caplog.at_level("WARNING", logger="memguard.probes"):
        assert r.pressure() is None and r.live_bytes() is None and r.step_figures() is None
        assert r.reset_peak() is False
    assert r.step_figures() is None
    bare = StepReader("cpu")
    assert not bare.pressure_alone and bare.reset_peak() is False and bare.live_bytes() is None


def test_each_backend_offers_its_reader(monkeypatch):
    from memguard_testing.fakes import use_fake_torch

    try:
        from memguard_mlx import probes as mlx_probes   # before torch is faked: mlx_lm imports it
    except ImportError:
        mlx_probes = None

    monkeypatch.setattr(probes.host, "host_source", lambda: "darwin")
    darwin = probes.step_reader("cpu")
    assert not darwin.pressure_alone and darwin.reset_peak() is False and darwin.step_figures() is None
    monkeypatch.setattr(probes.host, "host_source", lambda: "windows")
    assert probes.step_reader("cpu").reset_peak() is False
    monkeypatch.setattr(probes.host, "host_source", lambda: "linux")
    assert probes.step_reader("cpu").pressure_alone          # PSI read alone between full samples

    resets = []
    cuda = types.SimpleNamespace(memory_allocated=lambda i: 3 * GiB, is_available=lambda: True,
                                 reset_peak_memory_stats=resets.append)
    use_fake_torch(monkeypatch, types.SimpleNamespace(cuda=cuda))
    r = probes.step_reader("cuda:1")
    assert r.device == "cuda:1" and r.reset_peak() and resets == [1] and r.live_bytes() == 3 * GiB

    mx = types.SimpleNamespace(reset_peak_memory=lambda: resets.append("mlx"), get_active_memory=lambda: 5,
                               get_peak_memory=lambda: 6, get_cache_memory=lambda: 7)
    if mlx_probes is None:
        pytest.skip("mlx not installed: the MLX reader is not checked")
    monkeypatch.setattr(mlx_probes, "mlx_module", lambda: mx)
    r = probes.step_reader("mlx")
    assert r.reset_peak() and resets[-1] == "mlx" and r.live_bytes() == 5


def test_sampler_thread_survives_a_raising_sample_and_stops():
    errors, n = [], [0]

    def sample():
        n[0] += 1
        raise RuntimeError("sample broke")
    t = SamplerThread(sample, errors.append, name="memguard-test-sampler")
    t.start(0.005)
    deadline = time.time() + 5
    while n[0] < 3 and time.time() < deadline:
        time.sleep(0.005)
    assert t.running and n[0] >= 3 and all(isinstance(e, RuntimeError) for e in errors)
    t.stop()
    assert not t.running
    assert not [th for th in threading.enumerate() if th.name == "memguard-test-sampler"]


@pytest.mark.parametrize("name", ["memguard_core.probes.linux", "memguard_core.probes.darwin",
                                  "memguard_core.probes.windows", "memguard_torch.probes_cuda",
                                  "memguard_torch.probes_mps", "memguard_mlx.probes"])
def test_every_backend_module_has_a_step_reader(name):
    import importlib

    mod = importlib.import_module(name)
    assert callable(mod.step_reader) and "step_reader" in mod.__all__
