"""The process's own peak under the guard's per-step VmHWM resets (#34 item 8; docs/monitor.md,
"The process's own peak"): real guarded processes (memguard_testing/scripts/peak_reset_run.py)
that hold a known block once, then run smaller steps, with ``reset_peak_rss`` on and off.

Each child is started by a small launcher (``LAUNCHER``), which also reads the child's rusage at
its exit, as ``/usr/bin/time -v`` does.
"""

import json
import os
import subprocess
import sys
import types

import pytest

from memguard_core.errors import ConfigError
from memguard_core.events import read_events
from memguard_core.monitor import MemoryMonitor
from memguard_core.options import GuardOptions
from memguard_core.probes.linux.peak import RU_DRIFT_BYTES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.access("/proc/self/clear_refs", os.W_OK),
                                reason="VmHWM and its reset (/proc/self/clear_refs) are Linux's")

MiB = 1 << 20
GiB = 1 << 30
SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "memguard_testing", "scripts", "peak_reset_run.py")


#: Starts the script and reads its rusage at exit (``os.wait4``: what ``/usr/bin/time -v`` prints)
#: after touching ``argv[1]`` MiB itself: a child exec'd from it keeps that as the floor under its
#: ``ru_maxrss`` (fs/exec.c ``exec_mmap``), where a child exec'd straight from pytest would keep
#: pytest's own high-water mark.
LAUNCHER = """import os, subprocess, sys
held = bytearray(int(sys.argv[1]) << 20)
p = subprocess.Popen(sys.argv[2:])
_, status, ru = os.wait4(p.pid, 0)
print("EXIT_MAXRSS", ru.ru_maxrss * 1024, flush=True)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _run(tmp_path, reset: str, where: str, parent_mib: int = 0):
    """The script's result (with ``exit_maxrss``: its rusage at exit), its event log's records and
    its stderr; ``parent_mib``: the floor under its ``ru_maxrss`` (see LAUNCHER)."""
    cmd = [sys.executable, "-c", LAUNCHER, str(parent_mib), sys.executable, SCRIPT, reset, where, str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    out["exit_maxrss"] = int([ln for ln in p.stdout.splitlines() if ln.startswith("EXIT_MAXRSS ")][-1].split()[1])
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
    # and after the run VmHWM / ru_maxrss read it again, in the process and at its exit (time -v)
    # (within the counters' batching, as above)
    assert out["ru_after"] >= s["process_peak_rss_bytes"] - RU_DRIFT_BYTES
    assert out["hwm_after"] >= s["process_peak_rss_bytes"] - RU_DRIFT_BYTES
    assert out["exit_maxrss"] >= s["process_peak_rss_bytes"] - RU_DRIFT_BYTES
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
    assert out["ru_after"] >= s["process_peak_rss_bytes"] - RU_DRIFT_BYTES


def test_a_large_parent_under_ru_maxrss_does_not_hide_the_peak(tmp_path):
    # exec'd from a 640 MiB process: ru_maxrss never reads below that floor (fs/exec.c exec_mmap),
    # so every reset reads the erased peak from VmHWM instead
    out, _, _ = _run(tmp_path, "on", "during", parent_mib=640)
    assert out["exit_maxrss"] >= 640 * MiB
    held, s = out["held"], out["summary"]
    assert out["ru_mid"] >= 640 * MiB and out["resets"] > 0
    assert held - RU_DRIFT_BYTES <= s["process_peak_rss_bytes"] <= held + 16 * MiB
    assert out["hwm_after"] >= s["process_peak_rss_bytes"] - RU_DRIFT_BYTES


def test_reset_off_leaves_vmhwm_intact(tmp_path):
    out, records, _ = _run(tmp_path, "off", "during")
    held, s = out["held"], out["summary"]
    assert out["resets"] == 0
    # ru_maxrss keeps the block through the run and after it, and equals the summary's figure
    assert out["ru_mid"] >= held - RU_DRIFT_BYTES
    assert abs(out["ru_after"] - s["process_peak_rss_bytes"]) <= RU_DRIFT_BYTES
    assert out["hwm_after"] == s["process_peak_rss_bytes"]
    assert abs(out["exit_maxrss"] - s["process_peak_rss_bytes"]) <= RU_DRIFT_BYTES
    # the step that raised VmHWM reads it; the smaller steps after it read the RSS the samples saw
    # (a lower bound), not the block again: k does not rise step after step on one old peak
    steps = _steps(records)
    assert steps[0]["peak_bytes"] >= held - RU_DRIFT_BYTES
    assert all(r["peak_bytes"] < held - 256 * MiB for r in steps[1:])
    assert out["exact"] and s["measured_peak_bytes"] >= held - RU_DRIFT_BYTES


def test_reset_off_with_the_peak_before_the_start_reads_lower_bounds(tmp_path):
    out, records, _ = _run(tmp_path, "off", "before")
    held, s = out["held"], out["summary"]
    assert out["resets"] == 0 and out["hwm_after"] == s["process_peak_rss_bytes"]
    assert s["process_peak_rss_bytes"] >= held - RU_DRIFT_BYTES
    # no step passed the block's peak: every step peak is a lower bound, and said to be one
    assert all(r["peak_bytes"] < held - 256 * MiB for r in _steps(records))
    assert not out["exact"]


def test_no_room_to_give_vmhwm_back_is_said_and_the_summary_keeps_the_peak(tmp_path):
    out, _, err = _run(tmp_path, "on", "limited")
    held, s = out["held"], out["summary"]
    assert held - RU_DRIFT_BYTES <= s["process_peak_rss_bytes"] <= held + 16 * MiB
    assert out["hwm_after"] < held - 256 * MiB      # not raised under the address-space limit
    assert out["exit_maxrss"] < held - 256 * MiB
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


class _Seq:
    """A CPU reader's snapshots in order: (RSS, VmHWM) pairs, bytes; counts the peak resets."""

    def __init__(self, figures):
        self.figures, self.resets = list(figures), 0

    def reader(self):
        from memguard_core.probes import StepReader

        def probe(cheap):
            rss, hwm = self.figures.pop(0)
            return types.SimpleNamespace(process_bytes=rss, available_bytes=64 * GiB, process_peak_bytes=hwm,
                                         timestamp=1.0)

        def reset():
            self.resets += 1
            return True
        return StepReader("cpu", probe=probe, reset_peak=reset)


def test_with_vmhwm_kept_a_step_reads_it_where_it_rose_else_the_rss_the_samples_saw():
    from memguard_core.monitor_sampler import StepSampler

    seq = _Seq([(2 * GiB, 9 * GiB),            # prime: the loading's peak, 9 GiB
                (3 * GiB, 9 * GiB),            # step 1 below it: its RSS
                (5 * GiB, 9 * GiB),            # a background sample in step 2 ...
                (3 * GiB, 9 * GiB),            # ... and step 2's sample: the larger RSS seen
                (4 * GiB, 11 * GiB),           # step 3 raised VmHWM: exact
                (4 * GiB, 11 * GiB)])          # step 4 below it again
    s = StepSampler("cpu", reset_rss_peak=False)
    s._reader = seq.reader()
    s.prime()
    assert s.read_step()[2] == 3 * GiB and not s.peaks_exact
    s.probe(False)
    assert s.read_step()[2] == 5 * GiB
    assert s.read_step()[2] == 11 * GiB and s.peaks_exact
    assert s.read_step()[2] == 4 * GiB
    assert seq.resets == 0
    # with the reset (the default) the snapshot's peak is the step's and the window restarts
    seq = _Seq([(3 * GiB, 4 * GiB)])   # prime resets without a snapshot
    s = StepSampler("cpu")
    s._reader = seq.reader()
    s.prime()
    assert s.read_step()[2] == 4 * GiB and seq.resets == 2 and s.peaks_exact
