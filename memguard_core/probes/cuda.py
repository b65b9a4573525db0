"""CUDA memory probe: torch.cuda caching-allocator counters, ``mem_get_info``, NVML.

Sources (PyTorch docs, "CUDA semantics / memory management" and torch/cuda/memory.py):
- ``torch.cuda.memory_allocated(i)``: bytes held by live tensors; ``memory_reserved(i)``: bytes
  the caching allocator holds from the driver (>= allocated; the gap is cached free blocks);
  ``max_memory_allocated`` / ``max_memory_reserved``: their peaks since the last
  ``reset_peak_memory_stats``. These are host-side counters: no driver call, no sync.
- ``torch.cuda.mem_get_info(i)`` -> ``(free, total)`` from ``cudaMemGetInfo``: device-wide, so
  it sees other processes and this process's CUDA context and non-PyTorch allocations.
- NVML (``pynvml`` from nvidia-ml-py) ``nvmlDeviceGetComputeRunningProcesses``:
  ``usedGpuMemory`` per process = this process's whole footprint (context + reserved + other
  libraries). Used only in the non-cheap path, and only if installed.

Snapshot meaning on CUDA: ``total`` = device total; ``available`` = driver free memory +
nothing else (cached blocks of our allocator are NOT counted as free by the driver, but our
allocator can reuse them: ``available = free + (reserved - allocated)``); ``process_bytes`` =
NVML footprint if known, else reserved (+ the context overhead learned from the last NVML
reading); ``process_peak_bytes`` = ``max_memory_reserved``.

The cheap path (per training step) reads only the allocator counters; the device-wide part
(``total - free - reserved``: other processes + context) is taken from the last full reading
(one ``mem_get_info`` on the first cheap call per device if there was none), so it does not
see other processes change until the next full probe.

torch is never imported at module level; :func:`torch_cuda_module` imports it only when a
CUDA device was asked for explicitly.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, Optional

from memguard_core.probes import MemorySnapshot, StepReader, _torch_backend, _warn_once, log

__all__ = ["CudaCounters", "torch_cuda_module", "read_counters", "reset_peak", "nvml_process_bytes",
           "snapshot_from_counters", "probe", "step_reader", "CudaStepReader", "allocator_settings",
           "expandable_segments", "ALLOC_CONF_NAMES"]


@dataclass(frozen=True)
class CudaCounters:
    """Caching-allocator counters of one device: bytes, and two counts since the process started
    (or ``torch.cuda.reset_accumulated_memory_stats``), None where they were not read:
    ``alloc_retries`` (``num_alloc_retries``: a ``cudaMalloc`` failed, the allocator freed its
    cached blocks and retried) and ``ooms`` (``num_ooms``: out-of-memory errors it raised)."""

    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    alloc_retries: Optional[int] = None
    ooms: Optional[int] = None


def torch_cuda_module():
    """``torch.cuda`` if CUDA is available (imports torch if not yet imported), else None."""
    return _torch_backend("cuda", lambda torch: torch.cuda.is_available())


def read_counters(index: int, torch_cuda) -> CudaCounters:
    """Allocator counters of device ``index`` (no driver call, no synchronisation).

    One ``torch.cuda.memory_stats_as_nested_dict(index)`` call where torch has it (the allocator's
    own stats struct, host-side): ``memory_allocated``, ``memory_reserved`` and their ``max_``
    forms each build and flatten the whole ``memory_stats`` dict again (torch/cuda/memory.py), so
    four of them cost four times one nested read. The four functions otherwise (then without the
    two counts)."""
    nested = getattr(torch_cuda, "memory_stats_as_nested_dict", None)
    if nested is not None:
        st = nested(index)

        def stat(name: str, which: str) -> int:
            return int(((st.get(name) or {}).get("all") or {}).get(which, 0))

        return CudaCounters(allocated=stat("allocated_bytes", "current"), reserved=stat("reserved_bytes", "current"),
                            peak_allocated=stat("allocated_bytes", "peak"), peak_reserved=stat("reserved_bytes", "peak"),
                            alloc_retries=int(st.get("num_alloc_retries", 0)), ooms=int(st.get("num_ooms", 0)))
    return CudaCounters(
        allocated=int(torch_cuda.memory_allocated(index)),
        reserved=int(torch_cuda.memory_reserved(index)),
        peak_allocated=int(torch_cuda.max_memory_allocated(index)),
        peak_reserved=int(torch_cuda.max_memory_reserved(index)),
    )


def reset_peak(index: int, torch_cuda=None) -> None:
    """Start a new peak window of device ``index``'s allocator counters
    (``torch.cuda.reset_peak_memory_stats``; ``max_memory_reserved`` is the snapshot's peak).

    Raises:
        RuntimeError: torch has no CUDA here; else whatever torch raises.
    """
    tc = torch_cuda if torch_cuda is not None else torch_cuda_module()
    if tc is None:
        raise RuntimeError("torch with CUDA is not available")
    tc.reset_peak_memory_stats(index)


class CudaStepReader(StepReader):
    """The runtime monitor's reader on CUDA device ``index``: the probe through
    ``probes.probe("cuda:<index>")`` (allocator counters on the cheap path, psutil if it fails),
    the allocator's peak reset (:func:`reset_peak`) and ``memory_allocated`` as the live bytes
    (read only where torch is already imported). No snapshot-free path: the counters are
    host-side already; no pressure signal.

    Each peak reset closes a *window* (a step sample's: the micro-batches since the one before):
    the counters are read once more right before it (:func:`read_counters`, one host-side call)
    and kept in :attr:`window`: the window's peaks of reserved and allocated bytes (the
    fragmentation at the peak is their difference) and the allocator's ``num_alloc_retries`` /
    ``num_ooms`` counts at its end (the monitor's allocator-retry signal). A failed read leaves
    ``window`` None; the reset happens either way."""

    def __init__(self, index: int = 0):
        super().__init__(f"cuda:{index}", reset_peak=self._close_window, live_bytes=self._live)
        self.index = int(index)
        #: the counters read as the last window closed, or None (not read, or taken by the monitor)
        self.window: Optional[CudaCounters] = None

    def _live(self) -> Optional[int]:
        torch = sys.modules.get("torch")
        return None if torch is None else int(torch.cuda.memory_allocated(self.index))

    def _close_window(self) -> None:
        tc = torch_cuda_module()
        try:
            self.window = read_counters(self.index, tc) if tc is not None else None
        except Exception as exc:
            self.window = None
            _warn_once(f"cuda.window:{self.index}", "memguard: CUDA window counters not read: %r", exc)
        reset_peak(self.index, tc)


def step_reader(index: int = 0) -> CudaStepReader:
    """The runtime monitor's reader on CUDA device ``index`` (:class:`CudaStepReader`)."""
    return CudaStepReader(index)


#: The environment variables the CUDA caching allocator reads its settings from, in the order
#: torch 2.13 reads them (c10/cuda/CUDAAllocatorConfig.h: ``PYTORCH_CUDA_ALLOC_CONF``, on ROCm
#: ``PYTORCH_HIP_ALLOC_CONF``, then ``PYTORCH_ALLOC_CONF``, the device-generic name of torch >= 2.9).
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings(torch_module=None, environ=None) -> str:
    """The caching allocator's settings string (``key:value,...``): what torch parsed last
    (``torch._C._accelerator_getAllocatorSettings()``, torch >= 2.9: the environment variable at
    start, or a later ``torch._C._accelerator_setAllocatorSettings``), else the first of
    :data:`ALLOC_CONF_NAMES` set in ``environ`` (default ``os.environ``); ``""`` when none.
    ``torch_module``: the ``torch`` module (default: the imported one, never imported here)."""
    torch = torch_module if torch_module is not None else sys.modules.get("torch")
    getter = getattr(getattr(torch, "_C", None), "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            return str(getter() or "")
        except Exception as exc:
            log.debug("memguard: allocator settings not read from torch: %r", exc)
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_NAMES:
        if name in env:
            return str(env[name])
    return ""


def expandable_segments(settings: str) -> Optional[bool]:
    """Whether an allocator settings string (:func:`allocator_settings`) turns the caching
    allocator's expandable segments on: the last ``expandable_segments:`` entry (``True`` / ``true``
    on, anything else off; absent: off, torch's default). None where they do not apply: the
    ``backend:cudaMallocAsync`` allocator (the driver's pool, no segments of torch's)."""
    on = False
    for part in str(settings).split(","):
        key, _, value = part.strip().partition(":")
        key, value = key.strip(), value.strip()
        if key == "backend" and value == "cudaMallocAsync":
            return None
        if key == "expandable_segments":
            on = value.lower() == "true"
    return on


_nvml_state: Dict[str, object] = {"init": None}
_nvml_lock = threading.Lock()


def _nvml(nvml=None):
    """The initialised ``pynvml`` module, or None (not installed / no driver)."""
    if nvml is not None:
        return nvml
    with _nvml_lock:
        if _nvml_state["init"] is False:
            return None
        if _nvml_state["init"] is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_state["init"] = pynvml
            except Exception as exc:
                log.debug("memguard: NVML unavailable: %r", exc)
                _nvml_state["init"] = False
                return None
        return _nvml_state["init"]


def _nvml_handle(nvml, index: int, torch_cuda):
    """NVML handle of torch's device ``index`` (UUID first, so CUDA_VISIBLE_DEVICES holds)."""
    try:
        uuid = getattr(torch_cuda.get_device_properties(index), "uuid", None)
        if uuid is not None:
            s = str(uuid)
            return nvml.nvmlDeviceGetHandleByUUID(s if s.startswith("GPU-") else "GPU-" + s)
    except Exception:
        pass
    return nvml.nvmlDeviceGetHandleByIndex(index)


def nvml_process_bytes(index: int, torch_cuda, *, pid: Optional[int] = None,
                       nvml=None) -> Optional[int]:
    """This process's memory on device ``index`` per NVML (``usedGpuMemory``), bytes.

    Returns None if NVML is not installed, the process is not listed (e.g. a container's PID
    namespace hides it) or the driver does not report per-process usage.
    """
    nv = _nvml(nvml)
    if nv is None:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        handle = _nvml_handle(nv, index, torch_cuda)
        used = None
        for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):
            if getattr(p, "pid", None) == pid and getattr(p, "usedGpuMemory", None) is not None:
                used = (used or 0) + int(p.usedGpuMemory)
        return used
    except Exception as exc:
        _warn_once(f"nvml:{index}", "memguard: NVML per-process query failed: %r", exc)
        return None


def snapshot_from_counters(index: int, counters: CudaCounters, free: int, total: int, *,
                           process_bytes: Optional[int] = None,
                           now: Optional[float] = None) -> MemorySnapshot:
    """Interpret counters + ``mem_get_info`` as a :class:`MemorySnapshot` (see module doc).

    Args:
        index: device index.
        counters: allocator counters.
        free, total: ``torch.cuda.mem_get_info(index)`` (driver-wide), bytes.
        process_bytes: this process's whole footprint (NVML) if known, else reserved is used.
    """
    cached = max(0, counters.reserved - counters.allocated)
    avail = max(0, min(total, free + cached))
    proc = process_bytes if process_bytes is not None else counters.reserved
    return MemorySnapshot(device=f"cuda:{index}", total_bytes=int(total),
                          available_bytes=int(avail), process_bytes=int(proc),
                          process_peak_bytes=int(counters.peak_reserved), pressure=None,
                          limit_bytes=None, limit_source="cuda", source="cuda",
                          timestamp=time.monotonic() if now is None else now)


# per device: total, "outside" bytes (total - free - reserved at the last full reading),
# context overhead (NVML footprint - reserved)
_baseline: Dict[int, Dict[str, int]] = {}


def _reset_baseline() -> None:
    _baseline.clear()


def probe(index: int = 0, cheap: bool = False, *, torch_cuda=None, nvml=None) -> MemorySnapshot:
    """CUDA snapshot of device ``index``; see the module doc for cheap vs full.

    Args:
        index: CUDA device index (as torch numbers it).
        cheap: allocator counters only (plus the cached device-wide baseline).
        torch_cuda: the ``torch.cuda`` module (default: :func:`torch_cuda_module`); tests pass
            a thin fake here because this machine has no CUDA device.
        nvml: an initialised pynvml-like module (tests); default: import pynvml if installed.

    Raises:
        RuntimeError: CUDA unavailable (``probe()`` in the package turns this into a
        ConfigError / fallback); counter errors propagate to the caller's fallback.
    """
    tc = torch_cuda if torch_cuda is not None else torch_cuda_module()
    if tc is None:
        raise RuntimeError("CUDA is not available")
    now = time.monotonic()
    c = read_counters(index, tc)
    base = _baseline.get(index)
    if cheap and base is not None:
        outside = base["outside"]
        total = base["total"]
        free = max(0, total - outside - c.reserved)
        proc = c.reserved + base["context"]
        return snapshot_from_counters(index, c, free, total, process_bytes=proc, now=now)
    free, total = (int(x) for x in tc.mem_get_info(index))
    context = base["context"] if base is not None else 0
    proc = None
    if not cheap:
        proc = nvml_process_bytes(index, tc, nvml=nvml)
        if proc is not None:
            context = max(0, proc - c.reserved)
    _baseline[index] = {"total": total, "outside": max(0, total - free - c.reserved),
                        "context": context}
    if proc is None:
        proc = c.reserved + context
    return snapshot_from_counters(index, c, free, total, process_bytes=proc, now=now)
