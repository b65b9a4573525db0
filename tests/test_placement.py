"""memguard_testing.placement: the bisection that places a one-rank RLIMIT_AS limit in the band
where a guarded run meets the allocator's error and gets past it. The launches are stood in for by
a band of fractions (the real launches are the FSDP integration tests'); what is under test is
which rooms are tried and what is returned."""

import pytest

from memguard_testing import placement

GROWTH = 1000


def _band(lo: float, hi: float):
    """A run that bites for rooms in [lo, hi] of GROWTH, misses above, gives up below; it records
    the rooms it was given."""
    rooms = []

    def run(room):
        rooms.append(room)
        if room > hi * GROWTH:
            return placement.MISSED, None
        if room < lo * GROWTH:
            return placement.TOO_TIGHT, None
        return placement.BIT, {"room": room}
    return run, rooms


def test_first_fraction_in_the_band_is_one_launch():
    run, rooms = _band(0.5, 0.85)
    outcome, result, tried = placement.place_limit(run, GROWTH)
    assert (outcome, result, rooms, tried) == (placement.BIT, {"room": 800}, [800], [(0.8, placement.BIT)])


def test_a_band_below_is_found_by_moving_down():
    run, rooms = _band(0.5, 0.6)
    outcome, _, tried = placement.place_limit(run, GROWTH)
    # 0.8 missed -> (0.45 + 0.8) / 2 = 0.625 missed -> (0.45 + 0.625) / 2 = 0.5375 bites
    assert rooms == [800, 625, 537] and outcome == placement.BIT
    assert [o for _, o in tried] == [placement.MISSED, placement.MISSED, placement.BIT]


def test_a_band_above_is_found_by_moving_up():
    run, rooms = _band(0.88, 0.95)
    outcome, _, _ = placement.place_limit(run, GROWTH)
    # 0.8 too tight -> 0.9 bites
    assert rooms == [800, 900] and outcome == placement.BIT


def test_no_band_stops_after_the_tries_with_the_last_outcome():
    run, rooms = _band(2.0, 3.0)
    outcome, result, tried = placement.place_limit(run, GROWTH, tries=3)
    assert outcome == placement.TOO_TIGHT and result is None and len(rooms) == len(tried) == 3
    assert rooms == [800, 900, 950]


def test_outcome_of_a_launch():
    assert placement.outcome_of(0, "", ["can't allocate memory"]) == placement.BIT
    assert placement.outcome_of(0, "", []) == placement.MISSED
    # both ranks' tracebacks, as torchrun prints them
    both = ("[rank1]: memguard_core.errors.WindowOOMError: memguard: out of memory ...\n"
            "[rank0]: memguard_core.errors.WindowOOMError: memguard: out of memory ...\n")
    assert placement.outcome_of(1, both, []) == placement.TOO_TIGHT
    with pytest.raises(AssertionError, match="Segmentation fault"):
        placement.outcome_of(139, "Segmentation fault", [])
    # one rank gave up, the other died otherwise or hung in a collective: not a placement miss
    with pytest.raises(AssertionError):
        placement.outcome_of(1, both.splitlines()[0] + "\n[rank0]: RuntimeError: gloo ...", [])
    with pytest.raises(AssertionError):
        placement.outcome_of(1, both + "Timeout (0:06:00)!\nThread 0x7f (most recent call first):", [])
