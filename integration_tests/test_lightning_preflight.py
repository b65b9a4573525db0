"""Preflight under a tight budget in a real Lightning fit in a fresh process: the guard picks a split
(micro-batch 16 does not fit), the fit completes with the requested samples per optimizer step and
step count, and its measured peak (VmHWM per step) stays under the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("lightning")

from memguard_core.estimate import estimate  # noqa: E402
from memguard_core.spec import TrainSpec, model_spec_from_hf_config  # noqa: E402
from test_hf_preflight import CONFIG  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def test_lightning_tight_budget_picks_a_split_and_stays_under_it(tmp_path):
    ms = model_spec_from_hf_config(CONFIG)
    requested = TrainSpec(batch_size=16, seq_length=256, method="full", optimizer="adamw", dtype="fp32",
                          framework="lightning", device="cpu")
    lo = estimate(ms, requested.replace(batch_size=4, grad_accum=4, grad_checkpoint=True)).peak_bytes
    budget = int(lo / 0.85 * 1.03)
    assert estimate(ms, requested).peak_bytes > budget
    proc = subprocess.run([sys.executable, os.path.join(HERE, "lightning_preflight_run.py"), str(budget),
                           str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    assert r["requested_peak"] > budget and r["planned_peak"] <= 0.85 * budget
    # a split (with or without checkpointing, whichever the planner predicts faster), deeper when the
    # memory the fresh process already holds beyond runtime and weights is counted, as preflight does
    assert r["split_factor"] >= 2
    assert max(r["forward_rows"]) <= 16 // r["split_factor"]
    assert r["global_step"] == 3 and r["samples_per_step"] == [16, 16, 16]
    assert r["measured_peak"] < budget, (
        f"measured {r['measured_peak'] / 2**20:.0f} MiB >= budget {budget / 2**20:.0f} MiB; events: {r['events']}")
