"""Linux probe: parse functions on recorded /proc + cgroup trees, the live probe, and a live
cgroup-v1 limit set on a child cgroup of our own.

Fixtures (tests/fixtures/probes/):
- linux_v1/: RECORDED on this machine (cgroup v1 memory controller) by
  record_linux_v1.py: a process in mg-parent (300 MiB) / mg-child (500 MiB).
- linux_v2/: FABRICATED (see its README): this machine runs cgroup v1 for memory, so a v2
  tree could not be recorded here; it is written in the kernel's formats after a
  Kubernetes/containerd node with MemoryQoS.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest

from memguard_core.probes import MemorySnapshot, linux, probe
from memguard_core.probes.common import reset_warned
from memguard_core.probes.linux import cgroup, files, heap, proc
from memguard_core.probes.linux import peak as lpeak
from memguard_core.probes.linux import psi as lpsi

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(HERE, "fixtures", "probes")
V1 = os.path.join(FIX, "linux_v1")
V2 = os.path.join(FIX, "linux_v2")
V1_OWN = "/sys/fs/cgroup/memory/process_api/5e42082ecd91b7cfd55f24b8a767b8d6"
V1_PARENT = V1_OWN + "/mg-parent"
V1_CHILD = V1_PARENT + "/mg-child"
V2_POD = ("/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/"
          "kubepods-burstable-pod5f1c2a7e_3b1d_4c55_9a0e_2f7d1b6c9e11.slice")
V2_CTR = V2_POD + "/cri-containerd-8c2d6f0a9b7e4d1c3a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e5d6c7b.scope"
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_warned()
    cgroup._loc_cache.clear()
    yield
    cgroup._loc_cache.clear()


def _copy(tree, tmp_path):
    dst = tmp_path / os.path.basename(tree)
    shutil.copytree(tree, dst)
    return str(dst)


def _v1(root):
    return dict(proc_root=os.path.join(root, "proc"), sys_root=root)


# ---------------------------------------------------------------- parse functions, recorded v1

def test_parse_meminfo_recorded():
    mem = proc.read_meminfo(os.path.join(V1, "proc"))
    assert mem["MemTotal"] == 24684084 * 1024
    assert mem["MemAvailable"] == 22719516 * 1024
    assert mem["HugePages_Total"] == 0          # unitless lines stay as counts


def test_parse_status_recorded():
    st = proc.read_status(os.path.join(V1, "proc"))
    assert st["VmRSS"] == 74252 * 1024
    assert st["VmHWM"] == 74252 * 1024
    assert "Pid" not in st


def test_parse_psi_recorded_and_v2():
    psi = lpsi.parse_psi(open(os.path.join(V1, "proc/pressure/memory")).read())
    assert (psi.some_avg10, psi.some_total_us, psi.full_total_us) == (0.0, 7651, 1506)
    psi2 = lpsi.parse_psi(open(V2 + V2_CTR + "/memory.pressure").read())
    assert psi2.some_avg10 == pytest.approx(3.12)
    assert psi2.some_avg60 == pytest.approx(1.05)
    assert psi2.full_avg10 == pytest.approx(1.40)
    assert psi2.full_total_us == 21456789


def test_parse_psi_garbage_is_dropped_and_logged_once(caplog):
    text = "some avg10=abc avg60=250.0 avg300=0.10 total=-4\nfull avg10=0.5 avg60=0 avg300=0 total=9\n"
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        psi = lpsi.parse_psi(text, "fakepsi")
        lpsi.parse_psi(text, "fakepsi")
    assert psi.some_avg10 is None and psi.some_avg60 is None and psi.some_total_us is None
    assert psi.some_avg300 == pytest.approx(0.10)
    assert psi.full_avg10 == pytest.approx(0.5) and psi.full_total_us == 9
    assert len([r for r in caplog.records if "fakepsi some avg10" in r.getMessage()]) == 1
    assert lpsi.parse_psi("nothing here\n") is None


def test_locate_cgroups_recorded_v1():
    loc = cgroup.locate_cgroups(**_v1(V1))
    assert loc.v1_dir == V1 + V1_CHILD
    assert loc.v1_mount == V1 + "/sys/fs/cgroup/memory"
    assert loc.v2_dir == V1 + "/sys/fs/cgroup/unified"   # hybrid: cgroup2 mounted, 0::/


def test_cgroup_memory_v1_smallest_ancestor_limit_wins():
    cg = cgroup.cgroup_memory(**_v1(V1))
    assert cg.version == 1
    assert cg.path == V1 + V1_CHILD
    assert cg.limit == 300 * MiB                    # parent's 300 MiB beats the child's 500 MiB
    assert cg.limit_path == V1 + V1_PARENT
    assert cg.usage == 70516736
    assert cg.working_set == 70516736               # total_inactive_file is 0 in the recording
    # min(300 MiB - parent ws 70778880, 500 MiB - child ws 70516736)
    assert cg.available == 300 * MiB - 70778880
    assert cg.oom_kill == 0
    assert cg.max_usage == 70516736


def test_probe_recorded_v1():
    s = linux.probe(**_v1(V1))
    assert isinstance(s, MemorySnapshot)
    assert s.source == "linux" and s.device == "cpu"
    assert s.total_bytes == 300 * MiB
    assert s.limit_bytes == 300 * MiB
    assert s.limit_source == "cgroup-v1:" + V1 + V1_PARENT
    assert s.available_bytes == 300 * MiB - 70778880
    assert s.process_bytes == 74252 * 1024 and s.process_peak_bytes == 74252 * 1024
    assert s.pressure == 0.0                          # /proc/pressure/memory (no v2 file in tree)
    assert s.used_fraction == pytest.approx(70778880 / (300 * MiB))


def test_v1_huge_limit_means_no_limit(tmp_path):
    root = _copy(V1, tmp_path)
    for d in (V1_PARENT, V1_CHILD):
        open(root + d + "/memory.limit_in_bytes", "w").write("9223372036854771712\n")
    cg = cgroup.cgroup_memory(**_v1(root))
    assert cg.limit is None and cg.available is None
    s = linux.probe(**_v1(root))
    assert s.limit_bytes is None and s.limit_source == "host"
    assert s.total_bytes == 24684084 * 1024
    assert s.available_bytes == 22719516 * 1024


def test_v1_inactive_file_is_subtracted(tmp_path):
    root = _copy(V1, tmp_path)
    p = root + V1_CHILD + "/memory.stat"
    text = open(p).read().replace("total_inactive_file 0\n", "total_inactive_file 20971520\n")
    open(p, "w").write(text)
    cg = cgroup.cgroup_memory(**_v1(root))
    assert cg.working_set == 70516736 - 20971520


def test_garbage_and_negative_files_logged_once_and_ignored(tmp_path, caplog):
    root = _copy(V1, tmp_path)
    open(root + V1_CHILD + "/memory.limit_in_bytes", "w").write("garbage\n")
    open(root + V1_PARENT + "/memory.usage_in_bytes", "w").write("-5\n")
    with open(root + V1_CHILD + "/memory.stat", "a") as fh:
        fh.write("total_inactive_file_bogus x1\n")
    os.remove(root + V1_CHILD + "/memory.oom_control")
    os.mkdir(root + V1_CHILD + "/memory.oom_control")      # unreadable: a directory
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        s1 = linux.probe(**_v1(root))
        s2 = linux.probe(**_v1(root))
    # the garbage child limit is absent, so the parent's 300 MiB still holds;
    # the parent's usage is absent, so its room is computed from the child's working set
    assert s1.limit_bytes == s2.limit_bytes == 300 * MiB
    assert s1.available_bytes == s2.available_bytes
    assert s1.available_bytes == 300 * MiB - 70516736
    cg = cgroup.cgroup_memory(**_v1(root))
    assert cg.oom_kill is None
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for needle in ("mg-child/memory.limit_in_bytes", "mg-parent/memory.usage_in_bytes",
                   "total_inactive_file_bogus", "mg-child/memory.oom_control"):
        assert sum(needle in m for m in msgs) == 1, (needle, msgs)


def test_missing_proc_files_fall_back_without_raising(tmp_path):
    s = linux.probe(proc_root=str(tmp_path / "noproc"), sys_root=str(tmp_path))
    assert s.total_bytes > 0 and s.process_bytes > 0       # psutil fallback
    assert s.limit_source == "host" and s.pressure is None


# ---------------------------------------------------------------- fabricated v2 tree

def test_cgroup_memory_v2_high_preferred():
    cg = cgroup.cgroup_memory(**_v1(V2))
    assert cg.version == 2
    assert cg.path == V2 + V2_CTR
    assert cg.limit == 2040107008                     # memory.high, below memory.max 2 GiB
    assert cg.limit_path == V2 + V2_CTR
    assert cg.usage == 1199996928
    assert cg.working_set == 1199996928 - 209715200
    assert cg.available == 2040107008 - (1199996928 - 209715200)
    assert cg.oom_kill == 1
    assert cg.max_usage == 1610612736


def test_probe_v2_uses_own_memory_pressure():
    s = linux.probe(**_v1(V2))
    assert s.total_bytes == 2040107008 == s.limit_bytes
    assert s.limit_source == "cgroup-v2:" + V2 + V2_CTR
    assert s.available_bytes == 2040107008 - 990281728
    assert s.pressure == pytest.approx(3.12)          # not /proc/pressure/memory's 0.50
    assert s.process_bytes == 987652 * 1024 and s.process_peak_bytes == 1154220 * 1024
    psi = lpsi.read_psi(**_v1(V2))
    assert psi.path == V2 + V2_CTR + "/memory.pressure"


def test_v2_max_used_when_high_is_max_and_smaller_parent_wins(tmp_path):
    root = _copy(V2, tmp_path)
    open(root + V2_CTR + "/memory.high", "w").write("max\n")
    cg = cgroup.cgroup_memory(**_v1(root))
    assert cg.limit == 2 << 30 and cg.limit_path == root + V2_CTR
    open(root + V2_POD + "/memory.max", "w").write(str(1536 * MiB) + "\n")
    cg = cgroup.cgroup_memory(**_v1(root))
    assert cg.limit == 1536 * MiB and cg.limit_path == root + V2_POD
    # room at the pod: 1.5 GiB - (1201582080 - 209780736)
    assert cg.available == 1536 * MiB - (1201582080 - 209780736)
    open(root + V2_CTR + "/memory.high", "w").write(str(1 << 30) + "\n")
    assert cgroup.cgroup_memory(**_v1(root)).limit == 1 << 30


def test_v2_without_cgroup_pressure_uses_proc(tmp_path):
    root = _copy(V2, tmp_path)
    os.remove(root + V2_CTR + "/memory.pressure")
    assert linux.probe(**_v1(root)).pressure == pytest.approx(0.50)


def test_mount_root_not_slash_and_escaped_mount_point(tmp_path):
    # Docker without a cgroup namespace: /proc/self/cgroup names /docker/<id>, the mount's root
    # is /docker/<id>, so the mount point itself is our cgroup. The mount point has a space.
    root = str(tmp_path)
    os.makedirs(root + "/proc/self")
    open(root + "/proc/self/cgroup", "w").write("5:memory:/docker/abc123\n0::/\n")
    open(root + "/proc/self/mountinfo", "w").write(
        "40 31 0:32 /docker/abc123 /sys/fs/cgroup/my\\040mem ro,nosuid - cgroup cgroup rw,memory\n")
    shutil.copyfile(os.path.join(V1, "proc/meminfo"), root + "/proc/meminfo")
    d = root + "/sys/fs/cgroup/my mem"
    os.makedirs(d)
    open(d + "/memory.limit_in_bytes", "w").write(str(512 * MiB))
    open(d + "/memory.usage_in_bytes", "w").write(str(100 * MiB))
    open(d + "/memory.stat", "w").write("total_inactive_file 10485760\n")
    cg = cgroup.cgroup_memory(proc_root=root + "/proc", sys_root=root)
    assert cg.path == d and cg.limit == 512 * MiB
    assert cg.available == 512 * MiB - 90 * MiB


def test_parse_proc_cgroup_and_mountinfo_units():
    assert cgroup.parse_proc_cgroup("12:cpu,memory:/a/b\n0::/x\n") == ("/a/b", "/x")
    assert cgroup.parse_proc_cgroup("0::/only/v2\n") == (None, "/only/v2")
    m = cgroup.parse_mountinfo("bad line\n31 23 0:28 / /sys/fs/cgroup rw shared:9 - cgroup2 "
                              "cgroup2 rw,nsdelegate\n")
    assert len(m) == 1 and m[0].fstype == "cgroup2" and m[0].mount_point == "/sys/fs/cgroup"


# ---------------------------------------------------------------- live

def test_live_probe_sane():
    mem = proc.read_meminfo()
    for cheap in (False, True):
        s = probe("cpu", cheap=cheap)
        assert s.source == "linux" and s.device == "cpu"
        assert 0 < s.available_bytes <= s.total_bytes <= mem["MemTotal"]
        assert MiB < s.process_bytes <= s.total_bytes
        assert s.process_peak_bytes >= s.process_bytes
        assert s.pressure is None or 0.0 <= s.pressure <= 100.0
        assert 0.0 <= s.used_fraction <= 1.0
        assert abs(s.timestamp - time.monotonic()) < 5


def test_live_probe_sees_rss_grow():
    before = probe("cpu", cheap=True).process_bytes
    buf = bytearray(200 * MiB)          # zero-filled: the pages are touched
    after = probe("cpu", cheap=True).process_bytes
    del buf
    assert after - before >= 150 * MiB


def test_cheap_probe_between_meminfo_readings_follows_own_growth():
    # the per-step path reuses a /proc/meminfo reading younger than SLOW_FIGURES_MAX_AGE_S: the
    # available figure must still fall by what this process allocates in between
    full = linux.probe(cheap=False)          # refreshes the cached reading
    t0 = time.monotonic()
    buf = bytearray(300 * MiB)
    cheap = linux.probe(cheap=True)
    fresh_enough = time.monotonic() - t0 < files.SLOW_FIGURES_MAX_AGE_S
    del buf
    assert cheap.process_bytes - full.process_bytes >= 250 * MiB
    if fresh_enough:                          # the cached reading was used: adjusted by own growth
        assert full.available_bytes - cheap.available_bytes >= 250 * MiB


def test_cheap_probe_rereads_meminfo_when_the_reading_is_old(monkeypatch):
    monkeypatch.setattr(files, "SLOW_FIGURES_MAX_AGE_S", 0.0)
    linux.probe(cheap=False)
    before = dict(files.slow_cache)
    linux.probe(cheap=True)
    key = "meminfo:/proc"
    assert files.slow_cache[key][0] > before[key][0]   # read again, not reused


def _own_v1_memory_dir():
    loc = cgroup.locate_cgroups()
    if loc.v1_dir is None:
        return None, "no cgroup v1 memory controller for this process"
    if not os.access(loc.v1_dir, os.W_OK):
        return None, f"{loc.v1_dir} is not writable"
    return loc.v1_dir, ""


_CHILD_CODE = r"""
import json, sys
from memguard_core.probes import probe
from memguard_core.probes.linux import cgroup
buf = bytearray(int(sys.argv[1]))
s = probe("cpu"); c = probe("cpu", cheap=True); cg = cgroup.cgroup_memory()
print(json.dumps({"limit": s.limit_bytes, "src": s.limit_source, "total": s.total_bytes,
                  "avail": s.available_bytes, "cheap_limit": c.limit_bytes,
                  "cg_path": cg.path, "cg_usage": cg.usage, "rss": s.process_bytes}))
"""


def _run_code_in_cgroup(cg_dir, code, *args):
    """Run ``python -c code args`` inside the cgroup ``cg_dir``; its stdout is one JSON object."""
    def enter():
        with open(os.path.join(cg_dir, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                         preexec_fn=enter, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _run_in_cgroup(cg_dir, alloc):
    return _run_code_in_cgroup(cg_dir, _CHILD_CODE, alloc)


def _makedirs_or_skip(d, own):
    try:
        os.makedirs(d)
    except OSError as exc:
        pytest.skip(f"cannot create a child memory cgroup under {own}: {exc}")


def _rmdir(d):
    for _ in range(100):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


def test_live_cgroup_v1_limit_is_reported():
    own, why = _own_v1_memory_dir()
    if own is None:
        pytest.skip(f"cannot create a child memory cgroup: {why}")
    parent = os.path.join(own, f"mg-test-{os.getpid()}")
    child = os.path.join(parent, "inner")
    try:
        _makedirs_or_skip(child, own)
        open(os.path.join(parent, "memory.limit_in_bytes"), "w").write(str(300 * MiB))
        open(os.path.join(child, "memory.limit_in_bytes"), "w").write(str(500 * MiB))
        r = _run_in_cgroup(child, 100 * MiB)
        assert r["cg_path"] == child
        assert r["limit"] == 300 * MiB == r["total"] == r["cheap_limit"]
        assert r["src"] == "cgroup-v1:" + parent          # the smaller (parent) limit wins
        assert r["rss"] >= 100 * MiB
        # the 100 MiB it holds are charged to the cgroup, so at most 200 MiB are left
        assert 0 < r["avail"] <= 200 * MiB
        assert r["cg_usage"] >= 100 * MiB
    finally:
        _rmdir(child)
        _rmdir(parent)
    assert not os.path.exists(parent)


# ---------------------------------------------------------------------------------------------
# the per-step resident-set reading: /proc/self/statm + ru_maxrss after a reset (real kernel)

def _status_peak():
    return proc.read_status(keys=frozenset(("VmHWM",)))["VmHWM"]


def test_step_peak_follows_a_transient_allocation_after_reset():
    if not lpeak.reset_peak():
        pytest.skip("/proc/self/clear_refs not writable here")
    rss0 = linux.probe(cheap=True).process_bytes
    buf = b"\x01" * (96 * MiB)        # touched, then freed before the reading
    del buf
    s = linux.probe(cheap=True)
    hwm = _status_peak()
    assert s.process_peak_bytes >= rss0 + 90 * MiB
    # ru_maxrss reads the kernel's batched per-CPU counters: a few hundred KiB from VmHWM at most
    assert abs(s.process_peak_bytes - hwm) <= lpeak.RU_DRIFT_BYTES
    assert abs(s.process_bytes - proc.read_status(keys=frozenset(("VmRSS",)))["VmRSS"]) <= 8 * MiB
    # and a reset brings it back down
    assert lpeak.reset_peak()
    assert linux.probe(cheap=True).process_peak_bytes < rss0 + 48 * MiB


def test_step_figures_agree_with_the_cheap_probe():
    """``step_figures`` (the per-step check's path without a snapshot) gives what the cheap probe
    gives: RSS, the peak since the reset (a transient 96 MiB), RSS + available."""
    if not lpeak.reset_peak():
        pytest.skip("/proc/self/clear_refs not writable here")
    linux.probe(cheap=False)                       # fresh meminfo and cgroup readings
    before = linux.probe(cheap=True)
    if cgroup.step_levels() is None or cgroup.step_levels()[2]:
        pytest.skip("this test process runs in a limited memory cgroup")
    assert lpeak.reset_peak()
    buf = b"\x01" * (96 * MiB)
    del buf
    s = linux.probe(cheap=True)
    got = lpeak.step_figures()
    assert got is not None
    now, rss, peak, cap = got
    assert abs(rss - s.process_bytes) <= 4 * MiB
    assert abs(peak - s.process_peak_bytes) <= 4 * MiB and peak >= before.process_bytes + 90 * MiB
    assert abs(cap - (s.process_bytes + s.available_bytes)) <= 4 * MiB
    assert abs(now - time.monotonic()) < 1.0


def test_step_figures_decline_when_a_reading_is_stale(monkeypatch):
    """Past the cache age of the meminfo reading the caller must take the cheap probe (which
    re-reads it): step_figures returns None rather than an old MemAvailable."""
    if not lpeak.reset_peak():
        pytest.skip("/proc/self/clear_refs not writable here")
    # the clock stands still from the readings to the first call: a loaded machine that stalls this
    # test for a second must not make the fresh reading stale
    t0 = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: t0)
    linux.probe(cheap=False)
    linux.probe(cheap=True)
    if cgroup.step_levels() is None or cgroup.step_levels()[2]:
        pytest.skip("this test process runs in a limited memory cgroup")
    buf = b"\x01" * (32 * MiB)          # a peak above the floor's bound: unambiguous
    del buf
    assert lpeak.step_figures() is not None
    monkeypatch.setattr(time, "monotonic", lambda: t0 + files.SLOW_FIGURES_MAX_AGE_S + 0.1)
    assert lpeak.step_figures() is None


_FLOOR_CHILD = r"""
import json, resource
from memguard_core.probes import linux
from memguard_core.probes.linux import proc
from memguard_core.probes.linux import peak as lpeak
assert lpeak.reset_peak()
buf = b"\x01" * (48 << 20); del buf
cheap = linux.probe(cheap=True).process_peak_bytes
hwm = proc.read_status(keys=frozenset(("VmHWM",)))["VmHWM"]
print(json.dumps({"cheap": cheap, "hwm": hwm,
                  "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_step_peak_is_not_the_floor_a_large_parent_leaves():
    """A process started (fork + exec) by a large parent keeps the parent's high-water mark in
    ``ru_maxrss`` for life (fs/exec.c: signal->maxrss). Here the parent is this test holding
    400 MiB; the child's peak must still be its own VmHWM, not that floor."""
    held = b"\x02" * (400 * MiB)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _FLOOR_CHILD], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    del held
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["ru_maxrss"] >= 350 * MiB > r["hwm"]          # the floor is really there
    assert abs(r["cheap"] - r["hwm"]) <= lpeak.RU_DRIFT_BYTES


def test_kept_descriptors_are_not_inherited_by_a_forked_child():
    """procfs binds /proc/self/* to the task at open: a forked child must not read (or reset) its
    parent's figures through descriptors the parent kept."""
    linux.probe(cheap=True)                      # the parent opens its kept descriptors
    assert lpeak.reset_peak()
    parent_rss = linux.probe(cheap=True).process_bytes
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                  # child: grow, read, reset, report
        try:
            os.close(r)
            buf = b"\x03" * (200 * MiB)
            s = linux.probe(cheap=True)
            own = proc.read_status(keys=frozenset(("VmRSS", "VmHWM")))   # opened in the child
            ok = lpeak.reset_peak()
            os.write(w, json.dumps({"rss": s.process_bytes, "peak": s.process_peak_bytes,
                                    "own_rss": own["VmRSS"], "own_hwm": own["VmHWM"],
                                    "reset": ok, "n": len(buf)}).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    child = json.loads(data)
    assert child["reset"]
    # its own figures (the 200 MiB it took are in them), not the parent's; a fork copies only part
    # of the parent's pages into the child's RSS, so the child is compared with itself
    assert abs(child["rss"] - child["own_rss"]) <= 8 * MiB
    assert child["own_rss"] >= 200 * MiB
    assert abs(child["peak"] - child["own_hwm"]) <= lpeak.RU_DRIFT_BYTES + 8 * MiB
    assert linux.probe(cheap=True).process_bytes < parent_rss + 100 * MiB


def test_cheap_probe_in_a_limited_cgroup_rereads_usage_every_call():
    """The per-step path keeps the list of limited levels (no ancestor walk per step) but reads
    their usage every call: memory this process takes shows in the next reading."""
    own, why = _own_v1_memory_dir()
    if own is None:
        pytest.skip(f"cannot create a child memory cgroup: {why}")
    cg = os.path.join(own, f"mg-step-{os.getpid()}")
    code = r"""
import json
from memguard_core.probes import linux
from memguard_core.probes.linux import cgroup
from memguard_core.probes.linux import peak as lpeak
linux.probe(cheap=False); a = linux.probe(cheap=True)
buf = b"\x01" * (120 << 20)
b = linux.probe(cheap=True)
lpeak.reset_peak()
print(json.dumps({"a": a.available_bytes, "b": b.available_bytes, "limit": b.limit_bytes,
                  "levels": [d for _, d in cgroup.step_levels()[2]], "fast": lpeak.step_figures()}))
"""
    try:
        _makedirs_or_skip(cg, own)
        open(os.path.join(cg, "memory.limit_in_bytes"), "w").write(str(600 * MiB))
        res = _run_code_in_cgroup(cg, code)
        assert res["limit"] == 600 * MiB
        assert res["levels"] == [cg]                     # only the limited level is read per step
        assert res["a"] - res["b"] >= 100 * MiB
        assert res["fast"] is None          # a limited level: the step check takes the cheap probe
    finally:
        _rmdir(cg)


_MALLINFO_CHILD = r"""
import ctypes, json
from memguard_core.probes.linux import heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
libc = ctypes.CDLL(None)
r = {"in_use0": heap.malloc_in_use(), "rss0": rss()}
chunks = [bytearray(16 << 10) for _ in range(4096)]   # 64 MiB of 16 KiB heap chunks (under the mmap threshold)
for c in chunks:
    c[::4096] = b"\x01" * len(c[::4096])              # touch every page
fence = bytearray(16 << 10)                          # keeps the freed heap off the top (no automatic trim)
r.update(in_use1=heap.malloc_in_use(), rss1=rss())
del chunks
r.update(in_use2=heap.malloc_in_use(), rss2=rss())
libc.malloc_trim(0)
r.update(in_use3=heap.malloc_in_use(), rss3=rss())
print(json.dumps(r))
"""


@pytest.mark.skipif(heap.malloc_in_use() is None, reason="no glibc mallinfo2() here")
def test_malloc_in_use_counts_live_heap_and_not_what_malloc_trim_returns():
    """glibc's in-use bytes follow live allocations: 64 MiB of heap chunks raise them by 64 MiB,
    freeing the chunks lowers them while RSS stays (the free heap is kept), and ``malloc_trim``
    then lowers RSS but leaves them alone. This is what lets the monitor tell a clean that freed
    live memory from one that only returned heap the next micro-batch takes again. A fresh process,
    so the heap layout is this test's own."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _MALLINFO_CHILD], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert 63 * MiB <= r["in_use1"] - r["in_use0"] <= 70 * MiB
    assert r["rss1"] - r["rss0"] >= 60 * MiB
    assert r["in_use1"] - r["in_use2"] >= 63 * MiB         # freed: no longer live ...
    assert r["rss1"] - r["rss2"] <= 8 * MiB                # ... but still resident
    assert r["rss2"] - r["rss3"] >= 56 * MiB               # malloc_trim returns it to the kernel ...
    assert abs(r["in_use3"] - r["in_use2"]) <= 1 * MiB     # ... and frees nothing live
