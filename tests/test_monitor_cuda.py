"""The monitor on a CUDA device: the caching allocator's retries as a pressure signal, and the
allocator's window peaks in the step figures.

No CUDA device here: ``torch.cuda`` is replaced by the thin fake of its counter functions
(``memguard_testing.fakes.FakeTorchCuda``: ``memory_stats_as_nested_dict`` with torch's key
layout, ``num_alloc_retries`` / ``num_ooms`` set by the test, ``empty_cache`` counted), as
``torch.cuda`` (``memguard_testing.fakes.use_fake_torch``); everything above it is the real code: the CUDA step reader and probe,
``MemoryMonitor``, ``MicroBatchPolicy``, the default clean, ``Guard`` and its event log.
"""

import json
import logging
import sys
import types

import pytest

from memguard_core.errors import ConfigError
from memguard_core.monitor import Action, AllocRetryPolicy, MemoryMonitor, MicroBatchPolicy, Thresholds
from memguard_core.probes import alloc_conf, nvml
from memguard_core.probes.common import reset_warned
from memguard_testing.fakes import FakeTorchCuda, use_fake_torch
from memguard_torch import probes_cuda as cuda

GiB = 1 << 30


@pytest.fixture
def gpu(monkeypatch):
    """An 80 GiB card, a third in use: far from every usage level, so only the retries act."""
    tc = FakeTorchCuda(allocated=20 * GiB, reserved=24 * GiB, peak_alloc=22 * GiB, peak_res=26 * GiB,
                       free=50 * GiB, total=80 * GiB)
    use_fake_torch(monkeypatch, types.SimpleNamespace(cuda=tc))
    monkeypatch.setattr(cuda, "torch_cuda_module", lambda: tc)
    monkeypatch.setattr(nvml, "nvml_module", lambda nvml=None: None)
    cuda._reset_baseline()
    reset_warned()
    yield tc
    cuda._reset_baseline()


# ------------------------------------------------------------------ the rule alone

def test_two_retried_steps_in_a_row_clean_then_two_more_split():
    pol = MicroBatchPolicy(Thresholds(), micro_batches=1, max_micro_batches=8, alloc_retries=AllocRetryPolicy())
    feed = lambda n, ooms=0, step=None: pol.observe_alloc_retries(n, ooms=ooms, step=step)
    assert feed(0) is None                 # the baseline
    assert feed(3) is None                 # one retried step: not yet (Composer: 2 in a row)
    ev = feed(5, step=2)
    assert ev.action is Action.CLEAN and ev.source == "alloc_retries" and ev.step == 2
    assert "2 optimizer steps in a row" in ev.message and "+5" in ev.message and pol.micro_batches == 1
    assert feed(6) is None                 # each action needs a new run of 2
    ev = feed(9)
    assert ev.action is Action.SPLIT and pol.micro_batches == 2 and "splitting micro-batches 1 -> 2" in ev.message


def test_a_calm_step_breaks_the_run_and_calm_steps_end_the_episode():
    pol = MicroBatchPolicy(Thresholds(), micro_batches=1, alloc_retries=AllocRetryPolicy(steps=2, release_steps=2))
    for n in (0, 1, 1, 2, 2):              # retried, calm, retried, calm: never two in a row
        assert pol.observe_alloc_retries(n) is None
    assert pol.observe_alloc_retries(3) is None
    assert pol.observe_alloc_retries(4).action is Action.CLEAN
    assert pol.observe_alloc_retries(4) is None and pol._retry_episodes.open   # one calm step
    assert pol.observe_alloc_retries(4) is None and not pol._retry_episodes.open
    pol.observe_alloc_retries(5)
    assert pol.observe_alloc_retries(6).action is Action.CLEAN   # a new episode cleans first again


def test_a_step_with_an_oom_is_not_counted_and_a_reset_is_a_new_baseline():
    pol = MicroBatchPolicy(Thresholds(), micro_batches=1, alloc_retries=AllocRetryPolicy())
    pol.observe_alloc_retries(0, ooms=0)
    pol.observe_alloc_retries(2, ooms=0)
    assert pol.observe_alloc_retries(4, ooms=1) is None      # the OOM's handling split already
    assert pol.observe_alloc_retries(5, ooms=1) is None      # a new run starts
    assert pol.observe_alloc_retries(0, ooms=0) is None      # reset_accumulated_memory_stats
    assert pol.observe_alloc_retries(1, ooms=0) is None
    assert pol.observe_alloc_retries(2, ooms=0).action is Action.CLEAN


def test_act_false_counts_without_acting_and_garbage_is_refused():
    pol = MicroBatchPolicy(Thresholds(), micro_batches=1, alloc_retries=AllocRetryPolicy())
    pol.observe_alloc_retries(0)
    pol.observe_alloc_retries(1)
    assert pol.observe_alloc_retries(2, act=False) is None   # the usage rule acted on this sample
    assert pol.observe_alloc_retries(3).action is Action.CLEAN
    with pytest.raises(ValueError):
        pol.observe_alloc_retries(-1)
    with pytest.raises(ConfigError, match="alloc_retries.steps"):
        AllocRetryPolicy(steps=0)
    assert MicroBatchPolicy(Thresholds(), micro_batches=1).observe_alloc_retries(5) is None   # off


def test_an_open_retry_episode_is_no_calm_for_growing_back():
    from memguard_core.monitor import GrowPolicy

    pol = MicroBatchPolicy(Thresholds(), micro_batches=4, planned_micro_batches=4, alloc_retries=AllocRetryPolicy(),
                      grow=GrowPolicy(steps=2, seconds=0.0))
    pol.observe_alloc_retries(0)
    pol.observe_alloc_retries(1)                 # a retried step: the episode is open
    for t in range(6):
        assert pol.observe(10, 100, step=t, source="step", now=float(t)) is None
    assert pol.micro_batches == 4


# ------------------------------------------------------------------ the monitor on the CUDA reader

def test_the_step_sample_feeds_the_retries_once_per_optimizer_step(gpu):
    mon = MemoryMonitor(60 * GiB, device="cuda:0", interval_s=0, micro_batches=1, max_micro_batches=8)
    mon.prime()
    mon.step_sample(0)                            # the baseline (0 retries)
    gpu.alloc_retries = 2
    # gradient accumulation: three batch boundaries of the same optimizer step read it once
    assert [mon.step_sample(1) for _ in range(3)] == [Action.NONE] * 3
    gpu.alloc_retries = 4
    assert mon.step_sample(2) is Action.CLEAN
    assert gpu.empty_cache_calls == 1 and mon.micro_batches == 1
    ev = mon.events[-1]
    assert (ev.source, ev.step, ev.action) == ("alloc_retries", 2, Action.CLEAN)
    gpu.alloc_retries = 5
    assert mon.step_sample(3) is Action.NONE
    gpu.alloc_retries = 7
    assert mon.step_sample(4) is Action.SPLIT and mon.micro_batches == 2
    assert [e.source for e in mon.events] == ["alloc_retries", "alloc_retries"]
    # the usage levels never moved: the retries alone acted
    assert mon.level.name == "OK"


def test_cuda_step_figures_carry_the_window_peaks(gpu):
    mon = MemoryMonitor(60 * GiB, device="cuda:0", interval_s=0)
    mon.prime()
    gpu.allocated, gpu.peak_alloc, gpu.peak_res = 20 * GiB, 30 * GiB, 34 * GiB
    mon.step_sample(1)
    f = mon.last_step_figures
    assert (f["reserved_peak"], f["allocated_peak"]) == (34 * GiB, 30 * GiB)
    assert f["peak"] >= 34 * GiB
    assert gpu.resets and gpu.peak_alloc == 20 * GiB      # the window was closed by a reset


def test_a_monitor_off_cuda_reads_no_retries():
    """The real Linux CPU reader: no allocator window, no retry signal, no CUDA figures."""
    mon = MemoryMonitor(1 << 50, device="cpu", interval_s=0)
    mon.prime()
    for step in range(3):
        assert mon.step_sample(step) is Action.NONE
    assert mon.sampler.take_window() is None and "reserved_peak" not in mon.last_step_figures


def test_the_guard_logs_the_retry_actions_in_its_event_log(gpu, tmp_path):
    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions

    g = Guard(GuardOptions.from_kwargs(device="cuda:0", budget_bytes=60 * GiB, monitor_interval_s=0,
                                       preflight=False, log_dir=str(tmp_path)))
    g.start(rows=8)
    for step, retries in enumerate((0, 1, 2, 3, 4)):
        gpu.alloc_retries = retries
        g.micro_batches_for_step(step)
    g.finish(5)
    records = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in open(f)]
    decisions = [r for r in records if r.get("type") == "decision" and r.get("source") == "alloc_retries"]
    assert [d["kind"] for d in decisions] == ["clean", "split"]
    assert [d["step"] for d in decisions] == [2, 4] and decisions[-1]["micro_batches"] == 2
    assert [e["source"] for e in g.events] == ["alloc_retries", "alloc_retries"]
    steps = [r for r in records if r.get("type") == "step"]
    assert steps and steps[-1]["num_alloc_retries"] == 4


# ------------------------------------------------------------------ expandable segments

def test_the_allocator_setting_is_read_from_torch_itself():
    """The real torch (this machine's CPU build parses and reports the settings all the same): the
    string torch parsed from the environment, then one set at runtime."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import torch\n"
            "import memguard_torch\n"
            "from memguard_core.probes.alloc_conf import allocator_settings as a, expandable_segments as e\n"
            "print(a(), e(a()))\n"
            "torch._C._accelerator_setAllocatorSettings('expandable_segments:False')\n"
            "print(a(), e(a()))\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith("ALLOC_CONF")}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", PYTORCH_ALLOC_CONF="max_split_size_mb:128,expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["max_split_size_mb:128,expandable_segments:True", "True",
                                  "expandable_segments:False", "False"]


def test_expandable_segments_parse_and_the_environment_fallback():
    assert alloc_conf.expandable_segments("") is False                       # torch's default
    assert alloc_conf.expandable_segments("max_split_size_mb:64, expandable_segments:True") is True
    assert alloc_conf.expandable_segments("expandable_segments:True,expandable_segments:False") is False
    assert alloc_conf.expandable_segments("backend:cudaMallocAsync") is None   # no segments of torch's
    no_getter = types.SimpleNamespace(_C=types.SimpleNamespace())
    assert cuda.allocator_settings(no_getter) is None                   # no such call: the environment
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert alloc_conf.allocator_settings(env, reader=lambda: None) == "expandable_segments:True"   # CUDA's own name first
    assert alloc_conf.allocator_settings({}, reader=lambda: None) == ""


def _guard(tmp_path):
    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions

    g = Guard(GuardOptions.from_kwargs(device="cuda:0", budget_bytes=60 * GiB, monitor_interval_s=0,
                                       preflight=False), log=logging.getLogger("memguard.test"))
    g.start(rows=8)
    return g


def test_the_guard_says_once_that_segments_are_off_and_what_fragmentation_cost(gpu, tmp_path, monkeypatch, caplog):
    from memguard_core import observe

    monkeypatch.setattr(observe, "_SEGMENTS_NOTED", False)
    for name in alloc_conf.ALLOC_CONF_NAMES:
        monkeypatch.delenv(name, raising=False)
    g = _guard(tmp_path)
    with caplog.at_level(logging.INFO, logger="memguard.test"):
        g.micro_batches_for_step(0)
        # step 1, two batches (accumulation): the larger reserved peak is the step's
        gpu.peak_res, gpu.peak_alloc = 30 * GiB, 29 * GiB
        g.micro_batches_for_step(0)
        gpu.peak_res, gpu.peak_alloc = 34 * GiB, 30 * GiB
        g.micro_batches_for_step(1)
        gpu.peak_res, gpu.peak_alloc = 40 * GiB, 30 * GiB
        g.micro_batches_for_step(2)
    notes = [r for r in caplog.records if "expandable segments" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    assert "at step 1's peak it reserved 34.00 GiB for 30.00 GiB allocated, 4.00 GiB (12%)" in notes[0].getMessage()
    g.stop()
    caplog.clear()
    g = _guard(tmp_path)                      # a second run in the process: said already
    with caplog.at_level(logging.INFO, logger="memguard.test"):
        for step in range(3):
            g.micro_batches_for_step(step)
    assert not [r for r in caplog.records if "expandable segments" in r.getMessage()]
    g.stop()


def test_nothing_is_said_with_expandable_segments_on(gpu, tmp_path, monkeypatch, caplog):
    from memguard_core import observe

    monkeypatch.setattr(observe, "_SEGMENTS_NOTED", False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    g = _guard(tmp_path)
    with caplog.at_level(logging.INFO, logger="memguard.test"):
        for step in range(3):
            g.micro_batches_for_step(step)
    assert not [r for r in caplog.records if "expandable segments" in r.getMessage()]
    g.stop()


def test_the_fragmentation_note_is_info_when_little_is_lost():
    from memguard_core.observe import fragmentation_note

    level, msg = fragmentation_note(1, 100 * GiB, 99 * GiB)
    assert level == logging.INFO and "1.00 GiB (1%)" in msg
