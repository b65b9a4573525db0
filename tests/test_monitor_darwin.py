"""macOS pressure: the darwin probe's sysctl reads and the monitor's darwin pressure model.

This machine is not a Mac. What is replaced, and only that:
- ``probes.darwin._sysctlbyname`` (libc ``sysctlbyname``, raw bytes): a fake serving recorded
  readings of ``kern.memorystatus_level``, ``kern.memorystatus_vm_pressure_level`` and
  ``vm.swapusage`` (tests/fixtures/probes/darwin_pressure_sequences.json, with the note on how
  they were written);
- ``probes.host.host_source`` returns ``"darwin"`` so the monitor builds the darwin step reader;
- the monotonic clock follows the recorded timestamps (the monitor's windows are in seconds).
Everything else is real: darwin.probe (psutil's total / available and this process's RSS),
the step reader, MemoryMonitor, MicroBatchPolicy.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time

import pytest

import memguard_core.probes as probes
from memguard_core.errors import ConfigError
from memguard_core.monitor import (Action, GrowPolicy, MemoryMonitor, MemorystatusPolicy, PsiPolicy,
                                   pressure_kind)
from memguard_core.monitor_pressure import MemorystatusEpisodes, PressureEpisodes
from memguard_core.probes import MemorySnapshot, darwin, host
from memguard_core.probes.common import reset_warned

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ = json.load(open(os.path.join(HERE, "fixtures", "probes", "darwin_pressure_sequences.json")))["sequences"]
MiB, GiB = 1 << 20, 1 << 30


class FakeSysctl:
    """The sysctl boundary: the bytes ``sysctlbyname`` returns on a Mac for the three names the
    probe reads (ints little-endian, 4 bytes; ``struct xsw_usage`` packed as the kernel does)."""

    def __init__(self, reading=None):
        self.reading = reading or {}
        self.names = []

    def __call__(self, name):
        self.names.append(name)
        r = self.reading
        if name == "kern.memorystatus_level" and "memorystatus_level" in r:
            return struct.pack("<I", r["memorystatus_level"])
        if name == "kern.memorystatus_vm_pressure_level" and "vm_pressure_level" in r:
            return struct.pack("<I", r["vm_pressure_level"])
        if name == "vm.swapusage" and "swap_used" in r:
            total = 4096 * MiB
            return struct.pack("<QQQIi", total, total - r["swap_used"], r["swap_used"], 16384, 1)
        return None


@pytest.fixture
def mac(monkeypatch):
    reset_warned()
    fake = FakeSysctl()
    clock = [1000.0]
    monkeypatch.setattr(darwin, "_sysctlbyname", fake)
    monkeypatch.setattr(host, "host_source", lambda: "darwin")
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    return fake, clock


# ---------------------------------------------------------------- the probe at the sysctl boundary

def test_darwin_probe_reads_psutil_and_the_three_sysctls(mac):
    fake, _ = mac
    import psutil

    fake.reading = {"memorystatus_level": 34, "vm_pressure_level": 2, "swap_used": 1263 * MiB}
    s = darwin.probe()
    assert s.source == "darwin" and s.pressure_kind == "memorystatus"
    assert s.pressure == 66.0 and s.kernel_pressure == "warn" and s.swap_used_bytes == 1263 * MiB
    assert s.total_bytes == psutil.virtual_memory().total          # psutil, not our own formula
    assert 0 < s.available_bytes <= s.total_bytes
    assert set(fake.names) == {"kern.memorystatus_level", "kern.memorystatus_vm_pressure_level",
                               "vm.swapusage"}
    assert probes.probe("cpu").source == "darwin"                   # the package routes here
    assert darwin.probe(cheap=True).pressure == 66.0                # same counters, no subprocess


def test_darwin_bad_sysctl_values_are_dropped_and_logged(mac, caplog):
    fake, _ = mac
    fake.reading = {"memorystatus_level": 340, "vm_pressure_level": 3}
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        s = darwin.probe()
    assert s.pressure is None and s.kernel_pressure is None and s.swap_used_bytes is None
    assert s.pressure_kind is None
    assert "memorystatus_level" in caplog.text and "memorystatus_vm_pressure_level" in caplog.text


def test_darwin_sysctl_failure_never_raises(mac, monkeypatch, caplog):
    def boom(name):
        raise OSError("sysctl denied")
    monkeypatch.setattr(darwin, "_sysctlbyname", boom)
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        s = darwin.probe()
    assert s.pressure is None and s.total_bytes > 0 and "sysctlbyname failed" in caplog.text


def test_recorded_sysctl_text_keeps_its_model():
    fix = os.path.join(HERE, "fixtures", "probes")
    s = darwin.snapshot_from_outputs(open(os.path.join(fix, "darwin_m2_16gb_vm_stat.txt")).read(),
                                     open(os.path.join(fix, "darwin_m2_16gb_sysctl.txt")).read(),
                                     rss=1, peak=None)
    assert s.pressure_kind == "memorystatus" and s.swap_used_bytes == int(1263.25 * MiB)


# ---------------------------------------------------------------- one model per platform

def test_pressure_kind_routes_by_snapshot():
    base = dict(device="cpu", total_bytes=GiB, available_bytes=GiB, process_bytes=1,
                process_peak_bytes=None, pressure=60.0, limit_bytes=None, limit_source="host",
                timestamp=0.0)
    assert pressure_kind(MemorySnapshot(source="darwin", **base)) == "memorystatus"
    assert pressure_kind(MemorySnapshot(source="linux", **base)) == "psi"
    assert pressure_kind(MemorySnapshot(source="windows", **base)) is None
    assert pressure_kind(MemorySnapshot(source="mlx", pressure_kind="memorystatus", **base)) == "memorystatus"


def test_a_darwin_figure_never_reaches_the_psi_policy_nor_psi_the_darwin_one(mac):
    fake, clock = mac
    # darwin at 90 % in use and rising: PSI policy on, darwin policy off -> nothing
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0, clean_fn=lambda: None,
                        psi=PsiPolicy(threshold=10, sustain_s=0.5, min_samples=2), memorystatus=None)
    for i in range(10):
        clock[0] += 0.5
        fake.reading = {"memorystatus_level": 12 - i, "vm_pressure_level": 2, "swap_used": i * 100 * MiB}
        assert mon.background_sample() is Action.NONE
    assert mon.micro_batches == 1 and not mon.events
    # a PSI snapshot (Linux, 60 % stalled and rising) with only the darwin policy on -> nothing
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0, clean_fn=lambda: None, psi=None)
    for i in range(10):
        snap = MemorySnapshot("cpu", 64 * GiB, 32 * GiB, GiB, None, 60.0 + i, None, "host", "linux",
                              1000.0 + i, pressure_kind="psi")
        mon._probe_fn = lambda cheap, s=snap: s
        assert mon.background_sample() is Action.NONE
    assert mon.micro_batches == 1 and not mon.events


# ---------------------------------------------------------------- recorded sequences, end to end

def _replay(mon, fake, clock, readings, *, steps=True):
    """Per reading: the clock at its time, a background sample, then a step sample (as a training
    loop with 0.5 s steps would interleave them). Returns the background samples' actions."""
    acts = []
    for i, r in enumerate(readings):
        clock[0] = 1000.0 + r["t"]
        fake.reading = r
        acts.append(mon.background_sample())
        if steps:
            mon.step_sample(step=i)
    return acts


def make(**kw):
    cleans = []
    kw.setdefault("grow", GrowPolicy(below=0.70, steps=3, seconds=2.0))
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0, clean_fn=lambda: cleans.append(1),
                        max_micro_batches=64, **kw)
    return mon, cleans


def test_everyday_mac_at_55_to_64_percent_is_left_alone(mac):
    """The issue's case: 55-64 % in use, rising a point every 2 s. Read as PSI this cleaned at 3 s
    and split 1 -> 32; under the darwin model it is a normal Mac."""
    fake, clock = mac
    seq = SEQ["everyday_55_to_64"]
    mon, cleans = make()
    assert set(_replay(mon, fake, clock, seq)) == {Action.NONE}
    assert mon.micro_batches == 1 and not cleans
    assert not [e for e in mon.events if e.source in ("psi", "memorystatus")]
    assert mon.last_pressure == 64.0
    # the same numbers fed to the PSI model would have acted (what the monitor did before)
    psi = PressureEpisodes(PsiPolicy())
    assert any(psi.feed(100.0 - r["memorystatus_level"], r["t"]) for r in seq)


def test_warn_with_swapping_cleans_splits_and_grows_back_after_relief(mac):
    fake, clock = mac
    mon, cleans = make()
    acts = _replay(mon, fake, clock, SEQ["warn_then_relief"])
    mac_events = [e for e in mon.events if e.source == "memorystatus"]
    # warn (swap rising 24 MiB/s, then >= 85 % in use and the kernel's warn): a clean after 3 s,
    # then a split for every further 3 s it goes on
    assert [e.action for e in mac_events] == [Action.CLEAN, Action.SPLIT, Action.SPLIT]
    assert [e.micro_batches for e in mac_events] == [1, 2, 4]
    assert "swap +24.0 MiB/s" in mac_events[0].message and "macOS warn" in mac_events[0].message
    assert acts.count(Action.CLEAN) == 1 and acts.count(Action.SPLIT) == 2
    # relief: the episode closes below 80 % in use; calm step samples grow k back to 1
    grows = [e for e in mon.events if e.action is Action.GROW]
    assert [e.micro_batches for e in grows] == [2, 1] and mon.micro_batches == 1
    assert all(e.source == "step" for e in grows)
    assert not mon.policy._mac_episodes.open


def test_no_grow_back_while_the_episode_is_open(mac):
    fake, clock = mac
    mon, _ = make()
    seq = SEQ["warn_then_relief"]
    _replay(mon, fake, clock, seq[:36])          # up to the end of the hysteresis band (82 %)
    assert mon.micro_batches == 4 and mon.policy._mac_episodes.open
    assert not [e for e in mon.events if e.action is Action.GROW]


def test_critical_acts_even_when_flat(mac):
    fake, clock = mac
    mon, cleans = make()
    acts = _replay(mon, fake, clock, SEQ["critical_flat"])
    # 7.5 s of flat critical readings: a clean after 3 s, a split after 3 s more
    assert acts.count(Action.CLEAN) == 1 and acts.count(Action.SPLIT) == 1 and mon.micro_batches == 2
    assert "macOS critical" in [e for e in mon.events if e.source == "memorystatus"][0].message


# ---------------------------------------------------------------- the policy alone

def test_episode_rules_fed_numbers():
    ep = MemorystatusEpisodes(MemorystatusPolicy(sustain_s=1.0, min_samples=3))
    assert ep.feed(84.0, 0.0) is None and not ep.open              # below warn: no episode
    assert ep.feed(86.0, 0.5) is None and ep.open                   # warn opens it
    assert ep.feed(86.0, 1.0) is None                               # flat warn: not acted on
    assert ep.feed(86.0, 1.5) is None
    assert ep.feed(87.0, 2.0)[0] == 1                               # rising for >= 1 s: clean
    assert ep.feed(81.0, 2.5) is None and ep.open                   # in the band: still open
    assert ep.feed(79.0, 3.0) is None and not ep.open               # below release: closed
    # the kernel's level alone opens one; swap activity alone too
    ep = MemorystatusEpisodes(MemorystatusPolicy())
    ep.feed(50.0, 0.0, kernel="warn")
    assert ep.open
    ep = MemorystatusEpisodes(MemorystatusPolicy())
    ep.feed(50.0, 0.0, swap_used=0)
    assert not ep.open
    ep.feed(50.0, 1.0, swap_used=8 * MiB)                           # 8 MiB/s >= 4 MiB/s
    assert ep.open and ep.swap_rate == 8 * MiB


@pytest.mark.parametrize("kw,field", [
    (dict(warn=90, critical=85), "memorystatus"),
    (dict(release=90), "memorystatus"),
    (dict(critical=101), "memorystatus"),
    (dict(swap_bytes_per_s=0), "memorystatus.swap_bytes_per_s"),
    (dict(sustain_s=-1), "memorystatus.sustain_s"),
    (dict(min_samples=0), "memorystatus.min_samples"),
    (dict(warn=float("nan")), "memorystatus.warn"),
])
def test_memorystatus_policy_validation(kw, field):
    with pytest.raises(ConfigError) as ei:
        MemorystatusPolicy(**kw)
    assert ei.value.field == field


def test_garbage_reading_is_logged_once_and_skipped(caplog):
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0, clean_fn=lambda: None)
    with caplog.at_level(logging.WARNING, logger="memguard.monitor"):
        for bad in (float("nan"), 120.0, -1.0):
            assert mon.observe_memorystatus(bad, 1.0) is Action.NONE
        assert mon.observe_memorystatus(50.0, 2.0, swap_used_bytes=-5) is Action.NONE
    assert len([r for r in caplog.records if "pressure" in r.message and "failed" in r.message]) == 1
    with pytest.raises(ConfigError):
        MemoryMonitor(1 << 40, memorystatus="yes")
