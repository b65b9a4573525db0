"""MemoryMonitor: levels with hysteresis, escalating actions, effective budget, robustness."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import pytest

from memguard_core.errors import ConfigError
from memguard_core.monitor import Action, Level, MemoryMonitor, Thresholds

GiB = 2**30


@dataclass
class Snap:
    """Just the fields the monitor reads from a ``MemorySnapshot``."""

    process_bytes: int
    available_bytes: int
    process_peak_bytes: int = None


def make(budget=10 * GiB, **kw):
    cleans = []
    kw.setdefault("interval_s", 0)
    mon = MemoryMonitor(budget, clean_fn=lambda: cleans.append(1), **kw)
    return mon, cleans


def test_thresholds_levels_and_hysteresis():
    t = Thresholds()
    assert t.level_for(0.5, Level.OK) == Level.OK
    assert t.level_for(0.86, Level.OK) == Level.WARNING
    assert t.level_for(0.91, Level.OK) == Level.CRITICAL
    assert t.level_for(0.96, Level.OK) == Level.EMERGENCY
    # hysteresis: staying critical until below 0.90 - 0.05
    assert t.level_for(0.87, Level.CRITICAL) == Level.CRITICAL
    assert t.level_for(0.84, Level.CRITICAL) == Level.WARNING
    assert t.level_for(0.79, Level.WARNING) == Level.OK
    assert t.level_for(0.81, Level.WARNING) == Level.WARNING


@pytest.mark.parametrize("kw,field", [
    (dict(warning=0.9, critical=0.85), "thresholds"),
    (dict(warning=1.5), "thresholds.warning"),
    (dict(hysteresis=-0.1), "thresholds.hysteresis"),
])
def test_thresholds_validate(kw, field):
    with pytest.raises(ConfigError) as e:
        Thresholds(**kw)
    assert e.value.field == field


def test_actions_escalate_log_clean_split():
    mon, cleans = make()
    assert mon.observe(int(8.6 * GiB), 10 * GiB, step=1, source="step") is Action.LOG
    assert mon.level == Level.WARNING and mon.micro_batches == 1
    assert mon.observe(int(9.1 * GiB), 10 * GiB, step=2, source="step") is Action.CLEAN
    assert cleans == [1] and mon.micro_batches == 1
    # critical again after the clean: escalate to a split
    assert mon.observe(int(9.1 * GiB), 10 * GiB, step=3, source="step") is Action.SPLIT
    assert mon.micro_batches == 2
    # the split acts at the next micro-batch, read one step sample later: no cascade before that
    assert mon.observe(int(9.6 * GiB), 10 * GiB, step=4, source="step") is Action.NONE
    assert mon.observe(int(9.6 * GiB), 10 * GiB, step=None, source="background") is Action.NONE
    assert mon.micro_batches == 2
    assert mon.observe(int(9.6 * GiB), 10 * GiB, step=5, source="step") is Action.SPLIT
    assert mon.micro_batches == 4
    assert [e.action for e in mon.events] == [Action.LOG, Action.CLEAN, Action.SPLIT, Action.SPLIT]
    assert mon.events[-1].to_dict()["level"] == "emergency"


def test_split_is_bounded_by_max_split():
    mon, _ = make(max_micro_batches=4)
    for _ in range(12):
        mon.observe(int(9.9 * GiB), 10 * GiB, step=None, source="step")
    assert mon.micro_batches == 4
    assert mon.request_micro_batches(16, "test") == 4


def test_effective_budget_shrinks_when_capacity_is_taken():
    mon, _ = make(budget=10 * GiB, safety_ratio=0.8)
    assert mon.effective_budget(Snap(4 * GiB, 20 * GiB)) == 10 * GiB
    # a co-tenant took memory: only 2 GiB left besides our 4 GiB -> 0.8 x 6 GiB
    assert mon.effective_budget(Snap(4 * GiB, 2 * GiB)) == int(6 * GiB * 0.8)


def test_step_sample_uses_the_step_peak_and_resets_it():
    peaks = [int(9.7 * GiB)]
    mon, _ = make(probe_fn=lambda cheap: Snap(3 * GiB, 50 * GiB), peak_fn=lambda: peaks.pop() if peaks else None)
    assert mon.step_sample(7) is Action.SPLIT  # 97 % of the budget -> emergency
    assert mon.micro_batches == 2 and mon.max_step_peak_bytes == int(9.7 * GiB)
    assert mon.events[-1].step == 7


def test_record_sample_records_and_the_next_step_sample_decides_on_its_peak():
    """``record_sample`` (a step's record, right after its optimizer step) decides nothing; the next
    ``step_sample``, right before the next batch, weighs that peak against the budget as it is
    then: a co-tenant that arrived in between (the available memory falling from 50 to 2 GiB)
    splits before the next forward, although nothing ran since the record."""
    avail = [50 * GiB]
    peaks = [int(1.0 * GiB), int(4.5 * GiB)]   # popped from the end: the step's peak, then the gap's
    mon, _ = make(probe_fn=lambda cheap: Snap(3 * GiB, avail[0]), peak_fn=lambda: peaks.pop() if peaks else None)
    mon.record_sample()
    assert mon.last_step_figures["peak"] == int(4.5 * GiB) and mon.micro_batches == 1 and not mon.events
    avail[0] = 2 * GiB                          # budget now 0.8 x (3 + 2) GiB = 4 GiB
    assert mon.step_sample(3) is Action.SPLIT   # 4.5 GiB carried over > 4 GiB: emergency
    assert mon.micro_batches == 2
    avail[0] = 50 * GiB
    peaks[:] = [int(1.0 * GiB)]
    mon.step_sample(4)                          # the carried peak is used once
    assert mon.last_step_figures["peak"] == int(3 * GiB)   # max(peak 1 GiB, RSS 3 GiB)


@pytest.mark.parametrize("rss_freed_gib,live_freed_gib,expect_split", [
    (0.1, 0.1, True),     # freed too little: the next peak stays at 91 %
    (1.0, 1.0, False),    # freed 1 GiB of live memory: 82 %, the clean was enough
    (1.0, 0.0, True),     # RSS fell by 1 GiB but nothing live was freed: trimmed heap / cached blocks
    (1.0, None, True),    # no live counter on this platform: the clean is credited nothing
    (0.15, 1.0, True),    # live memory freed that was not resident counts only as far as RSS fell
])
def test_critical_clean_that_frees_too_little_splits_before_the_next_micro_batch(rss_freed_gib, live_freed_gib,
                                                                                 expect_split):
    """A step peak at 92 % cleans caches; RSS and the live bytes are read around the clean (probe_fn
    and live_fn: the thinnest boundary, fake counters; tests/test_probes_linux.py checks the real
    glibc counter against malloc and malloc_trim). The next peak is predicted as 9.2 GiB minus the
    live memory freed, bounded by the RSS freed; at >= 90 % it splits now."""
    current = [5 * GiB]
    live = [4 * GiB]
    mon, cleans = make(probe_fn=lambda cheap: Snap(current[0], 50 * GiB), peak_fn=lambda: int(9.2 * GiB),
                       live_fn=lambda: None if live_freed_gib is None else live[0])

    def clean():
        cleans.append(1)
        current[0] -= int(rss_freed_gib * GiB)
        live[0] -= int((live_freed_gib or 0) * GiB)
    mon._clean_fn = clean
    action = mon.step_sample(3)
    assert cleans == [1]
    if expect_split:
        assert action is Action.SPLIT and mon.micro_batches == 2
        assert [e.action for e in mon.events] == [Action.CLEAN, Action.SPLIT]
        assert f"freed {rss_freed_gib:.2f} GiB of RSS" in mon.events[-1].message
        credited = 0 if live_freed_gib is None else min(rss_freed_gib, live_freed_gib)
        assert mon.events[-1].used_bytes == int(9.2 * GiB) - int(credited * GiB)
        # the split acts at the next micro-batch: no second split before its peak is read
        current[0] = 5 * GiB
        assert mon.step_sample(4) is Action.NONE and mon.micro_batches == 2
    else:
        assert action is Action.CLEAN and mon.micro_batches == 1
        assert [e.action for e in mon.events] == [Action.CLEAN]


def test_failing_probe_is_logged_once_and_never_raises(caplog):
    def broken(cheap):
        raise OSError("cannot read /sys/fs/cgroup/memory.max")
    mon, _ = make(probe_fn=broken)
    with caplog.at_level("WARNING", logger="memguard.monitor"):
        for _ in range(3):
            assert mon.step_sample(1) is Action.NONE
            assert mon.background_sample() is Action.NONE
    msgs = [r.message for r in caplog.records if "failed" in r.message]
    assert len(msgs) == 2  # once for the step path, once for the background path
    assert "training goes on" in msgs[0]


def test_background_thread_samples_and_stops_cleanly():
    calls = []

    def probe_fn(cheap):
        calls.append(cheap)
        return Snap(int(9.6 * GiB), 50 * GiB)

    mon = MemoryMonitor(10 * GiB, interval_s=0.01, probe_fn=probe_fn, clean_fn=lambda: None)
    with mon:
        deadline = time.time() + 5
        while mon.micro_batches < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert mon.running
    assert mon.micro_batches >= 2 and calls and not any(calls)  # background uses the full probe
    assert not mon.running
    assert not [t for t in threading.enumerate() if t.name == "memguard-monitor"]


def test_on_event_failure_does_not_break_the_monitor():
    def bad(event):
        raise ValueError("logger broke")
    mon = MemoryMonitor(10 * GiB, interval_s=0, on_event=bad, clean_fn=lambda: None)
    assert mon.observe(int(9.9 * GiB), 10 * GiB, step=1, source="step") is Action.SPLIT
    assert mon.micro_batches == 2


@pytest.mark.parametrize("kw,field", [
    (dict(budget_bytes=0), "budget_bytes"),
    (dict(budget_bytes=-5), "budget_bytes"),
    (dict(budget_bytes=GiB, interval_s=-1), "interval_s"),
    (dict(budget_bytes=GiB, micro_batches=0), "micro_batches"),
    (dict(budget_bytes=GiB, safety_ratio=1.5), "safety_ratio"),
])
def test_monitor_validates_inputs(kw, field):
    with pytest.raises(ConfigError) as e:
        MemoryMonitor(**kw)
    assert e.value.field == field


def test_background_samples_only_escalate():
    mon, _ = make()
    assert mon.observe(int(8.7 * GiB), 10 * GiB, step=None, source="background") is Action.LOG
    assert mon.level == Level.WARNING
    # the current figure drops within the step: the level stays until a step peak says otherwise
    assert mon.observe(int(5 * GiB), 10 * GiB, step=None, source="background") is Action.NONE
    assert mon.level == Level.WARNING
    assert mon.observe(int(5 * GiB), 10 * GiB, step=2, source="step") is Action.LOG
    assert mon.level == Level.OK


# ----- PSI early warning (sustained, rising pressure) ---------------------------------------------
# The pressure readings are fed as numbers: this machine cannot make the kernel stall on memory on
# demand (no swap, cgroup v1 has no per-cgroup memory.pressure). Reading PSI from the kernel's
# files is tested in test_probes_linux.py.

from memguard_core.monitor import PsiPolicy  # noqa: E402


@dataclass
class PSnap:
    process_bytes: int
    available_bytes: int
    pressure: float = None
    timestamp: float = 0.0
    process_peak_bytes: int = None


def feed(mon, readings, dt=0.5):
    """Background samples at ``dt`` s intervals with the given pressures (usage far below budget)."""
    it = iter(readings)
    clock = mon.__dict__.setdefault("_test_clock", [100.0])  # one monotonic clock per monitor

    def probe_fn(cheap):
        clock[0] += dt
        return PSnap(GiB, 50 * GiB, pressure=next(it), timestamp=clock[0])
    mon._probe_fn = probe_fn
    return [mon.background_sample() for _ in readings]


def test_psi_one_high_sample_is_not_acted_on():
    mon, cleans = make()
    actions = feed(mon, [0.0, 80.0, 0.0, 0.0, 0.0, 0.0])
    assert set(actions) == {Action.NONE} and not cleans and mon.micro_batches == 1 and not mon.events


def test_psi_sustained_rising_pressure_cleans_then_splits():
    mon, cleans = make(psi=PsiPolicy(threshold=10, sustain_s=2.0, min_samples=3))
    rising = [12, 14, 16, 18, 20, 22, 24, 26, 28, 30]
    actions = feed(mon, rising)
    # 0.5 s apart: the window spans 2 s at the 5th sample -> clean; a further 2 s -> split
    assert actions[:4] == [Action.NONE] * 4
    assert actions[4] is Action.CLEAN
    assert actions[5:8] == [Action.NONE] * 3
    assert actions[8] is Action.SPLIT and mon.micro_batches == 2
    assert cleans == [1, 1]  # the clean, and the split (which also hands back cached memory)
    psi_events = [e for e in mon.events if e.source == "psi"]
    assert [e.action for e in psi_events] == [Action.CLEAN, Action.SPLIT]
    assert "PSI some avg10" in psi_events[0].message and "rising" in psi_events[0].message
    assert mon.level == Level.OK  # the usage level is untouched: pressure is a separate signal


def test_psi_sustained_but_falling_or_flat_pressure_is_left_alone():
    mon, cleans = make(psi=PsiPolicy(threshold=10, sustain_s=1.0, min_samples=3))
    assert set(feed(mon, [40, 38, 35, 30, 25, 20, 15, 12])) == {Action.NONE}
    assert set(feed(mon, [20.0] * 8)) == {Action.NONE}
    assert not cleans and mon.micro_batches == 1


def test_psi_episode_ends_below_the_release_level_and_restarts():
    mon, cleans = make(psi=PsiPolicy(threshold=10, sustain_s=1.0, min_samples=3, release=0.5))
    # rising for 1 s -> clean; pressure drops below 5 % -> episode over; a new episode cleans again
    actions = feed(mon, [11, 12, 13, 2, 11, 12, 13])
    assert actions == [Action.NONE, Action.NONE, Action.CLEAN, Action.NONE, Action.NONE, Action.NONE,
                       Action.CLEAN]
    assert cleans == [1, 1] and mon.micro_batches == 1
    # a dip into the hysteresis band (>= 5 %) does not end the episode: the next window splits
    assert feed(mon, [7, 12, 14]) == [Action.NONE, Action.NONE, Action.SPLIT]
    assert mon.micro_batches == 2


def test_psi_absent_or_garbage_is_skipped_and_logged_once(caplog):
    mon, cleans = make(psi=PsiPolicy(threshold=10, sustain_s=0.5, min_samples=2))
    with caplog.at_level("WARNING", logger="memguard.monitor"):
        assert set(feed(mon, [None] * 4 + [float("nan"), -3.0, 250.0, "12"])) == {Action.NONE}
    assert [r for r in caplog.records if "pressure" in r.message and "failed" in r.message].__len__() == 1
    assert not cleans and mon.micro_batches == 1


def test_psi_off_and_usage_action_takes_precedence():
    mon, cleans = make(psi=None)
    assert set(feed(mon, [50, 60, 70, 80, 90, 95])) == {Action.NONE}
    # with PSI on, a sample whose usage already triggered an action does not also act on pressure
    mon, cleans = make(psi=PsiPolicy(threshold=10, sustain_s=0.5, min_samples=2))
    clock = [0.0]

    def probe_fn(cheap):
        clock[0] += 0.5
        return PSnap(int(9.9 * GiB), 50 * GiB, pressure=20.0 + clock[0], timestamp=clock[0])
    mon._probe_fn = probe_fn
    assert mon.background_sample() is Action.SPLIT          # usage 99 %: emergency
    assert [e.source for e in mon.events] == ["background"]  # the PSI reading was only recorded
    assert mon.last_pressure == 20.5


@pytest.mark.parametrize("kw,field", [
    (dict(threshold=0), "psi.threshold"),
    (dict(threshold=101), "psi.threshold"),
    (dict(sustain_s=-1), "psi.sustain_s"),
    (dict(min_samples=0), "psi.min_samples"),
    (dict(release=0), "psi.release"),
])
def test_psi_policy_validates(kw, field):
    with pytest.raises(ConfigError) as e:
        PsiPolicy(**kw)
    assert e.value.field == field


def test_a_split_also_cleans():
    mon, cleans = make()
    assert mon.observe(int(9.9 * GiB), 10 * GiB, step=1, source="step") is Action.SPLIT
    assert cleans == [1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the real Linux probe")
def test_background_reads_only_psi_while_step_samples_are_fresh(monkeypatch):
    # the real Linux probe and PSI reader, counted (each call goes through to the real one)
    from memguard_core import monitor as monitor_mod
    from memguard_core.probes import linux
    from memguard_core.probes.linux import psi as lpsi

    calls = {"full": 0, "cheap": 0, "psi": 0}
    real_probe, real_pressure = linux.probe, lpsi.pressure

    def counted_probe(cheap=False, **kw):
        calls["cheap" if cheap else "full"] += 1
        return real_probe(cheap, **kw)

    def counted_pressure():
        calls["psi"] += 1
        return real_pressure()

    monkeypatch.setattr(linux, "probe", counted_probe)
    monkeypatch.setattr(linux, "pressure", counted_pressure)
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0.3)
    mon.background_sample()                       # no step sample yet: a full one
    assert calls == {"full": 1, "cheap": 0, "psi": 0}
    mon.prime()
    mon.step_sample(0)
    mon.background_sample()                       # one step sample: its period is unknown, a full one
    assert (calls["full"], calls["psi"]) == (2, 0)
    mon.step_sample(1)                            # steps much shorter than the interval
    assert mon.background_sample() is Action.NONE  # the step path is fresh: PSI only
    assert (calls["full"], calls["psi"]) == (2, 1)
    if real_pressure() is not None:               # fed to the PSI policy (kernels with PSI)
        assert isinstance(mon.last_pressure, float)
    time.sleep(0.35)                              # no step sample for longer than the interval
    mon.background_sample()
    assert (calls["full"], calls["psi"]) == (3, 1)
    mon.step_sample(2)                            # a step of 0.35 s: longer than half the interval,
    mon.background_sample()                       # so the background samples stay full ones
    assert (calls["full"], calls["psi"]) == (4, 1)
    mon.step_sample(3)
    mon._last_full -= monitor_mod.FULL_SAMPLE_MAX_AGE_S  # short steps, but the last full sample is too old
    mon.background_sample()
    assert (calls["full"], calls["psi"]) == (5, 1)
