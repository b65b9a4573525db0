"""Tests of the real-memory-limit harness (memguard_testing/cgroup_harness.py).

Everything that needs a cgroup runs against the kernel's real memory controller: a child cgroup
is created, a Python child allocates real pages in it, and the kernel's OOM killer really fires.
These tests are skipped, with the reason, where child memory cgroups cannot be created.
The parsing tests feed real-format /proc text (v2 and container layouts this machine lacks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from memguard_testing.cgroup_errors import CgroupError, CgroupLimitBusyError
from memguard_testing.cgroup_harness import MemoryCgroup, cgroups_writable
from memguard_testing.cgroup_locate import (
    MountEntry,
    locate_memory_cgroup,
    map_cgroup_path,
    parse_mountinfo,
    parse_proc_cgroup,
    swap_total_bytes,
)
from memguard_core.errors import ConfigError

MiB = 1 << 20

# Allocate argv[1] MiB and write one byte in every 4 KiB page, so every page is really charged.
ALLOC = """
import sys
n = int(sys.argv[1]) << 20
b = bytearray(n)
for i in range(0, n, 4096):
    b[i] = 1
print("survived", flush=True)
"""

# Hold argv[1] MiB (touched), say "held", then on each "grow N" line from stdin touch N MiB more
# and say "grown"; exit 0 at EOF.
HOLD = """
import sys
keep = []
def take(mib):
    b = bytearray(mib << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    keep.append(b)
take(int(sys.argv[1]))
print("held", flush=True)
for line in sys.stdin:
    if line.startswith("grow"):
        take(int(line.split()[1]))
        print("grown", flush=True)
"""


# --- parsing (no cgroup needed) -------------------------------------------------------------

MOUNTINFO_V1 = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
# A v2 container mount: only a sub-tree is mounted, at a path with a space (escaped \\040).
MOUNTINFO_V2 = (
    "29 22 0:26 /kubepods/pod1 /sys/fs/my\\040cgroup rw,nosuid shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)


def test_parse_proc_cgroup_v1_and_v2_lines():
    text = "4:memory:/process_api/abc\n2:cpu,cpuacct:/x\n0::/user.slice/a.scope\n"
    got = parse_proc_cgroup(text)
    assert got["memory"] == "/process_api/abc"
    assert got["cpu"] == got["cpuacct"] == "/x"
    assert got[""] == "/user.slice/a.scope"


def test_parse_mountinfo_finds_memory_and_unescapes():
    v1 = parse_mountinfo(MOUNTINFO_V1)
    mem = [m for m in v1 if m.fstype == "cgroup" and "memory" in m.super_options]
    assert [m.mountpoint for m in mem] == ["/sys/fs/cgroup/memory"]
    (v2,) = parse_mountinfo(MOUNTINFO_V2)
    assert v2.fstype == "cgroup2"
    assert v2.mountpoint == "/sys/fs/my cgroup"
    assert v2.root == "/kubepods/pod1"


def test_map_cgroup_path_respects_mount_root():
    full = MountEntry("/", "/sys/fs/cgroup/memory", "cgroup", ("rw", "memory"))
    assert map_cgroup_path(full, "/a/b") == "/sys/fs/cgroup/memory/a/b"
    assert map_cgroup_path(full, "/") == "/sys/fs/cgroup/memory"
    sub = MountEntry("/kubepods/pod1", "/sys/fs/cgroup", "cgroup2", ())
    assert map_cgroup_path(sub, "/kubepods/pod1/c1") == "/sys/fs/cgroup/c1"
    assert map_cgroup_path(sub, "/kubepods/pod1") == "/sys/fs/cgroup"
    assert map_cgroup_path(sub, "/kubepods/pod10") is None  # a prefix, not a parent
    assert map_cgroup_path(sub, "/other") is None


def test_locate_without_memory_controller_says_why():
    text = "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    with pytest.raises(CgroupError, match="no cgroup filesystem with a memory controller"):
        locate_memory_cgroup("2:cpu:/\n", text)


def test_bad_inputs_name_the_field():
    for bad in (0, -5, 1.5, "200M", True):
        with pytest.raises(ConfigError) as e:
            MemoryCgroup(bad)
        assert e.value.field == "limit_bytes"
    for bad in ("a/b", "", "x" * 65, "sp ace", 7):
        with pytest.raises(ConfigError) as e:
            MemoryCgroup(100 * MiB, name=bad)
        assert e.value.field == "name"


def test_cgroups_writable_reports_a_reason():
    ok, reason = cgroups_writable()
    assert isinstance(ok, bool) and reason  # a reason in both cases, for pytest.skip / logs


# --- real cgroups ---------------------------------------------------------------------------

def test_locate_finds_own_cgroup(require_cgroups):
    loc = locate_memory_cgroup()
    with open("/proc/self/cgroup") as f:
        own = parse_proc_cgroup(f.read())
    assert loc.cgroup_path == (own["memory"] if loc.version == 1 else own[""])
    limit_file = "memory.limit_in_bytes" if loc.version == 1 else "memory.max"
    assert os.path.exists(os.path.join(loc.directory, limit_file))
    with open(os.path.join(loc.directory, "cgroup.procs")) as f:
        assert str(os.getpid()) in f.read().split()


def test_child_runs_inside_the_cgroup(memory_cgroup):
    cg = memory_cgroup(100 * MiB, name="member")
    res = cg.run(["cat", "/proc/self/cgroup"], timeout=30)
    assert res.returncode == 0, res.stderr
    rel = os.path.relpath(cg.path, locate_memory_cgroup().directory)
    key = "memory" if cg.version == 1 else ""
    assert parse_proc_cgroup(res.stdout)[key].endswith("/" + rel)


def test_swap_cannot_extend_the_limit(memory_cgroup):
    """With swap the kill would not be reliable; the harness must wall it off."""
    cg = memory_cgroup(200 * MiB)
    if cg.version == 1:
        memsw = os.path.join(cg.path, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            with open(memsw) as f:
                assert int(f.read()) == cg.limit_bytes() == 200 * MiB
        elif swap_total_bytes() > 0:
            pytest.fail("swap exists and the kernel has no memsw: the limit is not a hard wall")
    else:
        swap_max = os.path.join(cg.path, "memory.swap.max")
        if os.path.exists(swap_max):
            with open(swap_max) as f:
                assert f.read().strip() == "0"
    # On this machine: no swap at all (free: Swap 0).
    print("SwapTotal bytes:", swap_total_bytes())


def test_a_over_limit_child_is_oom_killed(memory_cgroup):
    limit = 200 * MiB
    cg = memory_cgroup(limit, name="oom")
    before = cg.oom_kill_count()
    res = cg.run([sys.executable, "-c", ALLOC, "400"], timeout=120)
    assert res.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), res
    assert "survived" not in res.stdout
    assert res.oom_kills >= 1
    assert cg.oom_kill_count() == before + res.oom_kills
    assert res.killed_by_oom is True
    assert not res.timed_out
    # it really filled the cgroup up to the wall, and not beyond
    assert limit * 0.8 <= res.max_usage_bytes <= limit


def test_b_under_limit_child_completes(memory_cgroup):
    limit = 200 * MiB
    cg = memory_cgroup(limit, name="fits")
    res = cg.run([sys.executable, "-c", ALLOC, "50"], timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "survived"
    assert res.killed_by_oom is False and res.oom_kills == 0
    # charged to this cgroup (so it ran inside), below the limit
    assert 50 * MiB <= res.max_usage_bytes < limit
    assert res.wall_s > 0


def test_run_is_reusable_and_max_usage_is_per_run(memory_cgroup):
    cg = memory_cgroup(300 * MiB)
    big = cg.run([sys.executable, "-c", ALLOC, "150"], timeout=120)
    small = cg.run([sys.executable, "-c", ALLOC, "20"], timeout=120)
    assert big.returncode == small.returncode == 0
    if cg.version == 1:  # v1 resets the peak per run; v2 memory.peak is since creation
        assert small.max_usage_bytes < 100 * MiB < 150 * MiB <= big.max_usage_bytes


def test_c_cgroup_removed_on_exit(require_cgroups):
    with MemoryCgroup(100 * MiB) as cg:
        path = cg.path
        assert os.path.isdir(path)
        assert cg.run(["true"], timeout=30).returncode == 0
    assert not os.path.exists(path)
    with pytest.raises(CgroupError):
        cg.path  # not active any more


def test_c_cgroup_removed_when_body_raises_with_process_inside(require_cgroups):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with MemoryCgroup(100 * MiB, name="raises") as cg:
            path = cg.path
            proc = cg.popen(["sleep", "60"])
            deadline = time.monotonic() + 10
            while proc.pid not in cg.pids() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proc.pid in cg.pids()
            raise Boom()
    assert not os.path.exists(path)
    assert proc.returncode == -signal.SIGKILL  # killed and reaped by the cleanup


def test_timeout_kills_and_reports(memory_cgroup):
    cg = memory_cgroup(100 * MiB)
    res = cg.run(["sleep", "30"], timeout=0.5)
    assert res.timed_out and res.returncode == -signal.SIGKILL
    assert res.killed_by_oom is False and res.oom_kills == 0
    assert res.wall_s < 10
    assert cg.pids() == []


def test_d_set_limit_on_a_running_child(memory_cgroup):
    """Lowering the limit mid-run.

    v1 (this machine): below usage the kernel cannot reclaim anonymous memory (no swap), so the
    write fails with EBUSY -> CgroupLimitBusyError, the old limit stays and the child lives.
    A lower limit that is still above usage is accepted, and the child is OOM-killed as soon
    as it grows past it. v2: a limit below usage is accepted and the kernel OOM-kills at once.
    """
    cg = memory_cgroup(300 * MiB, name="lower")
    proc = cg.popen([sys.executable, "-c", HOLD, "150"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    usage = cg.usage_bytes()
    assert 150 * MiB <= usage < 190 * MiB
    ooms = cg.oom_kill_count()

    if cg.version == 1:
        with pytest.raises(CgroupLimitBusyError) as e:
            cg.set_limit(100 * MiB)
        assert e.value.requested_bytes == 100 * MiB
        assert e.value.limit_bytes == 300 * MiB and e.value.usage_bytes >= 150 * MiB
        assert cg.limit_bytes() == 300 * MiB  # unchanged
        assert proc.poll() is None            # nobody was killed
        assert cg.oom_kill_count() == ooms

        cg.set_limit(200 * MiB)               # below the old limit, above usage: accepted
        assert cg.limit_bytes() == 200 * MiB
        assert proc.poll() is None
        proc.stdin.write("grow 100\n")        # 150 + 100 MiB > 200 MiB
        proc.stdin.flush()
    else:
        cg.set_limit(100 * MiB)               # v2: accepted, the kernel kills to fit

    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert cg.oom_kill_count() == ooms + 1
    assert cg.usage_bytes() < 100 * MiB       # the memory went back with the process
