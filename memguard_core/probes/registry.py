"""The device probes framework packages lend the core: ``memguard_torch`` registers ``cuda`` and
``mps`` (torch's allocators), ``memguard_mlx`` registers ``mlx``, each when imported; the core asks
here and never reads a framework itself. See docs/monitor.md, "Probes".

A device named explicitly (``probe("cuda")``) whose package is not imported yet loads it through
its entry point ``device.<kind>`` of the group ``memguard.features`` (what importing torch did
before); ``device="auto"`` asks only the probes already registered, so it imports nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .common import log, warn_once
from .reader import StepReader
from .snapshot import MemorySnapshot

__all__ = ["DeviceProbe", "register_device_probe", "device_probe", "registered", "detect", "NEEDS"]

#: What a device kind needs, for the error raised when it is named but absent, and the extra that
#: installs it: ``kind -> (expected, extra)``.
NEEDS: Dict[str, Tuple[str, str]] = {
    "cuda": ("a CUDA device (torch with CUDA available)", "torch"),
    "mps": ("torch with the MPS backend available (Apple Silicon)", "torch"),
    "mlx": ("mlx installed (pip install mlx)", "mlx"),
}


@dataclass(frozen=True)
class DeviceProbe:
    """One device backend of a framework package: the functions the core calls on that device.
    ``device`` arguments are resolved device strings (``"cuda:<index>"``, ``"mlx"``, ``"mps"``).

    Attributes:
        kind: ``"cuda"``, ``"mlx"`` or ``"mps"`` (the device string up to ``:``).
        priority: ``device="auto"`` asks the registered probes in this order, lowest first.
        label: the device's name in log messages (``"CUDA"``).
        detect: ``() -> device | None``: the device ``"auto"`` resolves to when this framework can
            use its device now, else None. Must not initialise a device.
        probe: ``(device, cheap) -> MemorySnapshot | None``: a reading (see
            :func:`memguard_core.probes.probe`); None where the framework or its device is absent.
            Read errors raise (the package falls back to psutil and logs them).
        step_reader: ``device -> StepReader``: the monitor's reader; its probe may be left unset
            (the package binds its own, with the fallback).
        counters: ``device -> (allocated, reserved, peak)``, bytes, the allocator's figures for
            :func:`memguard_core.stats.memory_stats`; raises what the framework raises.
        reset_peak: ``device -> None``: starts a new allocator peak window; None where the
            framework has no peak counter to reset.
        settings: ``() -> str | None``: the allocator's settings string as the framework parsed
            it (``key:value,...``; :func:`memguard_core.probes.alloc_conf.allocator_settings`),
            None where it cannot tell; None: no such reader.
    """

    kind: str
    priority: int
    label: str
    detect: Callable[[], Optional[str]]
    probe: Callable[[str, bool], Optional[MemorySnapshot]]
    step_reader: Callable[[str], StepReader]
    counters: Callable[[str], Tuple[int, int, Optional[int]]]
    reset_peak: Optional[Callable[[str], None]] = None
    settings: Optional[Callable[[], Optional[str]]] = None


_registered: Dict[str, DeviceProbe] = {}
_lock = threading.Lock()


def register_device_probe(probe: DeviceProbe) -> None:
    """Register (or replace, by ``kind``) a device backend."""
    with _lock:
        _registered[probe.kind] = probe


def registered() -> List[DeviceProbe]:
    """The registered device backends, in ``device="auto"`` order."""
    with _lock:
        return sorted(_registered.values(), key=lambda p: p.priority)


def device_probe(kind: str, *, load: bool = True) -> Optional[DeviceProbe]:
    """The backend of ``kind``; where none is registered and ``load``, the one its package
    registers when its entry point ``device.<kind>`` loads (it imports the framework). None where
    that fails: the package or its framework is not installed (logged at DEBUG)."""
    with _lock:
        found = _registered.get(kind)
    if found is not None or not load:
        return found
    from memguard_core import features

    try:
        register = features.load(f"device.{kind}", NEEDS.get(kind, ("", kind))[1])
        register()
    except Exception as exc:   # not installed, or its framework fails to import: "absent"
        log.debug("memguard: no %s device probe: %r", kind, exc)
        return None
    with _lock:
        return _registered.get(kind)


def detect() -> Optional[str]:
    """The device the first registered backend (by priority) reports in use, or None. Imports
    nothing; a failing check is logged once and read as "not in use"."""
    for p in registered():
        try:
            dev = p.detect()
        except Exception as exc:
            warn_once(f"{p.kind}.detect", "memguard: %s availability check failed: %r", p.label, exc)
            continue
        if dev:
            return dev
    return None
