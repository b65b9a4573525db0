"""CUDA memory probe: torch.cuda caching-allocator counters, ``mem_get_info``, NVML
(:mod:`memguard_core.probes.nvml`). Registered with the core by :mod:`memguard_torch.probes`.

:func:`read_counters` reads the allocator's host-side counters, :func:`snapshot_from_counters`
builds the snapshot (available = driver free + our cached blocks), :class:`CudaStepReader` is the
monitor's per-step reader (allocator counters only; the device-wide part from the last full
reading). What each source counts and what the snapshot means: docs/monitor.md, "What each probe
reads".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from memguard_core.probes import MemorySnapshot, StepReader
from memguard_core.probes.common import warn_once
from memguard_core.probes.nvml import process_bytes

__all__ = ["CudaCounters", "torch_cuda_module", "in_use", "read_counters", "reset_peak",
           "nvml_process_bytes", "snapshot_from_counters", "probe", "step_reader", "CudaStepReader",
           "allocator_settings"]


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
    """``torch.cuda`` if CUDA is available, else None. A failing availability check is logged once
    and read as unavailable."""
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception as exc:  # a broken torch install must not break probing
        warn_once("torch.cuda.is_available", "memguard: torch.cuda.is_available() failed: %r", exc)
        return None


def in_use() -> Optional[str]:
    """The device ``device="auto"`` resolves to on CUDA: ``"cuda:<current device>"`` where CUDA
    is available and initialised, ``"cuda:0"`` where available but not initialised yet, None where
    CUDA is not available. Initialises nothing."""
    cuda = torch_cuda_module()
    if cuda is None:
        return None
    idx = 0
    try:
        if cuda.is_initialized():
            idx = int(cuda.current_device())
    except Exception:
        idx = 0
    return f"cuda:{idx}"


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
    the allocator's peak reset (:func:`reset_peak`) and ``memory_allocated`` as the live bytes.
    No snapshot-free path: the counters are
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
        return int(torch.cuda.memory_allocated(self.index))

    def _close_window(self) -> None:
        tc = torch_cuda_module()
        try:
            self.window = read_counters(self.index, tc) if tc is not None else None
        except Exception as exc:
            self.window = None
            warn_once(f"cuda.window:{self.index}", "memguard: CUDA window counters not read: %r", exc)
        reset_peak(self.index, tc)


def step_reader(index: int = 0) -> CudaStepReader:
    """The runtime monitor's reader on CUDA device ``index`` (:class:`CudaStepReader`)."""
    return CudaStepReader(index)


def allocator_settings(torch_module=None) -> Optional[str]:
    """The caching allocator's settings string (``key:value,...``) torch parsed last
    (``torch._C._accelerator_getAllocatorSettings()``, torch >= 2.9: the environment variable at
    start, or a later ``torch._C._accelerator_setAllocatorSettings``); None where this torch has no
    such call (then :func:`memguard_core.probes.alloc_conf.allocator_settings` reads the
    environment). ``torch_module``: the ``torch`` module (tests; default the imported one)."""
    t = torch if torch_module is None else torch_module
    getter = getattr(getattr(t, "_C", None), "_accelerator_getAllocatorSettings", None)
    return None if getter is None else str(getter() or "")


def nvml_process_bytes(index: int, torch_cuda, *, pid: Optional[int] = None,
                       nvml=None) -> Optional[int]:
    """This process's memory on torch's device ``index`` per NVML (``usedGpuMemory``), bytes: the
    device found by its UUID first (so ``CUDA_VISIBLE_DEVICES`` holds), else by index
    (:func:`memguard_core.probes.nvml.process_bytes`).

    Returns None if NVML is not installed, the process is not listed (e.g. a container's PID
    namespace hides it) or the driver does not report per-process usage.
    """
    try:
        uuid = getattr(torch_cuda.get_device_properties(index), "uuid", None)
    except Exception:
        uuid = None
    return process_bytes(index, uuid=None if uuid is None else str(uuid), pid=pid, nvml=nvml)


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
