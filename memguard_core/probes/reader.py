"""The runtime monitor's view of one device: :class:`StepReader`, the functions a backend has for
the per-step check and the background thread, so the monitor names no platform. See
docs/monitor.md, "Probes".
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .common import warn_once
from .snapshot import MemorySnapshot

__all__ = ["StepReader"]


class StepReader:
    """What the runtime monitor reads on one resolved device, bound once: the backend's functions
    for the per-step check and the background thread, so the monitor names no platform.

    Each backend builds one (``linux.step_reader()``, ``darwin.step_reader()``,
    ``windows.step_reader()``, and the device backends the framework packages register), passing
    only the functions it has; :func:`memguard_core.probes.step_reader` picks the backend and
    binds the package's probe where the backend gave none (:meth:`with_probe`).

    Args:
        device: the resolved device (``"cpu"``, ``"cuda:<index>"``, ``"mlx"``).
        probe: ``probe(cheap) -> MemorySnapshot``; None: bound later by :meth:`with_probe`
            (the package's probe of ``device``, which falls back to psutil when the backend fails).
        reset_peak: ``reset_peak() -> bool | None``: starts a new peak window of the counter the
            snapshots report as ``process_peak_bytes``; False where the backend could not.
            None: this backend's peak cannot be reset.
        step_figures: ``step_figures() -> (monotonic s, RSS, peak, RSS + available) | None``
            (bytes), the per-step figures without building a snapshot; None from it means "take
            the cheap probe this time". None: no such path.
        pressure: ``pressure() -> float | None``: the pressure signal read alone (percent), cheaper
            than a full probe; None: the backend has none apart from its full snapshot.
        live_bytes: ``live_bytes() -> int | None``: bytes held by live allocations (see
            :func:`memguard_core.probes.live_bytes`); None: no such counter.
        pressure_kind: the model of what ``pressure`` reads (``"psi"`` on Linux), so the monitor
            feeds it to its own policy; None where there is no ``pressure``.

    Only :meth:`probe` raises (what the probe raises); the other methods log a failing backend
    function once and read it as absent.
    """

    def __init__(self, device: str, *, probe: Optional[Callable[[bool], MemorySnapshot]] = None,
                 reset_peak: Optional[Callable[[], object]] = None,
                 step_figures: Optional[Callable[[], Optional[Tuple[float, int, int, int]]]] = None,
                 pressure: Optional[Callable[[], Optional[float]]] = None,
                 live_bytes: Optional[Callable[[], Optional[int]]] = None,
                 pressure_kind: Optional[str] = None):
        self.device = device
        self.pressure_kind = pressure_kind if pressure is not None else None
        self._probe = probe
        self._reset_peak = reset_peak
        self._step_figures = step_figures
        self._pressure = pressure
        self._live_bytes = live_bytes

    @property
    def pressure_alone(self) -> bool:
        """True where :meth:`pressure` reads the pressure signal without a full snapshot."""
        return self._pressure is not None

    def with_probe(self, probe: Callable[[bool], MemorySnapshot]) -> "StepReader":
        """This reader, reading its snapshots through ``probe(cheap)`` where its backend gave no
        probe of its own; returns the reader."""
        if self._probe is None:
            self._probe = probe
        return self

    def probe(self, cheap: bool) -> MemorySnapshot:
        """A snapshot of the device (``cheap``: the per-step path, see
        :func:`memguard_core.probes.probe`).

        Raises:
            ConfigError: the device's backend is not present (the package's probe).
            RuntimeError: no probe was given nor bound (:meth:`with_probe`).
        """
        if self._probe is None:
            raise RuntimeError(f"memguard: the step reader of {self.device} has no probe bound")
        return self._probe(cheap)

    def reset_peak(self) -> bool:
        """Start a new peak window. Returns True when the backend reset its peak counter; False
        where it has none that can be reset, or the reset failed (logged once). After a failed
        reset the per-step figures are off: a peak that is not reset is no step peak."""
        fn = self._reset_peak
        if fn is None:
            return False
        try:
            ok = fn() is not False
        except Exception as exc:
            warn_once(f"reset_peak:{self.device}", "memguard: resetting the %s peak failed: %r",
                       self.device, exc)
            ok = False
        if not ok:
            self._step_figures = None
        return ok

    def _read(self, fn: Optional[Callable[[], Any]], key: str, what: str) -> Any:
        """``fn()``, None without one; a failure is logged once per device and read as None."""
        if fn is None:
            return None
        try:
            return fn()
        except Exception as exc:
            warn_once(f"{key}:{self.device}", f"memguard: {what} of %s failed: %r", self.device, exc)
            return None

    def step_figures(self) -> Optional[Tuple[float, int, int, int]]:
        """``(monotonic s, RSS, peak since the last reset, RSS + available)``, bytes, where the
        backend has this snapshot-free path and its common case holds; else None (take
        :meth:`probe` ``(True)``)."""
        return self._read(self._step_figures, "step_figures", "per-step figures")

    def pressure(self) -> Optional[float]:
        """The pressure signal alone (percent, see ``MemorySnapshot.pressure``); None where the
        backend has none or it cannot be read."""
        return self._read(self._pressure, "pressure", "reading pressure")

    def live_bytes(self) -> Optional[int]:
        """Bytes held by live allocations (see :func:`memguard_core.probes.live_bytes`), None where unknown."""
        fn = self._live_bytes
        return self._read(None if fn is None else (lambda: None if (v := fn()) is None else int(v)),
                          "live_bytes", "reading live bytes")
