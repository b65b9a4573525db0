"""The process's own peak under the guard's per-step VmHWM resets (#34 item 8; docs/monitor.md,
"The process's own peak"): real guarded processes (memguard_testing/scripts/peak_reset_run.py)
that hold a known block once, then run smaller steps, with ``reset_peak_rss`` on and off.

Each child is started through ``sh`` forking it: a child exec'd straight from pytest keeps
pytest's own high-water mark as a floor under ``ru_maxrss`` (fs/exec.c ``exec_mmap``), which would
hide what the guard does to the child's.
"""

import json
import os
import subprocess
import sys

import pytest

from memguard_core.errors import ConfigError
from memguard_core.events import read_events
from memguard_core.monitor import MemoryMonitor
from memguard_core.options import GuardOptions
from memguard_core.probes.linux.peak import RU_DRIFT_BYTES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
                                reason="VmHWM and its reset (/proc/self/clear_refs) are Linux's")

MiB = 1 << 20
SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "memguard_testing", "scripts", "peak_reset_run.py")


def _run(tmp_path, reset: str, where: str):
    cmd = f'"{sys.executable}" "{SCRIPT}" {reset} {where} "{tmp_path}"; exit $?'
    p = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    records = read_events(out["summary"]["event_log"])
    return out, records, p.stderr


def _steps(records):
    return [r for r in records if r.get("type") == "step"]


def test_reset_on_keeps_the_early_peak_and_gives_it_back(tmp_path):
    out, records, _ = _run(tmp_path, "on", "during")
    held, s = out["held"], out["summary"]
    assert out["resets"] > 0
    # the reset is real: in the middle of the run ru_maxrss no longer shows the block
    assert out["ru_mid"] < held - 256 * MiB
    # the summary keeps the peak the process reached (ru_maxrss reads batched counters: a few pages)
    assert held - RU_DRIFT_BYTES <= s["process_peak_rss_bytes"] <= held + 16 * MiB
    # and after the run VmHWM / ru_maxrss read it again
    assert out["ru_after"] >= s["process_peak_rss_bytes"] and out["hwm_after"] >= s["process_peak_rss_bytes"]
    assert out["hwm_after"] <= s["process_peak_rss_bytes"] + 16 * MiB
    # per-step peaks stay per step: the steps after the block read the small steps' peaks
    steps = _steps(records)
    assert steps[0]["peak_bytes"] >= held - RU_DRIFT_BYTES
    assert all(r["peak_bytes"] < held - 256 * MiB for r in steps[1:])
    # every step record and the end record carry the process's peak
    assert all(r["process_peak_rss_bytes"] >= held - RU_DRIFT_BYTES for r in steps)
    end = [r for r in records if r.get("type") == "end"][-1]
    assert end["process_peak_rss_bytes"] == s["process_peak_rss_bytes"]


def test_reset_on_keeps_the_peak_before_the_guard_started(tmp_path):
    out, _, _ = _run(tmp_path, "on", "before")
    held, s = out["held"], out["summary"]
    # the step peaks do not see the block (the first reset came after it) ...
    assert s["measured_peak_bytes"] < held - 256 * MiB
    # ... the process's peak does, and VmHWM reads it after the run
    assert held - RU_DRIFT_BYTES <= s["process_peak_rss_bytes"] <= held + 16 * MiB
    assert out["ru_after"] >= s["process_peak_rss_bytes"]


def test_reset_off_leaves_vmhwm_intact(tmp_path):
    out, records, _ = _run(tmp_path, "off", "during")
    held, s = out["held"], out["summary"]
    assert out["resets"] == 0
    # ru_maxrss keeps the block through the run and after it, and equals the summary's figure
    assert out["ru_mid"] >= held - RU_DRIFT_BYTES
    assert abs(out["ru_after"] - s["process_peak_rss_bytes"]) <= RU_DRIFT_BYTES
    assert out["hwm_after"] == s["process_peak_rss_bytes"]
    # each step's peak is then the process's peak so far (docs/monitor.md): an upper bound
    assert all(r["peak_bytes"] >= held - RU_DRIFT_BYTES for r in _steps(records))


def test_no_room_to_give_vmhwm_back_is_said_and_the_summary_keeps_the_peak(tmp_path):
    out, _, err = _run(tmp_path, "on", "limited")
    held, s = out["held"], out["summary"]
    assert held - RU_DRIFT_BYTES <= s["process_peak_rss_bytes"] <= held + 16 * MiB
    assert out["hwm_after"] < held - 256 * MiB      # not raised under the address-space limit
    assert "not raised back" in err and "process_peak_rss_bytes" in err


def test_reset_peak_rss_is_validated():
    assert GuardOptions.from_kwargs().reset_peak_rss is True
    assert GuardOptions.from_kwargs(reset_peak_rss=False).reset_peak_rss is False
    with pytest.raises(ConfigError, match="reset_peak_rss"):
        GuardOptions.from_kwargs(reset_peak_rss="no")
    with pytest.raises(ConfigError, match="reset_peak_rss"):
        MemoryMonitor(1 << 30, device="cpu", reset_peak_rss=0)


def test_the_adapters_take_reset_peak_rss():
    from memguard_hf import MemGuardCallback
    from memguard_torch import TorchGuard
    import torch

    assert MemGuardCallback(reset_peak_rss=False).options.reset_peak_rss is False
    model = torch.nn.Linear(2, 1)
    g = TorchGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), reset_peak_rss=False, preflight=False)
    assert g.options.reset_peak_rss is False
    with pytest.raises(ConfigError, match="reset_peak_rss"):
        MemGuardCallback(reset_peak_rss=None)
