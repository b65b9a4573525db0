"""Preflight under a tight budget, in a real HF ``Trainer`` run in a fresh process: the guard
picks a split (micro-batch 16 does not fit), the run completes with the requested effective batch
and step count, and its measured peak (VmHWM per step) stays under the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from memguard_core.estimate import estimate
from memguard_core.spec import TrainSpec, model_spec_from_hf_config

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(model_type="llama", vocab_size=16384, hidden_size=256, intermediate_size=688,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")


def test_tight_budget_picks_a_split_and_stays_under_it(tmp_path):
    ms = model_spec_from_hf_config(CONFIG)
    requested = TrainSpec(batch_size=16, seq_length=256, method="full", optimizer="adamw", dtype="fp32",
                          attn_impl="sdpa", device="cpu")
    # a budget where micro-batch 4 with checkpointing fits below the guard's warning level (85 %,
    # which the preflight plans against) and 16 does not fit at all; the planner takes whichever
    # combination of split and checkpointing that fits it predicts fastest
    lo = estimate(ms, requested.replace(batch_size=4, grad_accum=4, grad_checkpoint=True)).peak_bytes
    full = estimate(ms, requested).peak_bytes
    budget = int(lo / 0.85 * 1.03)
    assert budget < full
    proc = subprocess.run([sys.executable, os.path.join(HERE, "preflight_run.py"), str(budget), str(tmp_path)],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    assert r["requested_peak"] > budget and r["planned_peak"] <= 0.85 * budget
    # a split (with or without checkpointing, whichever the planner predicts faster), deeper when the
    # memory the fresh process already holds beyond runtime and weights is counted, as preflight does
    assert r["split_factor"] >= 2
    assert max(r["forward_rows"]) <= 16 // r["split_factor"]
    assert r["global_step"] == 3 and r["samples_per_step"] == [16, 16, 16]
    assert r["measured_peak"] < budget, (
        f"measured {r['measured_peak'] / 2**20:.0f} MiB >= budget {budget / 2**20:.0f} MiB; events: {r['events']}")
