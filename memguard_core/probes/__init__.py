"""Memory probes: one function, :func:`probe`, over one backend per platform or device.

The layout follows psutil (``_pslinux`` / ``_psosx`` / ``_pswindows`` behind ``psutil``):

- :mod:`memguard_core.probes.linux`   /proc/meminfo, /proc/self/status, PSI, cgroup v1 and v2,
  ``RLIMIT_AS`` / ``RLIMIT_DATA``, glibc's heap (one module per job under it)
- :mod:`memguard_core.probes.darwin`  psutil, and ``sysctlbyname`` for ``kern.memorystatus_level``,
  ``kern.memorystatus_vm_pressure_level`` and ``vm.swapusage``
- :mod:`memguard_core.probes.windows` psutil, and ``GlobalMemoryStatusEx`` for the commit limit
- :mod:`memguard_core.probes.host`    picks the host's backend; heap trim and mmap threshold
- :mod:`memguard_core.probes.nvml`    NVML's per-process GPU memory (nvidia-ml-py)
- :mod:`memguard_core.probes.registry` the device probes framework packages register:
  ``cuda`` and ``mps`` (``memguard_torch.probes``), ``mlx`` (``memguard_mlx.probes``)

Every backend returns a :class:`MemorySnapshot` and offers the runtime monitor a
:class:`StepReader` (:func:`step_reader`), so the monitor never names a platform. Nothing here
reads a framework: ``device="auto"`` asks the registered device probes, so probing never imports
a framework the user has not imported. See docs/monitor.md, "Probes".

Failure policy: a probe never raises into the caller's training loop. A file or counter that
cannot be read (missing permissions, garbage, negative numbers) is logged once per source at
WARNING and treated as absent. Only a malformed ``device`` argument (or naming a backend that
is not present) raises :class:`memguard_core.errors.ConfigError`.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from memguard_core.errors import ConfigError

from . import host, registry
from .common import psutil_fallback, warn_once
from .host import MOE_MMAP_THRESHOLD_BYTES, glibc_version, pin_mmap_threshold, trim_heap
from .reader import StepReader
from .snapshot import MemorySnapshot, display_rows, total_limit

__all__ = ["MemorySnapshot", "StepReader", "probe", "step_reader", "live_bytes", "trim_heap",
           "pin_mmap_threshold", "glibc_version", "MOE_MMAP_THRESHOLD_BYTES", "resolve_device", "total_limit",
           "display_rows", "allocator_counters", "reset_allocator_peak", "DEVICE_RE",
           "DEVICE_CHOICES"]

#: The device strings :func:`resolve_device` accepts, and their wording in errors.
DEVICE_RE = re.compile(r"^(auto|cpu|mlx|mps|cuda(?::(\d+))?)$")
DEVICE_CHOICES = '"auto", "cpu", "cuda", "cuda:<index>", "mlx" or "mps"'


def resolve_device(device: str = "auto") -> str:
    """Turn a device request into a concrete device string.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:<index>"``, ``"mlx"`` or ``"mps"``.

    Returns:
        ``"cpu"``, ``"cuda:<index>"``, ``"mlx"`` or ``"mps"``. ``"auto"`` asks the registered
        device probes in their order (:mod:`memguard_core.probes.registry`): CUDA where torch's
        CUDA is available (the current device if CUDA is initialised, else 0), else ``"mlx"``
        where MLX runs on Metal, else ``"mps"`` where torch's MPS backend is available (PyTorch on
        Apple Silicon, what HF's ``Trainer`` picks on a Mac; after MLX because mlx_lm runs import
        torch through transformers), else ``"cpu"``. The adapters register their probes when
        imported (``memguard_torch``: cuda and mps; ``memguard_mlx``: mlx). Nothing is imported
        to decide.

    Raises:
        ConfigError: malformed device string.
    """
    if not isinstance(device, str) or DEVICE_RE.match(device) is None:
        raise ConfigError("device", DEVICE_CHOICES, device)
    if device == "auto":
        return registry.detect() or "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def _kind(dev: str) -> str:
    return dev.split(":", 1)[0]


def _present(dev: str, requested: str) -> registry.DeviceProbe:
    """The registered probe of resolved device ``dev``; ConfigError where none can be loaded."""
    p = registry.device_probe(_kind(dev))
    if p is None:
        raise ConfigError("device", registry.NEEDS[_kind(dev)][0], requested)
    return p


def probe(device: str = "auto", *, cheap: bool = False) -> MemorySnapshot:
    """Read the memory of ``device`` now.

    Args:
        device: see :func:`resolve_device`. ``"cpu"`` means the host (Linux/macOS/Windows by
            ``sys.platform``); naming ``"cuda..."``, ``"mps"`` or ``"mlx"`` explicitly loads the
            package that probes it (``memguard_torch`` / ``memguard_mlx``, importing torch / mlx)
            if needed.
        cheap: the per-training-step path: reads only cheap counters (allocator counters,
            cgroup files, /proc/self/status, /proc/meminfo, the kernel's precomputed PSI
            averages), runs no subprocess and no NVML, allocates little and never synchronises
            a device. ``cheap=False`` adds NVML (cuda), ``vm_stat``/``sysctl`` (macOS) and
            re-resolves the process's cgroup.

    Returns:
        A :class:`MemorySnapshot`.

    Raises:
        ConfigError: malformed ``device``, or ``cuda``/``mlx``/``mps`` named but not present. Errors
        while reading are logged (``memguard.probes``) and degrade to a fallback snapshot,
        never raised.
    """
    dev = resolve_device(device)
    if dev != "cpu":
        p = _present(dev, device)
        try:
            snap = p.probe(dev, cheap)
        except Exception as exc:
            warn_once(f"{dev}.probe", "memguard: %s probe failed: %r", p.label, exc)
            return psutil_fallback(dev)
        if snap is None:
            raise ConfigError("device", registry.NEEDS[p.kind][0], device)
        return snap
    try:
        return host.host_probe(cheap)
    except Exception as exc:
        warn_once(f"host.probe:{host.host_source()}", "memguard: %s probe failed: %r",
                  host.host_source(), exc)
        return psutil_fallback("cpu")


def step_reader(device: str = "auto") -> StepReader:
    """The :class:`StepReader` of ``device`` (see :func:`resolve_device`): a device's from its
    registered probe, ``cpu`` from the host's backend (Linux, macOS, Windows; elsewhere the psutil
    probe alone). Where the backend reads no snapshot itself, the reader reads :func:`probe` of
    the device (with its fallback).

    Raises:
        ConfigError: malformed ``device``, or a device named whose probe cannot be loaded.
    """
    dev = resolve_device(device)
    reader = _present(dev, device).step_reader(dev) if dev != "cpu" else host.host_step_reader()
    return reader.with_probe(lambda cheap: probe(dev, cheap=cheap))


def allocator_counters(device: str) -> Optional[Tuple[int, int, Optional[int]]]:
    """``(allocated, reserved, peak)`` bytes of the allocator of a resolved ``device``
    (``cuda:<i>``: live tensors, the caching allocator's reserve, the peak of allocated;
    ``mlx``: active, active + cache, peak; ``mps``: allocated, driver-allocated, driver-allocated),
    None for ``cpu``.

    Raises:
        ConfigError: the device's probe cannot be loaded; else what the framework raises.
    """
    if device == "cpu":
        return None
    return _present(device, device).counters(device)


def reset_allocator_peak(device: str) -> bool:
    """Start a new peak window of the allocator of a resolved non-cpu ``device``. Returns False
    where it has no peak counter to reset (``mps``).

    Raises:
        ConfigError: the device's probe cannot be loaded; else what the framework raises.
    """
    p = _present(device, device)
    if p.reset_peak is None:
        return False
    p.reset_peak(device)
    return True


def live_bytes(device: str) -> Optional[int]:
    """Bytes held by live allocations on a resolved ``device``, not counting what an allocator
    keeps free for reuse: what a cleanup can lower only by freeing objects, not by returning
    cached memory.

    ======================  =================================================================
    ``cuda:<i>``            ``torch.cuda.memory_allocated(i)`` (live tensors)
    ``mlx``                 ``mx.get_active_memory()`` (live arrays)
    ``mps``                 ``torch.mps.current_allocated_memory()`` (live tensors)
    ``cpu`` on Linux        glibc ``mallinfo2()`` in-use bytes (:func:`linux.heap.malloc_in_use`)
    ``cpu`` elsewhere       None (no such counter is read)
    ======================  =================================================================

    Used by the monitor to judge a clean: returning cached or trimmed memory lowers RSS and the
    reserved figures but not the next micro-batch's peak, which allocates it all again.

    Returns:
        Bytes, or None where the device has no such counter or it cannot be read. Never raises.
    """
    try:
        return step_reader(device).live_bytes()
    except Exception as exc:
        warn_once(f"live_bytes:{device}", "memguard: reading live bytes of %s failed: %r", device, exc)
    return None
