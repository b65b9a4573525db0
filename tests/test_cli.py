"""The ``memguard`` CLI: the JSON contract of ``estimate`` and clear errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memguard_core.cli import main

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
SMOL = os.path.join(CONFIGS, "smollm2-135m.json")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_contract(capsys):
    code, out, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "4", "--seq-length", "256",
                       "--method", "lora", "--json")
    assert code == 0
    d = json.loads(out)
    assert isinstance(d["peak_bytes"], int) and d["peak_bytes"] > 0
    assert all(isinstance(v, int) for v in d["breakdown"].values())
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    assert d["counter"] == "cpu"


def test_estimate_grows_with_batch_and_plans_against_a_budget(capsys):
    _, out4, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "4", "--json")
    _, out8, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "8", "--json")
    p4, p8 = json.loads(out4)["peak_bytes"], json.loads(out8)["peak_bytes"]
    assert p8 > p4
    budget_gib = (p4 + p8) / 2 / 2**30
    code, out, _ = run(capsys, "estimate", "--config", SMOL, "--batch-size", "8", "--json",
                       "--budget-gib", f"{budget_gib:.4f}")
    d = json.loads(out)
    assert code == 0 and d["fits"] is False
    assert d["plan"]["peak_bytes"] <= d["budget_bytes"]
    assert d["plan"]["changes"]


def test_estimate_from_plain_numbers(capsys):
    code, out, _ = run(capsys, "estimate", "--model-params", "9e9", "--model-bits", "4", "--hidden-dim", "4096",
                       "--num-heads", "32", "--num-layers", "32", "--batch-size", "4", "--seq-length", "2048",
                       "--lora-rank", "32", "--lora-layers", "16", "--method", "qlora", "--device", "mlx",
                       "--framework", "mlx", "--json")
    assert code == 0
    assert json.loads(out)["counter"] == "mlx"


def test_paged_optimizer_and_bnb_version_flags(capsys):
    # HF optim spellings are taken; the paged states leave nothing to split by hand, and an older
    # bitsandbytes (its 4-bit linears keep their inputs) estimates higher than a newer one
    base = ("estimate", "--config", os.path.join(CONFIGS, "llama-3-8b.json"), "--method", "qlora",
            "--device", "cuda", "--seq-length", "512", "--json")
    peaks = {}
    for opt in ("paged_adamw_8bit", "paged_adamw_32bit", "adamw_bnb_8bit"):
        for ver in ("0.42.0", "0.45.0"):
            code, out, _ = run(capsys, *base, "--optimizer", opt, "--bnb-version", ver)
            assert code == 0
            peaks[opt, ver] = json.loads(out)["peak_bytes"]
    for opt in ("paged_adamw_8bit", "paged_adamw_32bit"):
        assert peaks[opt, "0.42.0"] > peaks[opt, "0.45.0"]
    code, _, err = run(capsys, *base, "--bnb-version", "latest")
    assert code != 0 and "--bnb-version" in err


def test_does_not_fit_exits_3_with_suggestions(capsys):
    code, out, _ = run(capsys, "estimate", "--config", os.path.join(CONFIGS, "llama-3-8b.json"),
                       "--method", "full", "--batch-size", "8", "--seq-length", "4096",
                       "--budget-gib", "1", "--json")
    assert code == 3
    d = json.loads(out)
    assert d["does_not_fit"]["shortfall_bytes"] > 0 and d["does_not_fit"]["suggestions"]


@pytest.mark.parametrize("argv,flag", [
    (["--batch-size", "-1"], "--batch-size"),
    (["--seq-length", "0"], "--seq-length"),
    (["--optimizer", "lion"], "--optimizer"),
    (["--method", "prefix"], "--method"),
    (["--dtype", "fp8"], "--dtype"),
    (["--budget-gib", "-2"], "--budget-gib"),
])
def test_bad_values_name_the_flag(capsys, argv, flag):
    code, out, err = run(capsys, "estimate", "--config", SMOL, *argv)
    assert code == 2
    assert f"invalid {flag}" in err
    assert out == ""


def test_missing_config_field_is_named(capsys, tmp_path):
    cfg = json.load(open(SMOL))
    del cfg["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, _, err = run(capsys, "estimate", "--config", str(path))
    assert code == 2 and "hidden_size" in err


def test_unreadable_or_invalid_file(capsys, tmp_path):
    code, _, err = run(capsys, "estimate", "--config", str(tmp_path / "nope.json"))
    assert code == 2 and "nope.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run(capsys, "estimate", "--config", str(bad))
    assert code == 2 and "bad.json" in err


def test_numbers_without_config_name_the_missing_flag(capsys):
    code, _, err = run(capsys, "estimate", "--model-params", "1e9")
    assert code == 2 and "--hidden-dim" in err


def test_probe_json(capsys):
    code, out, _ = run(capsys, "probe", "--json")
    d = json.loads(out)
    assert code == 0
    assert 0 < d["available_bytes"] <= d["total_bytes"]
    assert d["process_bytes"] > 0


def test_console_script_help_and_exit_code():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", "--help"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "--lora-targets" in proc.stdout and "--grad-checkpoint" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "memguard_core.cli", "estimate", "--config", SMOL,
                           "--optimizer", "lion"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "invalid --optimizer" in proc.stderr


def test_core_imports_no_framework():
    code = ("import sys, memguard_core, memguard_core.cli, memguard_core.estimate, memguard_core.plan, "
            "memguard_core.monitor, memguard_core.probes, memguard_core.stats, memguard_core.spec; "
            "bad = [m for m in ('torch', 'mlx', 'transformers', 'accelerate') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
