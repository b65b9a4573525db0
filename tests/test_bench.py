"""memguard bench: the matrix, the statistics and the reports (cheap; the real runs are
``python -m memguard_bench --quick`` in CI and the full bench in bench/results/)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memguard_bench.cases import CASES, build_case, select
from memguard_bench.gate import gate_failures
from memguard_bench.provenance import machine_fingerprint, reported_fingerprint
from memguard_bench.report import markdown_report
from memguard_bench.score import score
from memguard_bench.seed import seed_estimate_bytes
from memguard_bench.stats import summarize


def test_matrix_is_wide_and_names_are_unique():
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names))
    assert len(CASES) >= 30
    assert {c["backend"] for c in CASES} == {"hf", "mlx"}
    quick = select(quick=True, backends=("hf", "mlx"))
    assert 2 <= len(quick) <= 6 and all(c["quick"] for c in quick)
    archs = {c["arch"] for c in CASES}
    for a in ("smollm2-135m", "gpt2-4l", "qwen2.5-0.5b-4l", "tinyllama-2l", "mixtral-4l"):
        assert a in archs
    trains = [c["train"] for c in CASES]
    for key, val in (("method", "full"), ("optimizer", "sgd"), ("optimizer", "adafactor"), ("dtype", "bf16"),
                     ("grad_checkpoint", True), ("mixed_precision", True), ("attn_impl", "eager")):
        assert any(t[key] == val for t in trains), (key, val)


def test_select_filters_and_cuda_variants():
    sel = select(only=["gpt2"], backends=("hf",), cuda=True)
    assert sel and all("gpt2" in c["name"] for c in sel)
    assert sum(c.get("device") == "cuda" for c in sel) == len(sel) // 2


def test_summary_statistics():
    rows = [dict(name=f"c{i}", error=e) for i, e in enumerate([-0.04, 0.01, 0.02, -0.10, 0.30])]
    s = summarize(rows)
    assert s["cases"] == 5
    assert s["median_abs"] == pytest.approx(0.04)
    assert s["worst_under"] == pytest.approx(-0.10) and s["worst_under_case"] == "c3"
    assert s["worst_over"] == pytest.approx(0.30)
    assert s["p90_abs"] == pytest.approx(0.10 + 0.6 * 0.20)   # linear interpolation at rank 3.6
    assert summarize([]) == {"cases": 0}


def test_markdown_report_has_rows_summary_and_seed_column():
    rows = [dict(name="hf-a", backend="hf", counter="cpu", estimate_bytes=110 << 20, actual_bytes=100 << 20,
                 error=0.1, phase="loss", seed_estimate_bytes=50 << 20, seed_error=-0.5),
            dict(name="mlx-b", backend="mlx", failure="rc=1")]
    md = markdown_report(rows, {"cores": 2})
    assert "| hf-a | cpu | 110.0 | 100.0 | +10.0% | loss | 50.0 | -50.0% |" in md
    assert "FAILED" in md and "failed: mlx-b" in md and "ml-memguard (seed)" in md and "cores `2`" in md


def test_score_reestimates_a_saved_measurement():
    """A measurement record (as a child writes it) is scored by the current estimator."""
    import dataclasses

    from memguard_core.estimator.numbers import model_spec_from_numbers

    ms = model_spec_from_numbers(model_params=10_000_000, hidden_dim=256, num_layers=2, num_heads=4,
                                 vocab_size=1000, intermediate_size=512, model_bits=32)
    case = build_case("hf", "tiny", batch_size=2, seq_length=64)
    rec = dict(peak_bytes=500 << 20, counter="cpu", seconds=1.0, model_spec=dataclasses.asdict(ms))
    row = score(case, rec, seed=False)
    assert row["actual_bytes"] == 500 << 20 and row["estimate_bytes"] > 0
    assert row["error"] == pytest.approx((row["estimate_bytes"] - (500 << 20)) / (500 << 20))


def test_cli_lists_cases_without_running_them():
    p = subprocess.run([sys.executable, "-m", "memguard_bench", "--list", "--quick", "--backend", "hf"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert p.stdout.split() == [c["name"] for c in select(quick=True, backends=("hf",))]


def test_seed_estimate_is_bytes_or_none():
    from memguard_core.estimator.numbers import model_spec_from_numbers
    from memguard_core.estimator.specs import TrainSpec

    ms = model_spec_from_numbers(model_params=50_000_000, hidden_dim=512, num_layers=4, num_heads=8,
                                 vocab_size=32000, intermediate_size=1376, model_bits=32)
    v = seed_estimate_bytes(ms, TrainSpec(method="lora", dtype="fp32"))
    assert v is None or (isinstance(v, int) and v > 0)
    json.dumps(machine_fingerprint())


def test_gate_fails_on_an_under_estimate_or_a_high_median():
    ok = [dict(name="a", error=-0.04), dict(name="b", error=0.03), dict(name="c", error=0.01)]
    assert gate_failures(ok) == []
    under = ok + [dict(name="d", error=-0.06)]
    msgs = gate_failures(under)
    assert len(msgs) == 1 and "d under-estimated by 6.0%" in msgs[0]
    high = [dict(name=n, error=0.08) for n in "xyz"]
    assert any("median |error| 8.0%" in m for m in gate_failures(high))
    assert gate_failures([dict(name="f", failure="rc=1")]) == ["no case was scored"]
    assert gate_failures(under, max_under=0.10) == []


def test_a_reused_report_names_the_machine_that_measured():
    # bench --reuse re-scores saved measurements: the machine line is theirs, the commit the estimator's
    here = dict(os="Linux 6", machine="x86_64", cpu="AMD EPYC", cores=2, memory_total_gib=23.5, memguard_commit="b2")
    there = dict(here, cpu="Intel Xeon", memguard_commit="a1")
    all_reused = reported_fingerprint(here, there, fresh=0)
    assert all_reused["cpu"] == "Intel Xeon" and all_reused["memguard_commit"] == "b2"
    assert all_reused["measured_at_commit"] == "a1"
    mixed = reported_fingerprint(here, there, fresh=3)
    assert mixed["cpu"] == "AMD EPYC" and "Intel Xeon" in mixed["reused_measurements_from"]
    assert reported_fingerprint(here, dict(here, memguard_commit="a1"), fresh=3) == here
    assert reported_fingerprint(here, None, fresh=0) == here


def test_help_says_what_ml_memguard_is(capsys):
    from memguard_bench.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ml-memguard (the earlier estimator memguard grew from" in text



def test_a_record_s_glibc_picks_its_heap_factors(tmp_path):
    """A record measured under another glibc (``memguard bench --libc``) is scored with that
    release's CPU heap factors; a record without one (measured before records carried it) with
    the factors fitted on glibc 2.36. A --libc folder without a loader is refused before any run."""
    import dataclasses

    from memguard_bench.measure import LibcDirError, libc_loader
    from memguard_bench.score import specs_of
    from memguard_core.estimator.numbers import model_spec_from_numbers

    ms = model_spec_from_numbers(model_params=10_000_000, hidden_dim=256, num_layers=2, num_heads=4,
                                 vocab_size=1000, intermediate_size=512, model_bits=32)
    case = build_case("hf", "tiny", batch_size=2, seq_length=64)
    rec = dict(peak_bytes=500 << 20, counter="cpu", seconds=1.0, model_spec=dataclasses.asdict(ms))
    assert specs_of(case, rec)[1].glibc is None
    assert specs_of(case, dict(rec, glibc="2.41"))[1].glibc == "2.41"
    with pytest.raises(LibcDirError, match="ld-linux"):
        libc_loader(str(tmp_path))
    p = subprocess.run([sys.executable, "-m", "memguard_bench", "--quick", "--backend", "hf", "--libc", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--libc" in p.stdout + p.stderr
