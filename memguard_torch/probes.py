"""torch's device probes for the framework-free core: ``cuda`` (:mod:`memguard_torch.probes_cuda`)
and ``mps`` (:mod:`memguard_torch.probes_mps`), registered with
:mod:`memguard_core.probes.registry` when ``memguard_torch`` is imported, or when the core loads
the entry points ``device.cuda`` / ``device.mps`` for a device named explicitly. See
docs/monitor.md, "Probes".
"""

from __future__ import annotations

from typing import Optional, Tuple

from memguard_core.probes import MemorySnapshot, StepReader
from memguard_core.probes.registry import DeviceProbe, register_device_probe

from . import probes_cuda, probes_mps

__all__ = ["register"]


def _index(device: str) -> int:
    return int(device.split(":")[1])


def _cuda_probe(device: str, cheap: bool) -> Optional[MemorySnapshot]:
    tc = probes_cuda.torch_cuda_module()
    if tc is None:
        return None
    return probes_cuda.probe(_index(device), cheap=cheap, torch_cuda=tc)


def _cuda_counters(device: str) -> Tuple[int, int, Optional[int]]:
    c = probes_cuda.read_counters(_index(device), probes_cuda.torch_cuda_module())
    return c.allocated, c.reserved, c.peak_allocated


def _mps_probe(device: str, cheap: bool) -> Optional[MemorySnapshot]:
    m = probes_mps.torch_mps_module()
    if m is None:
        return None
    return probes_mps.probe(cheap=cheap, mps=m)


def _mps_counters(device: str) -> Tuple[int, int, Optional[int]]:
    c = probes_mps.read_counters(probes_mps.torch_mps_module())
    # torch.mps has no peak counter: the driver's figure (cache included) bounds it
    return c.allocated, c.driver_allocated, c.driver_allocated


def _mps_reader(device: str) -> StepReader:
    return probes_mps.step_reader()


def register() -> None:
    """Register the ``cuda`` and ``mps`` probes with the core (idempotent). ``device="auto"``
    picks CUDA first, then MLX (``memguard_mlx``), then MPS."""
    register_device_probe(DeviceProbe(
        kind="cuda", priority=10, label="CUDA", detect=lambda: probes_cuda.in_use(), probe=_cuda_probe,
        step_reader=lambda device: probes_cuda.step_reader(_index(device)), counters=_cuda_counters,
        reset_peak=lambda device: probes_cuda.reset_peak(_index(device)),
        settings=lambda: probes_cuda.allocator_settings()))
    register_device_probe(DeviceProbe(
        kind="mps", priority=30, label="MPS", detect=lambda: "mps" if probes_mps.mps_in_use() else None,
        probe=_mps_probe, step_reader=_mps_reader, counters=_mps_counters))
