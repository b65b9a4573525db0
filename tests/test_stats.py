"""memguard_core.stats: per-device memory statistics, the log line and the peak reset.

cpu runs for real on this machine (Linux, clear_refs writable as root); mlx with the real
mlx[cpu] if installed; cuda through a thin fake of torch.cuda (no CUDA device here).
"""

import re

import pytest

from memguard_core import stats
from memguard_core.errors import ConfigError
from memguard_core.probes.common import reset_warned
from memguard_torch import probes_cuda as cuda

MiB, GiB = 1 << 20, 1 << 30
KEYS = {"allocated_bytes", "reserved_bytes", "peak_bytes", "free_bytes", "total_bytes",
        "utilization"}


@pytest.fixture(autouse=True)
def _fresh():
    reset_warned()
    cuda._reset_baseline()
    stats._cpu_baseline = None
    yield
    stats._cpu_baseline = None
    cuda._reset_baseline()


def test_cpu_stats_consistent():
    s = stats.memory_stats("cpu")
    assert KEYS <= set(s)
    assert s["device"] == "cpu" and s["source"] == "linux"
    assert s["allocated_bytes"] == s["reserved_bytes"] > 1 * MiB
    assert s["peak_bytes"] >= s["allocated_bytes"]
    assert 0 < s["free_bytes"] <= s["total_bytes"]
    assert s["utilization"] == pytest.approx(1 - s["free_bytes"] / s["total_bytes"])
    assert stats.memory_utilization("cpu") == pytest.approx(s["utilization"], abs=0.02)


def test_format_cpu_line():
    line = stats.format_memory_stats("cpu")
    assert re.fullmatch(r"cpu mem: \d+\.\d GiB rss, \d+\.\d GiB peak / \d+\.\d GiB "
                        r"(total \(host\)|limit \(cgroup-v[12]\)) \(\d+%\)", line), line


def test_bad_device():
    with pytest.raises(ConfigError):
        stats.memory_stats("tpu")
    with pytest.raises(ConfigError):
        stats.reset_peak_memory("gpu0")


def test_cpu_reset_peak_kernel():
    buf = bytearray(300 * MiB)
    del buf
    high = stats.memory_stats("cpu")["peak_bytes"]
    how = stats.reset_peak_memory("cpu")
    if how != "kernel":
        pytest.skip("/proc/self/clear_refs not writable here")
    after = stats.memory_stats("cpu")
    assert high - after["peak_bytes"] >= 250 * MiB       # VmHWM went back to about the RSS
    assert after["peak_bytes"] >= after["allocated_bytes"]


def test_cpu_reset_peak_software_baseline(tmp_path):
    buf = bytearray(300 * MiB)
    del buf
    high = stats.memory_stats("cpu")["peak_bytes"]
    # a proc root without clear_refs: the kernel reset is impossible
    assert stats.reset_peak_memory("cpu", proc_root=str(tmp_path)) == "software"
    s = stats.memory_stats("cpu")
    assert high - s["peak_bytes"] >= 250 * MiB
    assert s["peak_bytes"] >= s["allocated_bytes"]
    # a new peak above the old high-water mark is reported exactly by the OS figure again
    buf = bytearray(high - s["allocated_bytes"] + 100 * MiB)
    s2 = stats.memory_stats("cpu")
    del buf
    assert s2["peak_bytes"] >= high + 50 * MiB


def test_cuda_stats_and_format(monkeypatch, fake_torch_cuda):
    tc = fake_torch_cuda(allocated=12 * GiB, reserved=16 * GiB, peak_alloc=15 * GiB, peak_res=17 * GiB,
                         free=60 * GiB, total=80 * GiB, uuid=None)
    monkeypatch.setattr(cuda, "torch_cuda_module", lambda: tc)
    s = stats.memory_stats("cuda:0")
    assert (s["allocated_bytes"], s["reserved_bytes"], s["peak_bytes"]) == (12 * GiB, 16 * GiB,
                                                                              15 * GiB)
    assert s["total_bytes"] == 80 * GiB
    assert s["free_bytes"] == 64 * GiB                   # 60 free + 4 cached in our allocator
    assert s["utilization"] == pytest.approx(0.2)
    assert stats.format_memory_stats("cuda") == (
        "cuda:0 mem: 12.0 GiB allocated, 15.0 GiB peak, 16.0 GiB reserved / 80.0 GiB total "
        "(cuda) (20%)")
    assert stats.reset_peak_memory("cuda:0") == "allocator" and tc.resets == [0]
    assert stats.memory_stats("cuda:0")["peak_bytes"] == 12 * GiB


def test_mlx_stats_and_reset():
    mx = pytest.importorskip("mlx.core")
    a = mx.ones((32, 1024, 1024), dtype=mx.float32)   # 128 MiB
    mx.eval(a)
    s = stats.memory_stats("mlx")
    assert s["device"] == "mlx" and s["allocated_bytes"] >= 128 * MiB
    assert s["reserved_bytes"] == s["allocated_bytes"] + mx.get_cache_memory()
    assert s["peak_bytes"] >= s["allocated_bytes"]
    del a
    mx.clear_cache()
    assert stats.reset_peak_memory("mlx") == "allocator"
    after = stats.memory_stats("mlx")
    assert after["peak_bytes"] < s["peak_bytes"] - 100 * MiB
    assert re.match(r"mlx mem: \d+\.\d GiB active, \d+\.\d GiB peak, \d+\.\d GiB cache / ",
                    stats.format_memory_stats("mlx"))
