"""A guarded full-depth run with room to spare changes nothing at preflight.

SmolLM2-135M with all 30 blocks, LoRA r=16 all-linear, pure bf16 weights, 4 x 512 tokens (2 x 128 on a
CPU without native bf16, where one emulated step of 4 x 512 takes about 9 minutes) (a real HF
``Trainer`` run in a fresh process). The guarded run measures its own peak P; at a budget where P is
70 % of it -- below the guard's warning level (85 %), which the preflight plans against -- the
estimate must leave the settings alone. An estimate that over-counts at depth (the heap slack of every block, pure-bf16 weights
counted as fp32) would halve the micro-batch here for nothing; the preflight must leave it alone."""

from __future__ import annotations

import json
import subprocess
import sys

from memguard_testing import script, script_env


def _run(budget: int, out: str) -> dict:
    p = subprocess.run([sys.executable, script("full_depth_run.py"), str(budget), out],
                       capture_output=True, text=True, timeout=900,
                       env=script_env(PYTHONUNBUFFERED="1", MEMGUARD_CALIBRATION="0"))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])


def test_room_to_spare_changes_nothing(tmp_path):
    """One guarded run with a budget far above the run (the host's RAM): the preflight keeps the
    requested settings, and the guard's own peak of the run P is compared with the estimate the
    preflight planned with (``requested_peak``: the estimate plus what the process already held).
    At a budget where P is 70 % of it, the preflight plans against ``plan_fraction`` (0.85) of that
    budget, 1.21 x P, and keeps the requested settings exactly when their estimate is within it
    (``memguard_core.plan.plan``); an over-count at depth beyond that would have split the batch
    for nothing. One run instead of an unguarded twin: the guard's per-step peaks are the run's
    own measurement."""
    import psutil

    guarded = _run(psutil.virtual_memory().total, str(tmp_path / "guarded"))
    assert guarded["layers"] == 30 and guarded["global_step"] == 1
    assert guarded["changes"] == [] and guarded["micro_batches"] == 1, guarded
    assert guarded["forward_rows"] == [guarded["rows"]] and guarded["final_micro_batches"] == 1, guarded
    peak = guarded["peak"]
    room = guarded["plan_fraction"] * peak / 0.70
    assert guarded["requested_peak"] <= room, (guarded["requested_peak"], peak)
    # the estimate is within the accuracy the gate holds the bench to: not under by more than 5 %
    assert guarded["estimate"] >= 0.95 * peak, (guarded["estimate"], peak)
