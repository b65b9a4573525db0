"""Bad input to the command line ends in one line naming what is wrong (exit 2), never a traceback."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL = os.path.join(ROOT, "tests", "configs", "smollm2-135m.json")


def _memguard(*args, env=None):
    e = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-m", "memguard_core.cli", *args], capture_output=True, text=True,
                          env=e, timeout=120)


@pytest.mark.parametrize("flag,value", [("--budget-gib", "nan"), ("--budget-gib", "inf"), ("--budget-gib", "-1"),
                                        ("--available-gib", "nan"), ("--available-gib", "inf")])
def test_non_finite_budgets(flag, value):
    p = _memguard("estimate", "--config", SMOL, "--device", "cpu", flag, value)
    assert p.returncode == 2 and f"invalid {flag}" in p.stderr and "Traceback" not in p.stderr


def test_run_with_a_command_that_does_not_exist():
    p = _memguard("run", "--", "/nonexistent/cmd", "--flag")
    assert p.returncode == 2
    assert "invalid command" in p.stderr and "/nonexistent/cmd" in p.stderr and "Traceback" not in p.stderr


def test_calibration_with_a_data_dir_that_is_a_file(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("")
    p = _memguard("calibration", "show", env={"MEMGUARD_DATA_DIR": str(f)})
    assert p.returncode == 2 and "MEMGUARD_DATA_DIR" in p.stderr and "Traceback" not in p.stderr
    # a guarded run's recording goes on without calibration (logged), it does not raise
    code = ("from memguard_core import calibration as c; print(c.show())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT, MEMGUARD_DATA_DIR=str(f)))
    assert r.returncode == 0 and r.stdout.strip() == "[]"
