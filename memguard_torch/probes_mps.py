"""PyTorch on Apple Silicon (``mps``): the MPS allocator counters and Metal's working-set limit.
Registered with the core by :mod:`memguard_torch.probes`.

:func:`probe` builds a snapshot from ``torch.mps`` (``current_allocated_memory``,
``driver_allocated_memory``, ``recommended_max_memory``) and the host's; :func:`step_reader` gives
the monitor its per-step reads. NOT validated on a Mac: the tests run this against a thin fake of
``torch.mps`` (tests/test_probes_mps.py). What each figure means and how the snapshot is built:
docs/monitor.md, "PyTorch on Apple Silicon".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from memguard_core.probes import MemorySnapshot, StepReader
from memguard_core.probes import host as _host
from memguard_core.probes.common import warn_once
from memguard_core.probes.snapshot import host_pressure_fields

__all__ = ["MpsCounters", "torch_mps_module", "mps_in_use", "read_counters", "probe", "step_reader",
           "live_bytes"]


@dataclass(frozen=True)
class MpsCounters:
    """MPS allocator counters, bytes. ``recommended_max`` is None where torch lacks the call."""

    allocated: int
    driver_allocated: int
    recommended_max: Optional[int]


def _available() -> bool:
    backends = getattr(torch, "backends", None)
    mps = getattr(backends, "mps", None) if backends is not None else None
    return bool(mps is not None and mps.is_available() and hasattr(torch, "mps"))


def mps_in_use() -> bool:
    """True if torch's MPS backend is available; a broken torch is logged once and read as False."""
    try:
        return _available()
    except Exception as exc:
        warn_once("torch.backends.mps.is_available", "memguard: torch MPS check failed: %r", exc)
        return False


def torch_mps_module():
    """``torch.mps``, or None where its MPS backend is absent (a failing check is logged once)."""
    try:
        return torch.mps if _available() else None
    except Exception as exc:
        warn_once("torch.mps.available", "memguard: torch mps availability check failed: %r", exc)
        return None


def read_counters(mps) -> MpsCounters:
    """The counters of ``mps`` (the ``torch.mps`` module); host-side calls, no synchronisation.

    Raises:
        what torch raises (the package's probe falls back to psutil and logs it).
    """
    rec = getattr(mps, "recommended_max_memory", None)
    recommended = None
    if rec is not None:
        recommended = int(rec()) or None
    return MpsCounters(allocated=int(mps.current_allocated_memory()),
                       driver_allocated=int(mps.driver_allocated_memory()),
                       recommended_max=recommended)


def probe(cheap: bool = False, *, mps=None, host: Optional[MemorySnapshot] = None) -> MemorySnapshot:
    """MPS snapshot (see module doc).

    Args:
        cheap: passed to the host probe (the MPS counters are always cheap).
        mps: the ``torch.mps`` module (default :func:`torch_mps_module`); tests pass a thin fake.
        host: a host snapshot to use instead of probing the host (tests).

    Raises:
        RuntimeError: no torch with MPS (the package's ``probe()`` turns it into ConfigError).
    """
    mps = mps if mps is not None else torch_mps_module()
    if mps is None:
        raise RuntimeError("torch with the MPS backend is not available")
    now = time.monotonic()
    c = read_counters(mps)
    if host is None:
        host = _host.host_probe(cheap)
    cached = max(0, c.driver_allocated - c.allocated)
    if c.recommended_max:
        total, limit, limit_source = c.recommended_max, c.recommended_max, "mps"
    else:
        total, limit, limit_source = host.total_bytes, host.limit_bytes, host.limit_source
    avail = max(0, min(total - c.allocated, host.available_bytes + cached))
    return MemorySnapshot(device="mps", total_bytes=int(total), available_bytes=int(avail),
                          process_bytes=c.driver_allocated, process_peak_bytes=None,
                          pressure=host.pressure, limit_bytes=limit, limit_source=limit_source,
                          source="mps", timestamp=now, **host_pressure_fields(host))


def live_bytes() -> Optional[int]:
    """``torch.mps.current_allocated_memory()`` where the MPS backend is available, else None."""
    if not mps_in_use():
        return None
    return int(torch.mps.current_allocated_memory())


def step_reader() -> StepReader:
    """The runtime monitor's reader on ``mps``: the probe through ``probes.probe("mps")`` (psutil if
    it fails) and the live tensors' bytes (:func:`live_bytes`). No peak counter to reset, no
    snapshot-free path, no pressure read alone (the host's comes with the snapshot)."""
    return StepReader("mps", live_bytes=live_bytes)
