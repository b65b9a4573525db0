"""macOS, Windows, CUDA and MLX probes, and device selection.

What this Linux machine cannot have is replaced at the thinnest boundary, and said so:
- macOS: the parse functions are fed text in the exact format of ``vm_stat`` and
  ``sysctl`` output (tests/fixtures/probes/darwin_*.txt, written after macOS 14 output on an
  M2 16 GB and an Intel 8 GB Mac; not captured on this machine). The subprocess itself is
  not exercised.
- Windows: MEMORYSTATUSEX field values (windows_win11_32gb_memorystatusex.json) go through
  the parse function and the real ctypes struct layout; GlobalMemoryStatusEx is not called.
- CUDA: a thin fake of the torch.cuda counter functions (no CUDA device here), read by torch's
  probe (``memguard_torch.probes_cuda``) through the core's registry.
- MLX: the real mlx (``mlx[cpu]``) when installed, else skipped (``memguard_mlx.probes``).
"""

import json
import logging
import os
import subprocess
import sys
import types

import pytest

from memguard_core.errors import ConfigError
from memguard_core.probes import MemorySnapshot, darwin, nvml, probe, resolve_device, windows
from memguard_core.probes.common import reset_warned
from memguard_testing.fakes import FakeTorchCuda, use_fake_torch
from memguard_torch import probes_cuda as cuda

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FIX = os.path.join(HERE, "fixtures", "probes")
MiB, GiB = 1 << 20, 1 << 30


def _fix(name):
    return open(os.path.join(FIX, name)).read()


@pytest.fixture(autouse=True)
def _fresh():
    reset_warned()
    cuda._reset_baseline()
    yield
    cuda._reset_baseline()


# ---------------------------------------------------------------- darwin

def test_parse_vm_stat_m2():
    vm = darwin.parse_vm_stat(_fix("darwin_m2_16gb_vm_stat.txt"))
    assert vm["page_size"] == 16384
    assert (vm["free"], vm["inactive"], vm["speculative"]) == (4862, 340622, 3170)
    assert vm["wired_down"] == 158317
    assert vm["occupied_by_compressor"] == 181021
    assert vm["file_backed"] == 222863 and vm["anonymous"] == 465140
    assert vm["translation_faults"] == 965387207
    assert darwin.available_from_vm_stat(vm) == (4862 + 3170 + 340622) * 16384


def test_darwin_snapshot_m2():
    s = darwin.snapshot_from_outputs(_fix("darwin_m2_16gb_vm_stat.txt"),
                                     _fix("darwin_m2_16gb_sysctl.txt"), rss=3 * GiB,
                                     peak=4 * GiB, now=1.0)
    assert s.source == "darwin" and s.device == "cpu" and s.limit_source == "host"
    assert s.total_bytes == 17179869184
    assert s.available_bytes == 348654 * 16384
    assert s.pressure == 66.0                     # 100 - kern.memorystatus_level (34)
    assert s.limit_bytes is None
    assert (s.process_bytes, s.process_peak_bytes, s.timestamp) == (3 * GiB, 4 * GiB, 1.0)
    # the vm_stat figure and the kernel's memorystatus level agree to within 2 points
    assert abs((1 - s.used_fraction) * 100 - 34) < 2


def test_darwin_snapshot_intel_4k_pages():
    s = darwin.snapshot_from_outputs(_fix("darwin_intel_8gb_vm_stat.txt"),
                                     _fix("darwin_intel_8gb_sysctl.txt"), rss=1, peak=None)
    assert s.total_bytes == 8 * GiB
    assert s.available_bytes == (21488 + 13519 + 673395) * 4096
    assert s.pressure == 67.0


def test_parse_sysctl_keeps_raw_values():
    sc = darwin.parse_sysctl(_fix("darwin_m2_16gb_sysctl.txt"))
    assert sc["hw.memsize"] == "17179869184"
    assert sc["vm.swapusage"].startswith("total = 2048.00M")


def test_darwin_garbage_is_logged_and_degrades(caplog):
    vm = _fix("darwin_m2_16gb_vm_stat.txt").replace("Pages inactive:                          340622.",
                                                  "Pages inactive:                          lots.")
    sc = "hw.memsize: 17179869184\nkern.memorystatus_level: 340\n"
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        s = darwin.snapshot_from_outputs(vm, sc, rss=0, peak=None)
    assert s.pressure is None                     # 340 % is nonsense -> dropped
    assert s.total_bytes == 17179869184
    assert s.available_bytes == 0                 # no inactive and no level: nothing to trust
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "Pages inactive" in msgs and "memorystatus_level" in msgs


def test_darwin_level_used_when_vm_stat_missing():
    s = darwin.snapshot_from_outputs("", _fix("darwin_m2_16gb_sysctl.txt"), rss=0, peak=None)
    assert s.available_bytes == 17179869184 * 34 // 100


# ---------------------------------------------------------------- windows

def test_memorystatusex_struct_layout():
    import ctypes

    assert ctypes.sizeof(windows.MEMORYSTATUSEX) == 64       # sizeof on Windows x64 and x86
    st = windows.MEMORYSTATUSEX()
    rec = json.loads(_fix("windows_win11_32gb_memorystatusex.json"))
    for name in windows.FIELDS:
        setattr(st, name, rec[name])
    assert windows.struct_to_fields(st) == {k: rec[k] for k in windows.FIELDS}


def test_windows_snapshot_recorded():
    rec = json.loads(_fix("windows_win11_32gb_memorystatusex.json"))
    p = windows.parse_memorystatusex(rec)
    assert p == {"total": 34197790720, "available": 18124828672, "load_percent": 47,
                 "commit_limit": 39566499840, "commit_available": 17130967040}
    # dwMemoryLoad is the kernel's rounded used percentage of physical memory: it must match ours
    assert round((1 - p["available"] / p["total"]) * 100) == rec["dwMemoryLoad"]
    s = windows.snapshot_from_fields(rec, rss=2 * GiB, peak=3 * GiB, now=2.0)
    assert s.source == "windows" and s.total_bytes == 34197790720 and s.pressure is None
    # this desktop had less commit left (17.1 GB) than free RAM (18.1 GB): an allocation beyond the
    # commit left fails, so that is what is available
    assert s.available_bytes == 17130967040
    assert (s.address_limit_source, s.address_limit_bytes, s.address_headroom_bytes) == \
        ("commit-limit", 39566499840, 17130967040)
    # without the commit fields (psutil alone) the physical figures stand
    s = windows.snapshot_from_fields({"ullTotalPhys": 100, "ullAvailPhys": 40}, rss=1, peak=None)
    assert s.available_bytes == 40 and s.address_limit_source is None


def test_windows_inconsistent_fields_clamped(caplog):
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        p = windows.parse_memorystatusex({"ullTotalPhys": 100, "ullAvailPhys": 200,
                                          "dwMemoryLoad": 101})
    assert p == {"total": 100, "available": 100, "load_percent": None, "commit_limit": None,
                 "commit_available": None}
    assert len(caplog.records) == 2
    assert windows.parse_memorystatusex({"ullTotalPhys": -1})["total"] is None


# ---------------------------------------------------------------- cuda (fake torch.cuda)

class FakeNvml:
    """Thin fake of pynvml's per-process query (no NVIDIA driver here)."""

    def __init__(self, procs):
        self.procs = procs
        self.uuids = []

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.uuids.append(uuid)
        return "h0"

    def nvmlDeviceGetHandleByIndex(self, i): return f"h{i}"
    def nvmlDeviceGetComputeRunningProcesses(self, h): return self.procs


def _h100(**kw):
    # 80 GiB card: our allocator holds 30 GiB reserved / 20 GiB allocated; another process
    # holds 10 GiB and our context ~0.5 GiB, so the driver reports 39.5 GiB free
    args = dict(allocated=20 * GiB, reserved=30 * GiB, peak_alloc=25 * GiB, peak_res=32 * GiB,
                free=int(39.5 * GiB), total=80 * GiB)
    args.update(kw)
    return FakeTorchCuda(**args)


def test_cuda_full_probe_interpretation():
    tc = _h100()
    nv = FakeNvml([types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=int(30.5 * GiB)),
                   types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=10 * GiB)])
    s = cuda.probe(0, torch_cuda=tc, nvml=nv)
    assert s.device == "cuda:0" and s.source == "cuda" and s.limit_source == "cuda"
    assert s.total_bytes == 80 * GiB
    # driver free + our 10 GiB of cached (reserved - allocated) blocks
    assert s.available_bytes == int(39.5 * GiB) + 10 * GiB
    assert s.process_bytes == int(30.5 * GiB)           # NVML: context + reserved
    assert s.process_peak_bytes == 32 * GiB             # max_memory_reserved
    assert nv.uuids == ["GPU-0b1c2d3e-aaaa-bbbb-cccc-1234567890ab"]


def test_cuda_cheap_uses_counters_only_after_baseline():
    tc = _h100()
    nv = FakeNvml([types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=int(30.5 * GiB))])
    cuda.probe(0, torch_cuda=tc, nvml=nv)
    assert tc.mem_get_info_calls == 1
    tc.allocated, tc.reserved = 36 * GiB, 38 * GiB     # the step grew the allocator
    s = cuda.probe(0, cheap=True, torch_cuda=tc, nvml=None)
    assert tc.mem_get_info_calls == 1                   # no driver call on the cheap path
    # outside = 80 - 39.5 - 30 = 10.5 GiB (other process + context), stays as last seen
    assert s.available_bytes == (80 * GiB - int(10.5 * GiB) - 38 * GiB) + 2 * GiB
    assert s.process_bytes == 38 * GiB + int(0.5 * GiB)  # reserved + learned context


def test_cuda_cheap_first_call_and_no_nvml():
    tc = _h100()
    s = cuda.probe(0, cheap=True, torch_cuda=tc)
    assert tc.mem_get_info_calls == 1
    assert s.process_bytes == 30 * GiB                   # no NVML: reserved
    assert s.available_bytes == int(39.5 * GiB) + 10 * GiB


def test_cuda_device_via_package_probe(monkeypatch):
    tc = _h100()
    monkeypatch.setattr(cuda, "torch_cuda_module", lambda: tc)
    monkeypatch.setattr(nvml, "nvml_module", lambda nvml=None: None)
    s = probe("cuda:0")
    assert s.device == "cuda:0" and s.total_bytes == 80 * GiB


def test_cuda_counter_failure_falls_back(monkeypatch, caplog):
    tc = _h100()

    def boom(i):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    tc.memory_allocated = boom
    monkeypatch.setattr(cuda, "torch_cuda_module", lambda: tc)
    with caplog.at_level(logging.WARNING, logger="memguard.probes"):
        s = probe("cuda:0")
    assert s.source == "psutil" and s.device == "cuda:0"
    assert "CUDA probe failed" in caplog.text


# ---------------------------------------------------------------- device selection

def test_bad_device_is_config_error():
    for bad in ("gpu", "cuda:x", "", None, "cuda:0:1"):
        with pytest.raises(ConfigError) as ei:
            resolve_device(bad)
        assert ei.value.field == "device"


def test_cuda_requested_without_cuda_is_config_error():
    # this machine: torch is CPU-only
    with pytest.raises(ConfigError):
        probe("cuda")


def test_auto_never_imports_torch_or_mlx():
    code = ("import sys; from memguard_core.probes import probe; s = probe(); "
            "from memguard_core import stats; stats.memory_stats(); "
            "print(s.device, 'torch' in sys.modules, 'mlx.core' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "False", "False"]


def test_auto_with_torch_cpu_only_is_cpu():
    pytest.importorskip("memguard_torch")         # registers the cuda and mps probes
    assert resolve_device("auto") == "cpu"          # torch imported, CUDA not available


def test_auto_picks_cuda_when_torch_cuda_available(monkeypatch):
    tc = _h100()
    use_fake_torch(monkeypatch, types.SimpleNamespace(cuda=tc))
    assert resolve_device("auto") == "cuda:0"


# ---------------------------------------------------------------- mlx (real, mlx[cpu])

def test_mlx_probe_real_counters():
    mx = pytest.importorskip("mlx.core")
    from memguard_mlx import probes as mlxp

    assert resolve_device("auto") == "cpu" or mlxp.metal_available(mx)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    a = mx.ones((64, 1024, 1024), dtype=mx.float32)      # 256 MiB
    mx.eval(a)
    s = probe("mlx")
    assert s.device == "mlx" and s.source == "mlx"
    assert s.process_bytes - base >= 256 * MiB
    assert s.process_peak_bytes >= s.process_bytes
    if not mlxp.metal_available(mx):
        host = probe("cpu")
        assert s.total_bytes == host.total_bytes and s.limit_source == host.limit_source
        assert 0 < s.available_bytes <= s.total_bytes
    del a


def test_mlx_metal_interpretation_with_fake_module():
    # fake mlx.core with Metal (no Apple GPU here): checks total/available arithmetic only
    fake = types.SimpleNamespace(
        get_active_memory=lambda: 6 * GiB, get_peak_memory=lambda: 7 * GiB,
        get_cache_memory=lambda: 1 * GiB, get_memory_limit=lambda: 0,
        device_info=lambda: {"memory_size": 16 * GiB,
                             "max_recommended_working_set_size": 12 * GiB},
        metal=types.SimpleNamespace(is_available=lambda: True))
    from memguard_mlx import probes as mlxp

    host = MemorySnapshot("cpu", 16 * GiB, 4 * GiB, 8 * GiB, None, 40.0, None, "host",
                          "darwin", 0.0)
    s = mlxp.probe(mx=fake, host=host)
    assert s.total_bytes == s.limit_bytes == 12 * GiB and s.limit_source == "mlx"
    # min(12 - 6 active, host 4 + 1 cache)
    assert s.available_bytes == 5 * GiB
    assert (s.process_bytes, s.process_peak_bytes, s.pressure) == (6 * GiB, 7 * GiB, 40.0)


# ---------------------------------------------------------------- live bytes (judging a clean)

def test_live_bytes_mlx_follows_live_arrays_not_the_cache():
    """Real mlx: active memory rises with a live array and falls when it is freed (the buffer goes
    to MLX's cache, or back to the system on the CPU allocator); ``clear_cache`` (what a clean does)
    leaves live bytes alone."""
    mx = pytest.importorskip("mlx.core")
    from memguard_core.probes import live_bytes

    base = live_bytes("mlx")
    a = mx.ones((16, 1024, 1024), dtype=mx.float32)      # 64 MiB
    mx.eval(a)
    assert live_bytes("mlx") - base >= 64 * MiB
    del a
    freed = live_bytes("mlx")
    assert freed - base < MiB
    mx.clear_cache()
    assert abs(live_bytes("mlx") - freed) < MiB


def test_live_bytes_cuda_is_memory_allocated(monkeypatch):
    """No CUDA device here: ``torch`` is a thin fake whose ``cuda`` holds the counters."""
    tc = _h100()
    use_fake_torch(monkeypatch, types.SimpleNamespace(cuda=tc))
    from memguard_core.probes import live_bytes

    assert live_bytes("cuda:0") == 20 * GiB              # allocated, not the 30 GiB reserved
    tc.memory_allocated = lambda i: (_ for _ in ()).throw(RuntimeError("CUDA error"))
    assert live_bytes("cuda:0") is None                  # a failing counter is "unknown", never raised


def test_live_bytes_unknown_off_linux(monkeypatch):
    import memguard_core.probes as probes

    monkeypatch.setattr(probes.host, "host_source", lambda: "darwin")
    assert probes.live_bytes("cpu") is None


def test_windows_probe_takes_psutil_and_the_commit_limit(monkeypatch):
    """No Windows here: GlobalMemoryStatusEx is replaced by its recorded values; psutil is real."""
    import psutil

    rec = json.loads(_fix("windows_win11_32gb_memorystatusex.json"))
    monkeypatch.setattr(windows, "read_memorystatusex", lambda: {k: rec[k] for k in windows.FIELDS})
    s = windows.probe()
    assert s.total_bytes == psutil.virtual_memory().total
    assert s.available_bytes <= min(psutil.virtual_memory().total, 17130967040)
    assert s.address_limit_source == "commit-limit" and s.address_headroom_bytes == 17130967040

    def fail():
        raise OSError("GlobalMemoryStatusEx failed")
    monkeypatch.setattr(windows, "read_memorystatusex", fail)
    s = windows.probe()
    assert s.total_bytes == psutil.virtual_memory().total and s.address_limit_source is None
