"""Guard.after_window_oom: the k to redo an accumulation window with, the free, the floor (one row
per forward, one redo after the free) and the cap (MAX_WINDOW_REDOS), and the error's plan."""

from __future__ import annotations

import pytest

from memguard_core.errors import WindowOOMError
from memguard_core.guard import Guard
from memguard_core.oom_recovery import MAX_WINDOW_REDOS
from memguard_core.options import GuardOptions

OOM = RuntimeError("DefaultCPUAllocator: can't allocate memory")


def _guard():
    return Guard(GuardOptions.from_kwargs(preflight=False, budget_bytes=2**30, monitor_interval_s=0))


def test_doubles_frees_and_counts():
    g, freed = _guard(), []
    assert g.after_window_oom(OOM, 1, 8, 3, redos=0, free=lambda: freed.append(1)) == 2
    assert g.after_window_oom(OOM, 2, 8, 3, redos=1, free=lambda: freed.append(1)) == 4
    assert g.after_window_oom(OOM, 4, 6, 3, redos=2, free=lambda: freed.append(1)) == 6   # at most the rows
    assert freed == [1, 1, 1] and g.oom_retries == 3


def test_one_redo_at_one_row_then_the_error_with_a_plan():
    g = _guard()
    assert g.after_window_oom(OOM, 8, 8, 0, redos=0, free=lambda: None) == 8
    with pytest.raises(WindowOOMError) as info:
        g.after_window_oom(OOM, 8, 8, 0, redos=1, phase="backward", free=lambda: None)
    err = info.value
    assert err.phase == "backward" and err.micro_batches == 8 and err.rows == 8 and err.redos == 1
    assert err.plan and "out of memory" in str(err) and "A plan that would fit" in str(err)
    assert err.__cause__ is OOM


def test_cap_on_consecutive_redos():
    g = _guard()
    with pytest.raises(WindowOOMError, match="times in a row"):
        g.after_window_oom(OOM, 2, 64, 0, redos=MAX_WINDOW_REDOS, free=lambda: None)


def test_another_ranks_failure_is_followed_even_at_the_floor():
    g = _guard()
    assert g.after_window_oom(None, 8, 8, 0, redos=5, free=lambda: None) == 8
    assert g.agree_redo(True) is True and g.agree_redo(False) is False   # no process group: local flag


def test_optimizer_step_error_names_the_step():
    err = _guard().optimizer_step_oom(OOM, 2, 8)
    assert isinstance(err, WindowOOMError) and err.phase == "optimizer step"
    assert "foreach=False" in str(err)
