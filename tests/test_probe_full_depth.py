"""The pure parts of bench/probe_full_depth.py: reading the guard's in-process measurement line (as
``probe_fit.fit_probe`` writes it, so a change of its format fails here), the per-step peaks of an
event log (as ``memguard_core.events.EventLog`` writes it), the error and its summary. No run is
timed or trained here."""

from __future__ import annotations

import pytest

from memguard_testing.bench_scripts import load_bench_script

from memguard_core.estimator import probe_fit as pf
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.numbers import model_spec_from_numbers
from memguard_core.estimator.specs import MiB, TrainSpec
from memguard_core.events import RUN_ID_ENV, EventLog, read_events

MS = model_spec_from_numbers(135_000_000, 576, 30, 9, num_kv_heads=3, vocab_size=49152, intermediate_size=1536,
                             tie_word_embeddings=True, model_bits=32)
TS = TrainSpec(batch_size=2, seq_length=1024, method="full", dtype="fp32", framework="torch", device="cpu")


@pytest.fixture(scope="module")
def bench():
    return load_bench_script("probe_full_depth")


def _probe(scale: float, seconds: float = 12.34) -> pf.ProbeResult:
    """Steps reading ``scale`` x the estimate's step at 1 x 256 and 1 x 512 tokens over 500 MiB held."""
    steps = []
    for tokens in (256, 512):
        e = estimate(MS, pf.probe_train_spec(TS, 1, tokens))
        step = max(sum(v for k, v in pf.step_parts(e, m).items() if k != "held") for m in pf.STEP_MOMENTS)
        steps.append(pf.ProbeStep(1, tokens, 500 * MiB, 500 * MiB + int(step * scale), 0, seconds / 2))
    return pf.ProbeResult(True, "cpu", "VmHWM", tuple(steps), seconds)


def test_the_fit_line_is_read_back(bench):
    fit = pf.correct_estimate(MS, TS, _probe(1.3))
    assert fit.applied
    got = bench.parse_probe_line(fit.explanation)
    assert got["measured"] and got["applied"]
    assert (got["steps"], got["sizes"], got["counter"], got["seconds"]) == (2, "1 x 256, 1 x 512 tokens", "VmHWM", 12.3)
    assert got["ratio"] > 1.0 and "fixed_mib" in got
    before, after = got["peak_gib"]
    assert before == pytest.approx(fit.estimate_peak_bytes / 2**30, abs=0.006)
    assert after == pytest.approx(fit.peak_bytes / 2**30, abs=0.006)


def test_a_cpu_factor_below_one_reads_as_not_applied(bench):
    fit = pf.correct_estimate(MS, TS, _probe(0.6))
    assert fit.peak_bytes < fit.estimate_peak_bytes
    # the line the guard logs for it (guard_preflight.PreflightMoment._measure)
    line = f"{fit.explanation}; not applied: a CPU reading only raises the estimate"
    got = bench.parse_probe_line(line)
    assert got["measured"] and not got["applied"]
    assert got["peak_gib"][1] < got["peak_gib"][0]


def test_a_bounded_ratio_and_the_unmeasured_lines(bench):
    got = bench.parse_probe_line("measured 1 forward+backward step (1 x 256 tokens) in 0.3 s (VmHWM): "
                                 "per-token x4.00 (bounded; read x6.31), fixed -2 MiB; peak 0.58 -> 0.70 GiB")
    assert (got["steps"], got["ratio"], got["ratio_read"], got["fixed_mib"]) == (1, 4.0, 6.31, -2)
    assert bench.parse_probe_line("in-process measurement not run: about 20 s on a CPU") == {"measured": False}
    kept = bench.parse_probe_line("measured 1 forward+backward step (1 x 256 tokens) in 0.1 s (VmHWM): "
                                  "nothing above the held memory, estimate kept")
    assert kept["measured"] and not kept["applied"]
    with pytest.raises(ValueError, match="^line: "):
        bench.parse_probe_line(None)


def test_step_peaks_from_an_event_log(bench, tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_ID_ENV, "r1")   # EventLog sets it for the process otherwise
    log = EventLog(str(tmp_path), run_id="r1", device="cpu", budget_bytes=10 * 2**30)
    log.step(1, peak_bytes=3 * 2**30, current_bytes=2**30, budget_bytes=10 * 2**30, micro_batches=1)
    log.decision("split", "memguard: split", step=1)
    log.step(2, peak_bytes=4 * 2**30, current_bytes=2**30, budget_bytes=10 * 2**30, micro_batches=2)
    log.step(2, peak_bytes=2 * 2**30, current_bytes=2**30, budget_bytes=10 * 2**30, micro_batches=2)  # the end's
    log.close(micro_batches=2)
    recs = read_events(log.path)
    assert bench.step_peaks(recs) == {1: {"peak_bytes": 3 * 2**30, "micro_batches": 1},
                                      2: {"peak_bytes": 4 * 2**30, "micro_batches": 2}}
    with pytest.raises(ValueError, match="^peak_bytes: "):
        bench.step_peaks([{"type": "step", "step": 1, "peak_bytes": "3 GiB"}])


def test_error_and_summary(bench):
    assert bench.error(105, 100) == pytest.approx(0.05)
    assert bench.error(None, 100) is None and bench.error(100, 0) is None
    rows = [{"case": "a", "e": 0.02}, {"case": "b", "e": -0.08}, {"case": "c", "e": 0.05}, {"case": "d", "e": None}]
    s = bench.summarise(rows, "e")
    assert (s["cases"], s["within"], s["outside"]) == (3, 2, ["b"])
    assert s["median_abs"] == pytest.approx(0.05) and s["max_abs"] == pytest.approx(0.08)
    assert s["worst_under"] == pytest.approx(-0.08)
    assert bench.summarise([], "e")["cases"] == 0


def test_the_report_names_every_run_its_records_came_from(bench):
    meta = {"date": "2026-11-29", "machine": "x86_64 2 cores, memguard f1a1aad",
            "reused_from": {"date": "2026-11-29", "machine": "x86_64 2 cores, memguard c8daa9e",
                            "reused_from": {"date": "2026-11-28", "machine": "x86_64 2 cores, memguard c6507e1",
                                            "reused_from": {"date": "2026-11-28",
                                                            "machine": "x86_64 2 cores, memguard c6507e1"}}}}
    assert bench.runs_of(meta) == [("2026-11-28", ["c6507e1"]), ("2026-11-29", ["c8daa9e", "f1a1aad"])]
    assert bench.runs_of({"date": "2026-11-30", "machine": "x86_64"}) == [("2026-11-30", ["?"])]
