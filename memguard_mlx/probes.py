"""MLX memory probe: the MLX allocator counters and Metal device limits, registered with the core
(:mod:`memguard_core.probes.registry`) when ``memguard_mlx`` is imported, or when the core loads the
entry point ``device.mlx`` for ``device="mlx"`` named explicitly. See docs/monitor.md, "Probes".

Sources (MLX docs, "Memory management" / python/src/memory.cpp and metal.cpp):
- ``mx.get_active_memory()``: bytes held by live arrays; ``mx.get_peak_memory()``: peak of
  active since ``mx.reset_peak_memory()``; ``mx.get_cache_memory()``: bytes the allocator keeps
  for reuse (not active). Older releases (< 0.22) only have them under ``mx.metal.*``.
- ``mx.device_info()`` (``mx.metal.device_info()`` before) on Metal: ``memory_size`` (physical
  RAM) and ``max_recommended_working_set_size`` (Metal's ``recommendedMaxWorkingSetSize``,
  beyond which the GPU working set pages and unified-memory Macs start to swap / freeze).
- ``mx.get_memory_limit()``: the allocator's limit (``mx.set_memory_limit``), when it exists.

Snapshot meaning on ``"mlx"``:
- Metal: ``total = min(max_recommended_working_set_size, memory limit)`` (``limit_bytes`` the
  same, ``limit_source="mlx"``); ``available = min(total - active, host available + cache)``
  (cached blocks are reusable by MLX but already resident, so the host does not count them
  free); ``pressure`` from the host (macOS memorystatus), with the host's ``pressure_kind``.
- CPU (``mlx[cpu]``, e.g. Linux): total / available / limit / pressure from the host probe
  (container-aware on Linux); the process figures come from the MLX counters.
- ``process_bytes = active``, ``process_peak_bytes = peak``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import mlx.core as mx_core

from memguard_core.probes import MemorySnapshot, StepReader
from memguard_core.probes import host as _host
from memguard_core.probes.common import warn_once
from memguard_core.probes.registry import DeviceProbe, register_device_probe
from memguard_core.probes.snapshot import host_pressure_fields

__all__ = ["MlxCounters", "mlx_module", "metal_available", "in_use", "read_counters", "reset_peak",
           "device_info", "memory_limit", "probe", "step_reader", "register"]


@dataclass(frozen=True)
class MlxCounters:
    """MLX allocator counters, bytes."""

    active: int
    peak: int
    cache: int


def mlx_module():
    """``mlx.core`` (tests replace this function to hand in a fake)."""
    return mx_core


def _fn(mx, name: str):
    f = getattr(mx, name, None)
    if f is None:
        metal = getattr(mx, "metal", None)
        f = getattr(metal, name, None) if metal is not None else None
    return f


def metal_available(mx) -> bool:
    """True if MLX runs on Metal (Apple GPU)."""
    metal = getattr(mx, "metal", None)
    try:
        return bool(metal is not None and metal.is_available())
    except Exception:
        return False


def in_use() -> Optional[str]:
    """``"mlx"``, what ``device="auto"`` resolves to, where MLX runs on Metal; None elsewhere (a
    failing check is logged once and read as None)."""
    try:
        return "mlx" if metal_available(mlx_module()) else None
    except Exception as exc:
        warn_once("mlx.metal.is_available", "memguard: mlx Metal check failed: %r", exc)
        return None


def read_counters(mx) -> MlxCounters:
    """Active, peak and cache memory (bytes); cheap host-side counters."""
    return MlxCounters(active=int(_fn(mx, "get_active_memory")()),
                       peak=int(_fn(mx, "get_peak_memory")()),
                       cache=int(_fn(mx, "get_cache_memory")()))


def reset_peak(mx=None) -> None:
    """Start a new peak window of ``mx.get_peak_memory`` (``mx.reset_peak_memory``, under
    ``mx.metal`` before 0.22).

    Raises:
        RuntimeError: mlx is not installed, or has no peak reset; else whatever mlx raises.
    """
    mx = mx if mx is not None else mlx_module()
    f = None if mx is None else _fn(mx, "reset_peak_memory")
    if f is None:
        raise RuntimeError("mlx with reset_peak_memory is not available")
    f()


def step_reader() -> StepReader:
    """The runtime monitor's reader on MLX: the probe through ``probes.probe("mlx")`` (allocator
    counters, the host's figures for what is available), the allocator's peak reset
    (:func:`reset_peak`) and active memory as the live bytes. No snapshot-free path and no
    pressure read alone (the host's comes with the snapshot)."""

    def live() -> Optional[int]:
        return read_counters(mlx_module()).active

    return StepReader("mlx", reset_peak=reset_peak, live_bytes=live)


_device_info_cache: Dict[int, tuple] = {}   # id(mx) -> (mx, info): the reference keeps the id unique


def device_info(mx) -> Dict[str, object]:
    """``mx.device_info()`` (or ``mx.metal.device_info()``); {} if unavailable. The device's sizes
    do not change while the process runs: read once per ``mx`` module (the per-step probe needs
    the recommended working set every step)."""
    hit = _device_info_cache.get(id(mx))
    if hit is not None and hit[0] is mx:
        return hit[1]
    f = _fn(mx, "device_info")
    if f is None:
        return {}
    try:
        info = dict(f())
    except Exception as exc:
        warn_once("mlx.device_info", "memguard: mx.device_info() failed: %r", exc)
        return {}
    _device_info_cache[id(mx)] = (mx, info)
    return info


def memory_limit(mx) -> Optional[int]:
    """``mx.get_memory_limit()`` in bytes, None where the API is missing or reports 0."""
    f = getattr(mx, "get_memory_limit", None)
    if f is None:
        return None
    try:
        v = int(f())
        return v if v > 0 else None
    except Exception:
        return None


def probe(cheap: bool = False, *, mx=None, host: Optional[MemorySnapshot] = None) -> MemorySnapshot:
    """MLX snapshot (see module doc).

    Args:
        cheap: passed to the host probe (the MLX counters are always cheap).
        mx: the ``mlx.core`` module (default :func:`mlx_module`).
        host: a host snapshot to use instead of probing the host (tests).

    Raises:
        RuntimeError: mlx not installed (the package's ``probe()`` turns it into ConfigError).
    """
    mx = mx if mx is not None else mlx_module()
    if mx is None:
        raise RuntimeError("mlx is not installed")
    now = time.monotonic()
    c = read_counters(mx)
    if host is None:
        host = _host.host_probe(cheap)
    if metal_available(mx):
        info = device_info(mx)
        wset = info.get("max_recommended_working_set_size") or info.get("memory_size")
        try:
            wset = int(wset) if wset else None
        except (TypeError, ValueError):
            wset = None
        lim = memory_limit(mx)
        cands = [v for v in (wset, lim) if v]
        if cands:
            total = min(cands)
            avail = max(0, min(total - c.active, host.available_bytes + c.cache))
            return MemorySnapshot(device="mlx", total_bytes=total, available_bytes=avail,
                                  process_bytes=c.active, process_peak_bytes=c.peak,
                                  pressure=host.pressure, limit_bytes=total, limit_source="mlx",
                                  source="mlx", timestamp=now, **host_pressure_fields(host))
    avail = max(0, min(host.total_bytes, host.available_bytes))
    return MemorySnapshot(device="mlx", total_bytes=host.total_bytes, available_bytes=avail,
                          process_bytes=c.active, process_peak_bytes=c.peak,
                          pressure=host.pressure, limit_bytes=host.limit_bytes,
                          limit_source=host.limit_source, source="mlx", timestamp=now,
                          **host_pressure_fields(host))


def _probe(device: str, cheap: bool) -> Optional[MemorySnapshot]:
    return probe(cheap=cheap, mx=mlx_module())


def _counters(device: str) -> Tuple[int, int, Optional[int]]:
    c = read_counters(mlx_module())
    return c.active, c.active + c.cache, c.peak


def register() -> None:
    """Register the ``mlx`` probe with the core (idempotent): ``device="auto"`` picks it after CUDA
    and before torch's MPS."""
    register_device_probe(DeviceProbe(
        kind="mlx", priority=20, label="MLX", detect=lambda: in_use(), probe=_probe,
        step_reader=lambda device: step_reader(), counters=_counters, reset_peak=lambda device: reset_peak()))
