"""Virtual-memory limits (RLIMIT_AS / RLIMIT_DATA) read by the Linux probe, for real.

Each test starts a child interpreter that sets the limit on itself with ``resource.setrlimit``
(what ``ulimit -v`` / ``prlimit --as`` do), probes, and reads /proc/self/status ``VmSize`` /
``VmData`` right after: the probe must name the limit and report a headroom that matches the
kernel's own counters, and the room must be real (an allocation beyond it fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from memguard_core.probes import linux
from memguard_core.probes.linux import rlimit

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux rlimits")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

CHILD = textwrap.dedent("""
    import json, resource, sys
    which, extra = sys.argv[1], int(sys.argv[2])
    from memguard_core.probes import linux, probe
    from memguard_core.monitor import MemoryMonitor

    def status():
        out = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            if k in ("VmSize", "VmData", "VmStk", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
        return out

    before = status()
    counted = before["VmSize"] if which == "AS" else before["VmData"] + before["VmStk"]
    limit = (counted + extra) // 4096 * 4096
    res = resource.RLIMIT_AS if which == "AS" else resource.RLIMIT_DATA
    resource.setrlimit(res, (limit, resource.getrlimit(res)[1]))
    snap = probe("cpu")
    after = status()
    cheap = linux.probe(cheap=True)
    # the room is real: a buffer the size of the headroom plus a margin cannot be had
    try:
        bytearray(snap.address_headroom_bytes + 64 * 2**20)
        refused = False
    except MemoryError:
        refused = True
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0)
    mon.step_sample(step=0)
    print(json.dumps(dict(limit=limit, before=before, after=after, refused=refused,
                          snap=snap.__dict__, cheap=cheap.__dict__,
                          step_budget=mon._last_step[2])))
""")


def _run(which, extra):
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", CHILD, which, str(extra)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("which,source", [("AS", "RLIMIT_AS"), ("DATA", "RLIMIT_DATA")])
def test_child_under_rlimit_reports_the_limit_and_its_headroom(which, source):
    r = _run(which, 512 * MiB)
    s = r["snap"]
    assert s["address_limit_source"] == source and s["address_limit_bytes"] == r["limit"]
    if which == "AS":
        counted_after = r["after"]["VmSize"]
    else:
        counted_after = r["after"]["VmData"] + r["after"]["VmStk"]
    # the headroom is limit - counter, read a few lines apart: the counter moves by what the
    # probe itself mapped in between (a few MiB at most)
    assert abs(s["address_headroom_bytes"] - (r["limit"] - counted_after)) < 8 * MiB
    assert 400 * MiB < s["address_headroom_bytes"] <= 512 * MiB
    # the resident figures the monitor compares are capped by it
    assert s["available_bytes"] <= s["address_headroom_bytes"]
    assert s["total_bytes"] <= r["limit"]
    # the per-step probe applies it too, and the monitor's budget follows
    c = r["cheap"]
    assert c["address_limit_source"] == source
    assert c["available_bytes"] <= c["address_headroom_bytes"] + 8 * MiB
    assert r["step_budget"] <= (c["process_bytes"] + c["address_headroom_bytes"] + 8 * MiB) * 0.8
    # an allocation beyond the headroom really fails
    assert r["refused"] is True


def test_prlimit_as_from_outside_is_seen():
    """``prlimit --as`` (what a cluster's ``ulimit -v`` amounts to) on a running interpreter."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    code = ("from memguard_core.probes import probe; import json; s = probe('cpu'); "
            "print(json.dumps([s.address_limit_source, s.address_limit_bytes, s.address_headroom_bytes]))")
    limit = 6 * 1024 * MiB
    out = subprocess.run(["prlimit", f"--as={limit}", sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "prlimit" in out.stderr and "not found" in out.stderr:
        pytest.skip("no prlimit")
    assert out.returncode == 0, out.stderr
    src, lim, room = json.loads(out.stdout.strip().splitlines()[-1])
    assert (src, lim) == ("RLIMIT_AS", limit) and 0 < room < limit


def test_address_limit_picks_the_least_room():
    GiB = 1 << 30
    lim = rlimit.address_limit(3 * GiB, 1 * GiB, (4 * GiB, 1536 * MiB))
    assert (lim.source, lim.limit, lim.counted, lim.headroom) == ("RLIMIT_DATA", 1536 * MiB, GiB, 512 * MiB)
    lim = rlimit.address_limit(3 * GiB, 1 * GiB, (4 * GiB, None))
    assert (lim.source, lim.headroom) == ("RLIMIT_AS", GiB)
    assert rlimit.address_limit(5 * GiB, None, (4 * GiB, None)).headroom == 0     # never negative
    assert rlimit.address_limit(3 * GiB, 1 * GiB, (None, None)) is None
    assert rlimit.address_limit(None, None, (4 * GiB, 2 * GiB)) is None           # counters unknown


def test_no_limit_in_this_process_reports_none():
    if rlimit.read_rlimits() != (None, None):
        pytest.skip("this test process runs under an address-space limit")
    s = linux.probe()
    assert s.address_limit_bytes is None and s.address_limit_source is None
    assert s.address_headroom_bytes is None


TORCH_CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    from memguard_core.monitor import Action, MemoryMonitor

    vmsize = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
    limit = vmsize + 1536 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    mon = MemoryMonitor(1 << 40, device="cpu", interval_s=0, clean_fn=lambda: None, max_micro_batches=64)
    mon.prime()
    held, log, failed_at = [], [], None
    for i in range(40):
        try:
            held.append(torch.ones(64 * 2**20 // 4))       # 64 MiB, a fresh mapping each
        except RuntimeError as exc:                          # torch's allocator under the limit
            failed_at = i
            break
        act = mon.step_sample(step=i)
        log.append([i, act.value, mon.micro_batches])
    print(json.dumps(dict(log=log, failed_at=failed_at, first_split=next(
        (i for i, a, k in log if a == "split"), None))))
""")


def test_torch_under_rlimit_as_is_split_before_its_allocator_fails():
    """The issue's failure, for real: torch's CPU allocator under ``RLIMIT_AS`` raises "can't
    allocate memory". The monitor, reading the headroom as its budget, splits before that."""
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", TORCH_CHILD], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["failed_at"] is not None                     # the limit is real: torch fails at last
    assert r["first_split"] is not None and r["first_split"] < r["failed_at"]


@pytest.mark.parametrize("flag,source", [("--as", "RLIMIT_AS"), ("--data", "RLIMIT_DATA")])
def test_probe_command_names_the_rlimit_that_set_the_total(flag, source):
    """``prlimit --as / --data memguard probe``: the table and the JSON say which limit set the
    total (not "host")."""
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="200")
    limit = 6 * 1024 * MiB
    cmd = ["prlimit", f"{flag}={limit}", sys.executable, "-m", "memguard_core.cli", "probe", "--device", "cpu"]
    out = subprocess.run(cmd + ["--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0 and "prlimit" in out.stderr and "not found" in out.stderr:
        pytest.skip("no prlimit")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    if d["total_bytes"] != limit:
        pytest.skip("a container limit below the rlimit sets the total here")
    assert (d["total_limit_bytes"], d["total_limit_source"]) == (limit, source)
    assert (d["address_limit_bytes"], d["address_limit_source"]) == (limit, source)
    assert 0 < d["address_headroom_bytes"] < limit
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    table = " ".join(out.stdout.split())
    assert f"total set by │ {source} (6.00 GiB)" in table
    assert f"address-space limit │ 6.00 GiB ({source};" in table
    assert "pressure (PSI some avg10, % stalled)" in table


def test_probe_rows_without_limits_name_the_host():
    from memguard_core.probes import display_rows, total_limit

    if rlimit.read_rlimits() != (None, None):
        pytest.skip("this test process runs under an address-space limit")
    s = linux.probe()
    lim, src = total_limit(s)
    assert (lim, src) == ((s.limit_bytes, s.limit_source) if s.limit_bytes else (None, s.limit_source))
    rows = dict(display_rows(s, str))
    assert rows["address-space limit"] == "none"
    assert rows["total set by"].startswith(s.limit_source)
