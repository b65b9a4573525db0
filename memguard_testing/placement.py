"""Placing a one-rank address-space limit (``RLIMIT_AS``) where a guarded run meets the allocator's
own error and can still get past it.

The limit is a room above the rank's VmSize at train start, taken as a fraction of what an unlimited
reference run added to its VmPeak. The room that works is a band: above it the unsplit run fits
(no error, nothing tested); below it even one row per forward fails (the guard gives up with
``WindowOOMError``, as it should). The band moves between runs and machines, so a single fixed
fraction misses it now and then on one side or the other. What the tests
check is the behaviour under a real out-of-memory error, not the placement: :func:`place_limit`
bisects the band until one run lands in it.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

#: A run's outcome at one room: the guarded run met the allocator's error and finished ...
BIT = "bit"
#: ... met no error (the room is above the band) ...
MISSED = "missed"
#: ... or gave up at one row per forward (the room is below the band).
TOO_TIGHT = "too-tight"

#: What each rank's traceback ends in when the guard cannot redo a window finer: the run's room was
#: below the band.
GAVE_UP = "WindowOOMError: "
#: What ``faulthandler.dump_traceback_later`` (the workers' hang watchdog) prints first.
HANG = "Timeout ("


def outcome_of(rc: int, log: str, errors: list, ranks: int = 2) -> str:
    """The outcome of one guarded launch: ``rc`` its return code, ``log`` its output, ``errors`` the
    failing rank's recorded allocator errors (empty when it met none), ``ranks`` the world size.

    Raises:
        AssertionError: the launch failed for any other reason than every rank giving up alike
            (each of the ``ranks`` tracebacks ends in ``WindowOOMError``, and no rank hung: a rank
            left in a collective is what these tests exist to catch); the log's tail is in the
            message.
    """
    if rc != 0:
        assert log.count(GAVE_UP) >= ranks and HANG not in log, log[-6000:]
        return TOO_TIGHT
    return BIT if errors else MISSED


def place_limit(run: Callable[[int], Tuple[str, Any]], growth: int, first: float = 0.8,
                low: float = 0.45, high: float = 1.0, tries: int = 4) -> Tuple[str, Any, list]:
    """Run ``run(room_bytes)`` at ``first * growth``, then bisect the fraction between ``low`` and
    ``high`` (moving down after :data:`MISSED`, up after :data:`TOO_TIGHT`) until an outcome is
    :data:`BIT` or ``tries`` launches are spent.

    Args:
        run: launches the guarded run with that much room (bytes) on the limited rank; returns
            ``(outcome, result)``, outcome one of :data:`BIT`, :data:`MISSED`, :data:`TOO_TIGHT`.
        growth: what the unlimited reference added to that rank's VmPeak, bytes (> 0).

    Returns:
        ``(outcome, result, tried)``: the last launch's outcome and result, and every
        ``(fraction, outcome)`` tried, for the assertion message.
    """
    assert growth > 0 and tries > 0 and low <= first <= high, (growth, tries, low, first, high)
    fraction, tried = first, []
    while True:
        outcome, result = run(int(fraction * growth))
        tried.append((round(fraction, 3), outcome))
        if outcome == BIT or len(tried) == tries:
            return outcome, result, tried
        if outcome == MISSED:
            high = fraction
        else:
            low = fraction
        fraction = (low + high) / 2
