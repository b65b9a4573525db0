"""Preflight under a tight budget in a real Lightning fit in a fresh process: the guard picks a split
(micro-batch 16 does not fit), the fit completes with the requested samples per optimizer step and
step count, and its measured peak (VmHWM per step) stays under the budget."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from memguard_testing.train_scripts import check_tight_budget_run  # noqa: E402


def test_lightning_tight_budget_picks_a_split_and_stays_under_it(tmp_path):
    # the scenario and its checks: train_scripts.check_tight_budget_run
    check_tight_budget_run("lightning_preflight_run.py", str(tmp_path), framework="lightning")
