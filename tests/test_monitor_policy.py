"""The monitor's decisions alone (``memguard_core.monitor_policy``): numbers in, events out.

No thread, no probe, no /proc, no clock: every sample is fed with its time where time matters.
The same rules through ``MemoryMonitor`` (with its clean, logging and sampling) are in
test_monitor.py and test_monitor_grow.py.
"""

from __future__ import annotations

import pytest

from memguard_core.errors import ConfigError
from memguard_core.monitor_policy import MicroBatchPolicy
from memguard_core.monitor_pressure import PressureEpisodes, PsiPolicy
from memguard_core.monitor_types import Action, GrowPolicy, Level, Thresholds

GiB = 2**30
B = 10 * GiB


def policy(micro_batches=1, max_micro_batches=None, psi=None, grow=None, **kw):
    return MicroBatchPolicy(Thresholds(), micro_batches=micro_batches, max_micro_batches=max_micro_batches, psi=psi, grow=grow, **kw)


def step(pol, usage, budget=B, now=None):
    return pol.observe(int(usage * budget), budget, step=None, source="step", now=now)


def action(event):
    return Action.NONE if event is None else event.action


# ----- levels -----------------------------------------------------------------------------------

def test_levels_up_and_down_with_hysteresis_and_one_clean_per_stay():
    pol = policy()
    assert step(pol, 0.50) is None and pol.level is Level.OK
    ev = step(pol, 0.86)
    assert (ev.action, ev.level, ev.source) == (Action.LOG, Level.WARNING, "step")
    assert "memory warning: 8.60 GiB of 10.00 GiB (86% >= 85%)" == ev.message
    assert step(pol, 0.82) is None and pol.level is Level.WARNING     # inside the 5-point band
    ev = step(pol, 0.91)
    assert ev.action is Action.CLEAN and pol.level is Level.CRITICAL and pol.micro_batches == 1
    # down to warning and up again: a new stay at critical cleans again before it splits
    assert step(pol, 0.84) is None and pol.level is Level.WARNING
    assert action(step(pol, 0.91)) is Action.CLEAN
    ev = step(pol, 0.50)
    assert ev.action is Action.LOG and ev.message.startswith("memory back to normal") and pol.level is Level.OK
    assert pol.samples == 7 and pol.max_usage == pytest.approx(0.91)


def test_critical_that_persists_after_its_clean_splits_and_waits_for_the_next_peak():
    pol = policy(max_micro_batches=8)
    assert action(step(pol, 0.92)) is Action.CLEAN
    ev = step(pol, 0.92)
    assert ev.action is Action.SPLIT and pol.micro_batches == 2 and "splitting micro-batches 1 -> 2" in ev.message
    # the next step sample still read a micro-batch at k=1: no second split on it
    assert step(pol, 0.97) is None and pol.micro_batches == 2
    assert action(step(pol, 0.97)) is Action.SPLIT and pol.micro_batches == 4


def test_background_samples_only_raise_the_level():
    pol = policy()
    assert action(pol.observe(int(0.87 * B), B, step=None, source="background")) is Action.LOG
    assert pol.observe(int(0.10 * B), B, step=None, source="background") is None
    assert pol.level is Level.WARNING
    ev = pol.observe(int(0.96 * B), B, step=None, source="background")
    assert (ev.action, ev.level, ev.source, ev.micro_batches) == (Action.SPLIT, Level.EMERGENCY, "background", 2)


def test_at_max_split_a_rising_level_is_logged_once():
    pol = policy(max_micro_batches=1)
    ev = step(pol, 0.96)
    assert ev.action is Action.LOG and "cannot be split further (k=1)" in ev.message
    assert step(pol, 0.96) is None and step(pol, 0.99) is None and pol.micro_batches == 1


# ----- raise_micro_batches and request_micro_batches ------------------------------------------------------------

def test_raise_split_doubles_clamps_and_stops_at_max():
    pol = policy(micro_batches=3, max_micro_batches=10)
    assert pol.raise_micro_batches() == 3 and pol.micro_batches == 6
    assert pol.raise_micro_batches() == 6 and pol.micro_batches == 10     # 12 clamped to the rows
    assert pol.raise_micro_batches() is None and pol.micro_batches == 10
    unbounded = policy(micro_batches=5)
    assert unbounded.raise_micro_batches() == 5 and unbounded.micro_batches == 10


def test_raise_split_holds_off_the_next_split_and_restarts_the_calm_stretch():
    pol = policy(micro_batches=2, max_micro_batches=16, grow=GrowPolicy(below=0.7, steps=3, seconds=0.0), planned_micro_batches=1)
    step(pol, 0.3, now=0.0)
    step(pol, 0.3, now=1.0)
    assert pol.raise_micro_batches() == 2 and pol.micro_batches == 4
    # the stretch restarts: two more calm samples are not enough for a grow-back
    assert [action(step(pol, 0.3, now=t)) for t in (2.0, 3.0)] == [Action.NONE, Action.NONE]
    assert action(step(pol, 0.3, now=4.0)) is Action.GROW and pol.micro_batches == 2


def test_request_split_raises_to_at_least_k_and_clamps():
    pol = policy(micro_batches=2, max_micro_batches=6)
    ev = pol.request_micro_batches(4, "out of memory", step=7, budget_bytes=B)
    assert (ev.action, ev.source, ev.micro_batches, ev.step, ev.budget_bytes) == (Action.SPLIT, "request", 4, 7, B)
    assert ev.message == "split 2 -> 4: out of memory"
    assert pol.request_micro_batches(3, "smaller than k") is None and pol.micro_batches == 4
    assert pol.request_micro_batches(64, "beyond the rows").micro_batches == 6
    assert pol.request_micro_batches(64, "again") is None


def test_split_after_clean_only_when_the_predicted_peak_stays_critical():
    pol = policy(max_micro_batches=4)
    step(pol, 0.92)                                       # critical: the clean
    assert pol.micro_batches_after_clean(int(0.85 * B), B, step=3, rss_freed=GiB, live_freed=GiB) is None
    ev = pol.micro_batches_after_clean(int(0.90 * B), B, step=3, rss_freed=GiB // 10, live_freed=None)
    assert ev.action is Action.SPLIT and pol.micro_batches == 2 and ev.used_bytes == int(0.90 * B)
    assert "no live-memory counter here" in ev.message and "splitting micro-batches 1 -> 2" in ev.message
    # the next micro-batch already runs at k=2: its peak is the one measured at k=2
    step(pol, 0.60)
    assert pol.peak_at_micro_batches == {1: int(0.92 * B), 2: int(0.60 * B)}
    pol.raise_micro_batches()
    assert pol.micro_batches == 4 and pol.micro_batches_after_clean(B, B, step=4, rss_freed=0, live_freed=0) is None


# ----- PSI episodes -----------------------------------------------------------------------------

def test_episode_acts_on_sustained_rising_pressure_then_needs_a_new_window():
    eps = PressureEpisodes(PsiPolicy(threshold=10, sustain_s=1.0, min_samples=3))
    assert eps.feed(5.0, 0.0) is None and not eps.open        # under the threshold: no episode
    got = [eps.feed(p, t) for p, t in ((11.0, 1.0), (12.0, 1.5), (13.0, 2.0))]
    assert got[:2] == [None, None] and eps.open
    n, what = got[2]
    assert n == 1 and what == "memory pressure: PSI some avg10 13.0% (>= 10% for 1.0 s, rising from 11.0%)"
    assert eps.window == [(2.0, 13.0)]
    assert eps.feed(14.0, 2.5) is None                       # the new window spans 0.5 s only
    assert eps.feed(15.0, 3.0)[0] == 2


def test_episode_ignores_flat_or_falling_pressure_and_ends_below_release():
    eps = PressureEpisodes(PsiPolicy(threshold=10, sustain_s=1.0, min_samples=2, release=0.5))
    assert [eps.feed(p, t) for p, t in ((30.0, 0.0), (25.0, 1.0), (25.0, 2.0), (20.0, 3.0))] == [None] * 4
    assert eps.feed(6.0, 4.0) is None and eps.open             # 6 % >= 10 % x 0.5: still open
    assert eps.feed(4.0, 5.0) is None and not eps.open and eps.actions == 0


def test_episode_with_act_false_records_without_acting():
    eps = PressureEpisodes(PsiPolicy(threshold=10, sustain_s=0.5, min_samples=2))
    eps.feed(20.0, 0.0)
    assert eps.feed(30.0, 1.0, act=False) is None and len(eps.window) == 2
    assert eps.feed(40.0, 2.0)[0] == 1


def test_observe_pressure_cleans_then_splits_and_logs_at_max_split():
    pol = policy(max_micro_batches=2, psi=PsiPolicy(threshold=10, sustain_s=1.0, min_samples=2))
    # each action keeps its last reading as the start of the next window: one more second suffices
    readings = [(20.0, 0.0), (21.0, 0.5), (22.0, 1.0), (23.0, 2.0), (24.0, 3.0)]
    events = [pol.observe_pressure(p, t, step=5, used_bytes=GiB, budget_bytes=B) for p, t in readings]
    assert [action(e) for e in events] == [Action.NONE, Action.NONE, Action.CLEAN, Action.SPLIT, Action.LOG]
    assert events[2].source == "psi" and events[2].usage == pytest.approx(0.1) and events[2].step == 5
    assert events[2].message.endswith(": cleaning caches")
    assert "after a clean: splitting micro-batches 1 -> 2" in events[3].message
    assert "cannot be split further (k=2)" in events[4].message
    assert pol.micro_batches == 2 and pol.level is Level.OK and pol.last_pressure == 24.0


def test_observe_pressure_rejects_garbage_and_ignores_none():
    pol = policy(psi=PsiPolicy())
    assert pol.observe_pressure(None, 0.0) is None
    for bad in (float("nan"), -1.0, 101.0, "12", True):
        with pytest.raises(ValueError):
            pol.observe_pressure(bad, 0.0)
    assert pol.last_pressure is None
    assert policy(psi=None).observe_pressure(90.0, 0.0) is None     # PSI off


# ----- growing back -----------------------------------------------------------------------------

GROW = GrowPolicy(below=0.70, steps=3, seconds=10.0, backoff=2.0, max_backoff=4.0)


def test_grow_needs_both_the_samples_and_the_seconds():
    pol = policy(micro_batches=4, planned_micro_batches=2, grow=GROW)
    assert [action(step(pol, 0.3, now=t)) for t in (0.0, 1.0, 2.0, 3.0)] == [Action.NONE] * 4
    ev = step(pol, 0.3, now=10.0)
    assert ev.action is Action.GROW and pol.micro_batches == 2
    assert "for 5 micro-batches / 10.0 s; growing micro-batches back 4 -> 2" in ev.message


def test_grow_below_the_plan_needs_a_measured_proof():
    pol = policy(micro_batches=2, grow=GROW)                      # the plan's k is the starting k, 2
    for t in (0.0, 5.0):
        step(pol, 0.3, now=t)
    assert action(step(pol, 0.3, now=10.0)) is Action.NONE and pol.micro_batches == 2   # k=1 never measured
    pol.peak_at_micro_batches[1] = int(0.75 * B)                  # measured, but over `below`
    assert [action(step(pol, 0.3, now=t)) for t in (20.0, 25.0, 30.0)] == [Action.NONE] * 3
    pol.peak_at_micro_batches[1] = int(0.6 * B)
    events = [step(pol, 0.3, now=t) for t in (40.0, 45.0, 50.0)]
    assert events[:2] == [None, None] and events[2].action is Action.GROW and pol.micro_batches == 1
    assert "growing micro-batches back 2 -> 1 (predicted peak 6.00 GiB = 60%)" in events[2].message


def test_grow_back_that_peaks_at_warning_is_undone_and_backs_off():
    pol = policy(micro_batches=2, planned_micro_batches=1, grow=GROW)
    for t in (0.0, 5.0):
        step(pol, 0.3, now=t)
    ev = step(pol, 0.3, now=10.0)                         # at the plan's k: no proof needed
    assert ev.action is Action.GROW and pol.micro_batches == 1 and "no peak measured there yet" in ev.message
    ev = step(pol, 0.86, now=11.0)                        # the first micro-batch at k=1: warning
    assert ev.action is Action.SPLIT and pol.micro_batches == 2 and "grow-back undone" in ev.message
    assert "next attempt after 2x the calm stretch" in ev.message and pol._grow_failures == 1
    # k=1 peaked at 8.6 GiB; a budget twice as large (a co-tenant left) would hold it, and the
    # next attempt needs twice the stretch: 6 samples and 20 s
    times = [20.0 + i for i in range(6)]
    # (the first is back to normal from warning: a log, and calm already)
    assert [action(step(pol, 0.3, 2 * B, now=t)) for t in times] == [Action.LOG] + [Action.NONE] * 5
    assert action(step(pol, 0.3, 2 * B, now=40.0)) is Action.GROW and pol.micro_batches == 1


def test_grow_stops_at_one_and_is_off_without_a_policy():
    pol = policy(micro_batches=2, planned_micro_batches=1, grow=GrowPolicy(below=0.7, steps=1, seconds=0.0))
    assert action(step(pol, 0.3, now=0.0)) is Action.GROW and pol.micro_batches == 1
    assert [step(pol, 0.3, now=2.0 + i) for i in range(5)] == [None] * 5 and pol.micro_batches == 1
    off = policy(micro_batches=4, grow=None)
    assert [step(off, 0.1, now=float(i)) for i in range(20)] == [None] * 20 and off.micro_batches == 4


def test_an_open_psi_episode_or_a_background_escalation_breaks_the_calm():
    pol = policy(micro_batches=2, planned_micro_batches=1, grow=GrowPolicy(below=0.7, steps=2, seconds=0.0),
                 psi=PsiPolicy(threshold=10))
    assert pol.observe_pressure(30.0, 0.0) is None         # an episode opens
    assert [step(pol, 0.3, now=float(i)) for i in range(6)] == [None] * 6 and pol.micro_batches == 2
    pol.observe_pressure(1.0, 7.0)                         # below release: the episode is over
    step(pol, 0.3, now=8.0)
    pol.observe(int(0.87 * B), B, step=None, source="background")   # warning: the stretch restarts
    assert action(step(pol, 0.3, now=9.0)) is Action.LOG   # back to normal (counts as calm #1)
    assert action(step(pol, 0.3, now=10.0)) is Action.GROW


def test_predict_peak_from_measured_peaks():
    pol = policy()
    assert pol.predict_peak(2) is None
    pol.peak_at_micro_batches.update({4: int(4.5 * GiB), 8: int(2.75 * GiB)})   # 1 GiB + 14 GiB / k
    assert pol.predict_peak(4) == int(4.5 * GiB)          # measured: as measured
    assert pol.predict_peak(2) == pytest.approx(8 * GiB, rel=1e-9)
    assert pol.predict_peak(16) == pytest.approx(1.875 * GiB, rel=1e-9)


def test_grow_below_must_sit_under_warning_minus_hysteresis():
    with pytest.raises(ConfigError) as e:
        MicroBatchPolicy(Thresholds(), grow=GrowPolicy(below=0.81))
    assert e.value.field == "grow.below"
    MicroBatchPolicy(Thresholds(), grow=GrowPolicy(below=0.80))   # exactly at the band: allowed
