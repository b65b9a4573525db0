"""Preflight under a tight budget, in a real HF ``Trainer`` run in a fresh process: the guard
picks a split (micro-batch 16 does not fit), the run completes with the requested effective batch
and step count, and its measured peak (VmHWM per step) stays under the budget."""

from __future__ import annotations

from memguard_testing.train_scripts import check_tight_budget_run


def test_tight_budget_picks_a_split_and_stays_under_it(tmp_path):
    # the scenario and its checks: train_scripts.check_tight_budget_run
    check_tight_budget_run("preflight_run.py", str(tmp_path), attn_impl="sdpa")
