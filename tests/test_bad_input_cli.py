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
                                        ("--budget-gib", "1e-12"),
                                        ("--available-gib", "nan"), ("--available-gib", "inf")])
def test_non_finite_budgets(flag, value, capsys):
    from memguard_core.cli import main

    # in-process (the other tests here run the console entry in a fresh process)
    code = main(["estimate", "--config", SMOL, "--device", "cpu", flag, value])
    err = capsys.readouterr().err
    assert code == 2 and f"invalid {flag}" in err and "Traceback" not in err
    assert "integer" not in err      # a GiB figure is a number, not an integer (#34 item 9)


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


def test_calibration_show_on_a_missing_store_creates_nothing(tmp_path):
    d = tmp_path / "not-there"
    p = _memguard("calibration", "show", env={"MEMGUARD_DATA_DIR": str(d)})
    assert p.returncode == 0 and "empty" in p.stdout and str(d) in p.stdout
    p = _memguard("calibration", "show", "--json", env={"MEMGUARD_DATA_DIR": str(d)})
    assert p.returncode == 0 and p.stdout.strip() == "[]"
    p = _memguard("calibration", "reset", env={"MEMGUARD_DATA_DIR": str(d)})
    assert p.returncode == 0 and "nothing to delete" in p.stdout
    assert not d.exists()


def test_calibration_show_on_an_empty_store_says_so(tmp_path, monkeypatch):
    from memguard_core import calibration

    monkeypatch.setenv("MEMGUARD_DATA_DIR", str(tmp_path))
    calibration._connect().close()  # the store a guarded run creates, with no run in it
    p = _memguard("calibration", "show", env={"MEMGUARD_DATA_DIR": str(tmp_path)})
    assert p.returncode == 0 and "empty" in p.stdout and "calibration.sqlite3" in p.stdout
    assert "not created yet" not in p.stdout


def test_run_names_a_plain_exit_status_once():
    p = _memguard("run", "--", sys.executable, "-c", "import sys; sys.exit(3)")
    assert p.returncode == 3
    assert "exited with status 3" in p.stderr and "(status 3)" not in p.stderr


def test_run_report_path_is_checked_before_the_run(tmp_path):
    """#34 item 9: an unwritable --report is an error before the child runs (it used to exit 0 after it)."""
    marker = tmp_path / "ran"
    p = _memguard("run", "--report", str(tmp_path / "no" / "such" / "r.json"), "--",
                  sys.executable, "-c", f"open({str(marker)!r}, 'w').close()")
    assert p.returncode == 2 and "--report" in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()


def test_run_sets_the_run_id_without_a_log_dir():
    env = {k: v for k, v in os.environ.items() if k not in ("MEMGUARD_LOG_DIR", "MEMGUARD_RUN_ID")}
    p = subprocess.run([sys.executable, "-m", "memguard_core.cli", "run", "--", sys.executable, "-c",
                        "import os; print('id=' + os.environ['MEMGUARD_RUN_ID'])"],
                       capture_output=True, text=True, env=dict(env, PYTHONPATH=ROOT), timeout=120)
    assert p.returncode == 0, p.stderr
    assert any(line.startswith("id=") and len(line) > 3 for line in p.stdout.splitlines())
