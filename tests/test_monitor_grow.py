"""MemoryMonitor grow-back: k halves again after a calm stretch, is undone at once when pressure
returns, backs off exponentially (no oscillation), and respects the preflight plan's k.

Samples are fed through ``observe`` as numbers (the monitor's input); the real-run version with a
co-tenant in a real cgroup is integration_tests/test_grow_back.py.
"""

from __future__ import annotations

import pytest

from memguard_core.errors import ConfigError
from memguard_core.monitor import Action, GrowPolicy, MemoryMonitor, PsiPolicy, Thresholds

GiB = 2**30
B = 10 * GiB


def make(micro_batches=1, grow=GrowPolicy(below=0.70, steps=3, seconds=0.0), **kw):
    kw.setdefault("interval_s", 0)
    return MemoryMonitor(B, clean_fn=lambda: None, micro_batches=micro_batches, grow=grow, psi=None, **kw)


def step(mon, usage, budget=B):
    return mon.observe(int(usage * budget), budget, step=None, source="step")


def test_grows_back_one_halving_per_calm_stretch_to_one():
    mon = make(micro_batches=1, max_micro_batches=8)
    step(mon, 0.50)                                     # peak at k=1: 50 %
    mon.request_micro_batches(4, "test: pressure")              # e.g. an OOM retry
    acts = [step(mon, 0.30) for _ in range(3)]
    assert acts == [Action.NONE, Action.NONE, Action.GROW] and mon.micro_batches == 2
    assert [step(mon, 0.40) for _ in range(3)] == [Action.NONE, Action.NONE, Action.GROW]
    assert mon.micro_batches == 1
    assert [step(mon, 0.45) for _ in range(10)] == [Action.NONE] * 10   # k=1: nothing to grow
    grows = [e for e in mon.events if e.action is Action.GROW]
    assert [e.micro_batches for e in grows] == [2, 1] and "growing micro-batches back 4 -> 2" in grows[0].message


def test_no_grow_while_usage_is_above_the_lower_threshold():
    mon = make(micro_batches=2, planned_micro_batches=1)
    step(mon, 0.30)
    for _ in range(20):
        assert step(mon, 0.75) is Action.NONE           # below warning but above `below`: not calm
    assert mon.micro_batches == 2
    # the stretch is consecutive: one sample above `below` restarts it
    assert [step(mon, 0.3), step(mon, 0.3), step(mon, 0.75), step(mon, 0.3), step(mon, 0.3)] == [Action.NONE] * 5
    assert step(mon, 0.3) is Action.GROW


def test_seconds_are_needed_too(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("memguard_core.monitor_policy.time.monotonic", lambda: clock[0])
    mon = make(micro_batches=2, planned_micro_batches=1, grow=GrowPolicy(below=0.7, steps=2, seconds=10.0))
    for _ in range(5):
        assert step(mon, 0.3) is Action.NONE            # enough samples, no time has passed
    clock[0] += 10.0
    assert step(mon, 0.3) is Action.GROW and mon.micro_batches == 1


def test_grow_that_brings_pressure_back_is_undone_at_once_and_backs_off():
    mon = make(micro_batches=1, max_micro_batches=8)
    mon.request_micro_batches(2, "test")                        # no peak at k=1 known: prediction None
    for _ in range(3):
        step(mon, 0.40)
    assert mon.micro_batches == 1                               # grew back 2 -> 1
    # the first micro-batch at k=1 peaks at 90 % (>= warning 85 %): undone on this very sample
    assert step(mon, 0.90) is Action.SPLIT and mon.micro_batches == 2
    assert "grow-back undone" in mon.events[-1].message
    # now the peak at k=1 is known (90 %): with the budget unchanged it is never retried
    for _ in range(40):
        step(mon, 0.40)
    assert mon.micro_batches == 2 and [e.action for e in mon.events].count(Action.GROW) == 1


def test_backoff_doubles_the_stretch_after_each_failed_grow():
    mon = make(micro_batches=2, planned_micro_batches=1, max_micro_batches=8)
    step(mon, 0.40)                                     # peak at k=2
    history = []
    budget = B
    for attempt in range(3):
        n = 0
        while mon.micro_batches == 2:
            n += 1
            step(mon, 0.40, budget)
            assert n < 100
        history.append(n)
        # k=1 peaks at warning: undone. The next budget is larger so the measured peak at k=1
        # would fit again (a co-tenant that comes and goes): only the backoff spaces the attempts.
        assert step(mon, 0.86, budget) is Action.SPLIT and mon.micro_batches == 2
        budget = int(budget * 1.3)
    # steps x 2^failures (the first stretch includes the sample before the loop)
    assert history == [2, 6, 12]


def test_split_soon_after_a_grow_counts_as_failure():
    mon = make(micro_batches=2, planned_micro_batches=1, max_micro_batches=8)
    for _ in range(3):
        step(mon, 0.40)
    assert mon.micro_batches == 1
    step(mon, 0.60)                                     # probation passed (below warning)
    step(mon, 0.96)                                     # emergency two samples later: split
    assert mon.micro_batches == 2 and mon._grow_failures == 1


def feed_k(mon, base, per_row, n):
    """``n`` step samples whose peak follows peak(k) = base + per_row / k (GiB), at the current k."""
    for _ in range(n):
        step(mon, (base + per_row / mon.micro_batches) * GiB / B)


def test_never_below_the_plan_without_measured_proof():
    mon = make(micro_batches=4, max_micro_batches=8)                    # planned_micro_batches defaults to the start k
    feed_k(mon, 1.0, 14.0, 30)
    assert mon.micro_batches == 4                               # one k measured: no proof, no grow
    mon.request_micro_batches(8, "test")
    feed_k(mon, 1.0, 14.0, 30)
    # back to the plan's k=4 at once (no proof needed there); below it the fit through the peaks at
    # k=4 (4.5 GiB) and k=8 (2.75 GiB) predicts 8 GiB at k=2: over 70 % of 10 GiB, so k stays 4
    assert mon.micro_batches == 4 and [e.micro_batches for e in mon.events if e.action is Action.GROW] == [4]
    assert mon.predict_peak(2) == pytest.approx(8 * GiB, rel=1e-6)

    mon = make(micro_batches=4, max_micro_batches=8)                    # a small per-row part: proof that k=2 fits
    feed_k(mon, 1.0, 4.0, 1)
    mon.request_micro_batches(8, "test")
    feed_k(mon, 1.0, 4.0, 30)
    assert mon.micro_batches == 1                               # 8 -> 4 -> 2 (3 GiB) -> 1 (5 GiB predicted)
    assert [e.micro_batches for e in mon.events if e.action is Action.GROW] == [4, 2, 1]
    assert "predicted peak 3.00 GiB" in [e.message for e in mon.events if e.action is Action.GROW][1]


def test_grow_never_above_the_rows_and_off_when_disabled():
    mon = make(micro_batches=3, max_micro_batches=3, planned_micro_batches=1)
    for _ in range(3):
        step(mon, 0.2)
    assert mon.micro_batches == 1                               # 3 // 2 = 1
    mon = make(micro_batches=4, grow=None)
    for _ in range(50):
        step(mon, 0.1)
    assert mon.micro_batches == 4


def test_background_escalation_and_psi_episode_break_the_calm():
    mon = make(micro_batches=2, planned_micro_batches=1)
    step(mon, 0.3)
    step(mon, 0.3)
    mon.observe(int(0.87 * B), B, step=None, source="background")   # escalates to warning
    assert step(mon, 0.3) is Action.LOG                 # back to normal; the stretch restarted
    assert step(mon, 0.3) is Action.NONE and mon.micro_batches == 2
    assert step(mon, 0.3) is Action.GROW and mon.micro_batches == 1
    # an open PSI episode (sustained pressure readings) also keeps k where it is
    mon = MemoryMonitor(B, clean_fn=lambda: None, micro_batches=2, planned_micro_batches=1, interval_s=0,
                        grow=GrowPolicy(below=0.70, steps=3, seconds=0.0), psi=PsiPolicy(threshold=10))
    assert mon.observe_pressure(30.0, 1.0) is Action.NONE   # an episode opens (one reading)
    for _ in range(10):
        step(mon, 0.3)
    assert mon.micro_batches == 2


@pytest.mark.parametrize("kw,field", [
    (dict(below=0.0), "grow.below"), (dict(below=1.2), "grow.below"), (dict(steps=0), "grow.steps"),
    (dict(seconds=-1), "grow.seconds"), (dict(backoff=1.0), "grow.backoff"),
    (dict(max_backoff=0.5), "grow.max_backoff"),
])
def test_grow_policy_validates(kw, field):
    with pytest.raises(ConfigError) as e:
        GrowPolicy(**kw)
    assert e.value.field == field


def test_below_must_sit_under_warning_minus_hysteresis():
    with pytest.raises(ConfigError) as e:
        MemoryMonitor(B, grow=GrowPolicy(below=0.82), thresholds=Thresholds(), interval_s=0)
    assert e.value.field == "grow.below"
    with pytest.raises(ConfigError) as e:
        MemoryMonitor(B, planned_micro_batches=0, interval_s=0)
    assert e.value.field == "planned_micro_batches"
