"""bench/gpu_check.py, the CUDA device check of issue #35, without a GPU: its ``--dry-run`` runs every
case on tiny CPU models (OOMs raised as real ``torch.OutOfMemoryError`` by hooks, the probe and the
snapshot on memguard's fakes) and must pass and write both reports; its scoring and limit placement
on given numbers. About 35 s on a 2-core machine (one process, one thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memguard_testing.bench_scripts import load_bench_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_check.py")


@pytest.fixture(scope="module")
def gc():
    return load_bench_script("gpu_check")


def test_dry_run_passes_and_writes_both_reports(tmp_path, gc):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    names = [r["name"] for r in doc["cases"]]
    first_oom = gc.CASE_NAMES.index("oom-forward")   # the measurement runs right before the first OOM case
    assert names == gc.CASE_NAMES[:first_oom] + ["oom-measure"] + gc.CASE_NAMES[first_oom:]
    # what a short lease must reach first: the held-out estimates and the guarded runs before the rest
    assert gc.CASE_NAMES[1:1 + len(gc.HELD_OUT_CASES)] == [c["name"] for c in gc.HELD_OUT_CASES]
    assert doc["passed"] and doc["meta"]["dry_run"]
    for name in names:
        assert f"| {name} |" in md
    by = {r["name"]: r for r in doc["cases"]}
    for name in ("probe", "oom-forward", "oom-backward", "oom-eval"):
        assert by[name]["status"] == "pass" and by[name]["checks"], by[name]
    for mode in ("bare-torch", "bare-hf"):  # the twins died of a real torch.OutOfMemoryError, where placed
        assert by["oom-backward"]["detail"]["runs"][mode]["error_type"] == "OutOfMemoryError"
    qlora = by["est-qlora-llama3.2-1b"]["status"]   # bitsandbytes' CPU backend where it is installed
    assert qlora == "pass" or qlora == "skipped: bitsandbytes not importable"
    assert [s["counter"] for s in by["est-lora-llama3-8b"]["scores"]] == ["cpu", *gc.COUNTERS]
    assert "[gpu_check" in p.stdout  # progress lines
    # the guarded twins: MemGuardCallback with the in-process measurement, its cost and plan reported
    for name in ("guard-lora-llama3.2-1b", "guard-lora-qwen2.5-1.5b-ckpt", "guard-full-llama3.2-1b-amp"):
        row = by[name]
        assert row["status"] == "pass", row
        g = row["detail"]["guard"]
        assert g["probe_measured"] and g["probe_counter"] and g["probe_seconds"] > 0
        assert g["micro_batches"] == 1 and g["acted_on_bytes"] > 0 and g["no_probe_bytes"] > 0
        assert g["step_records"] and g["measurement_line"]
    assert "## Guarded runs: the in-process measurement" in md


def test_list_and_unknown_case():
    out = subprocess.run([sys.executable, SCRIPT, "--list"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "oom-backward" in out.stdout and "est-lora-llama3-8b" in out.stdout
    bad = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--cases", "nope"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "unknown case" in bad.stderr


def test_scoring_band_and_counters(gc):
    rows = gc.score_counters({"max_memory_allocated": 110, "max_memory_reserved": 85, "nvidia-smi": 100},
                             {"max_memory_allocated": 100, "max_memory_reserved": 100, "nvidia-smi": None})
    by = {r["counter"]: r for r in rows}
    assert by["max_memory_allocated"]["error"] == pytest.approx(0.10)
    assert by["max_memory_allocated"]["pass"] is True and by["max_memory_allocated"]["in_target"] is True
    assert by["max_memory_reserved"]["pass"] is False          # -15 % is under the -10 % band
    assert by["nvidia-smi"]["pass"] is None                    # not measured: not judged


def test_limits_sit_between_the_measured_peaks(gc):
    peaks = {"forward_allocated": 8 * gc.GiB, "forward_reserved": int(8.2 * gc.GiB),
             "backward_allocated": 10 * gc.GiB, "step_half_reserved": 5 * gc.GiB,
             "step_quarter_reserved": 3 * gc.GiB, "hf_train_reserved": 5 * gc.GiB, "hf_eval_allocated": 9 * gc.GiB}
    lim = gc.place_limits({"peaks": peaks})
    assert 5 * gc.GiB < lim["forward"]["limit"] < 8 * gc.GiB
    assert 8.2 * gc.GiB < lim["backward"]["limit"] < 10 * gc.GiB
    assert 5 * gc.GiB < lim["evaluation"]["limit"] < 9 * gc.GiB
    close = gc.place_limits({"peaks": dict(peaks, backward_allocated=int(8.3 * gc.GiB))})
    assert "error" in close["backward"]                        # too close to place a limit between


def test_parameter_comparison(gc):
    init = {"w": [0.0, 1.0]}
    ref = {"w": [0.1, 0.9]}
    assert gc.compare_updates(init, ref, {"w": [0.1 + 1e-6, 0.9]})["pass"]
    assert not gc.compare_updates(init, ref, {"w": [0.05, 0.95]})["pass"]   # half the update: a lost chunk
    assert not gc.compare_updates(init, ref, {"v": [0.1, 0.9]})["pass"]
