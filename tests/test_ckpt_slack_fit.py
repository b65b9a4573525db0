"""bench/fit_checkpointed_slack.py scores candidates arithmetically from each case's live set; these
check that arithmetic against the estimator itself on the small matrix's saved checkpointed cases,
and bench/ckpt_depth_curve.py's slack-needed column."""

import functools
import json
import os

import pytest

from memguard_bench.score import specs_of
from memguard_core.estimator.estimate import estimate
from memguard_testing.bench_scripts import load_bench_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F = load_bench_script("fit_checkpointed_slack")


@functools.lru_cache(maxsize=None)
def _checkpointed_cases(limit=4):
    with open(os.path.join(ROOT, "bench", "results", "bench_cpu.json")) as f:
        saved = json.load(f)
    out = []
    for c in saved["cases"]:
        case, rec = c["case"], c.get("measured") or {}
        if case.get("backend") == "hf" and case["train"].get("grad_checkpoint") and "peak_bytes" in rec:
            ms, ts = specs_of(case, rec)
            out.append((c["name"], ms, ts, int(rec["peak_bytes"])))
            if len(out) == limit:
                break
    return tuple(out)


def _code_constants():
    return {(n, k): F.get(n, k) for n, k, _ in F.KNOBS}


def test_the_arithmetic_estimate_is_the_estimators():
    cases = _checkpointed_cases()
    assert {c[2].method for c in cases} == {"lora", "full"}
    for case in cases:
        assert F.modelled(F.parts(case), _code_constants()) == pytest.approx(
            estimate(case[1], case[2]).peak_bytes, abs=2), case[0]


def test_the_intercept_adds_one_blocks_traffic_at_a_lora_peak():
    # a LoRA case peaks at the loss moment, where the checkpointed slack is the same as at every
    # other moment: an intercept of 1.0 adds exactly one block's traffic to the estimate
    case = next(c for c in _checkpointed_cases() if c[2].method == "lora")
    p = F.parts(case)
    c = _code_constants()
    base = F.modelled(p, c)
    c[("CPU_HEAP_SLACK_CHECKPOINTED_FIRST_BLOCKS", "lora")] = 1.0
    assert F.modelled(p, c) == pytest.approx(base + p[2], abs=2)
    assert p[2] > 0


def test_depth_curve_row_reads_the_needed_slack():
    D = load_bench_script("ckpt_depth_curve")
    mib = 1 << 20
    fields = ["step", "where", "t_s", "rss", "rss_anon", "heap_in_use", "heap_free", "heap_mmapped", "heap_arena"]

    def s(step, where, free, arena):
        return [step, where, 0.0, 0, 0, 0, free * mib, 0, arena * mib]

    d = dict(layers=4, sample_fields=fields,
             steps=[dict(step=1, vm_hwm=900 * mib), dict(step=2, vm_hwm=1000 * mib)],
             samples=[s(1, "step_begin", 1, 100), s(1, "step_end", 150, 300), s(2, "step_begin", 150, 300),
                      s(2, "post:model", 140, 300), s(2, "step_end", 150, 300)],
             estimate=dict(peak_bytes=1100 * mib, breakdown=dict(allocator_slack=400 * mib)))
    # the last step's VmHWM less the estimate's live set (1100 - 400 MiB): 300 MiB needed
    assert D.row(d) == [4, 300, 150, 140, 1000, 1100, 400, 300]
