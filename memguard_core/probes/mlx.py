"""MLX memory probe: the MLX allocator counters and Metal device limits.

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

mlx may not be installed; it is imported only inside functions.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional

from memguard_core.probes import MemorySnapshot, StepReader, _warn_once

__all__ = ["MlxCounters", "mlx_module", "metal_available", "read_counters", "reset_peak",
           "device_info", "memory_limit", "probe", "step_reader"]


@dataclass(frozen=True)
class MlxCounters:
    """MLX allocator counters, bytes."""

    active: int
    peak: int
    cache: int


def mlx_module():
    """``mlx.core`` (imported if needed), or None if mlx is not installed."""
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        return mx
    try:
        import mlx.core as mx  # noqa: F811

        return mx
    except Exception:
        return None


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
    (:func:`reset_peak`) and active memory as the live bytes (read only where mlx is already
    imported). No snapshot-free path and no pressure read alone (the host's comes with the
    snapshot)."""

    def live() -> Optional[int]:
        mx = sys.modules.get("mlx.core")
        return None if mx is None else read_counters(mx).active

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
        _warn_once("mlx.device_info", "memguard: mx.device_info() failed: %r", exc)
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
        from memguard_core.probes import _host_probe

        host = _host_probe(cheap)
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
                                  source="mlx", timestamp=now, **_host_pressure(host))
    avail = max(0, min(host.total_bytes, host.available_bytes))
    return MemorySnapshot(device="mlx", total_bytes=host.total_bytes, available_bytes=avail,
                          process_bytes=c.active, process_peak_bytes=c.peak,
                          pressure=host.pressure, limit_bytes=host.limit_bytes,
                          limit_source=host.limit_source, source="mlx", timestamp=now,
                          **_host_pressure(host))


def _host_pressure(host: MemorySnapshot) -> Dict[str, object]:
    """The host's pressure fields, named by their model (the host's own probe decided it: PSI on
    Linux, memorystatus on macOS)."""
    kind = getattr(host, "pressure_kind", None)
    if kind is None and host.pressure is not None:
        kind = {"darwin": "memorystatus", "linux": "psi"}.get(host.source)
    return {"pressure_kind": kind,
            "kernel_pressure": getattr(host, "kernel_pressure", None),
            "swap_used_bytes": getattr(host, "swap_used_bytes", None)}
