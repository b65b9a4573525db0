"""Memory probes: one module per backend behind one function, :func:`probe`.

The layout follows psutil (``_pslinux`` / ``_psosx`` / ``_pswindows`` behind ``psutil``):

- :mod:`memguard_core.probes.linux`   /proc/meminfo, /proc/self/status, PSI, cgroup v1 and v2,
  ``RLIMIT_AS`` / ``RLIMIT_DATA``
- :mod:`memguard_core.probes.darwin`  psutil, and ``sysctlbyname`` for ``kern.memorystatus_level``,
  ``kern.memorystatus_vm_pressure_level`` and ``vm.swapusage``
- :mod:`memguard_core.probes.windows` psutil, and ``GlobalMemoryStatusEx`` for the commit limit
- :mod:`memguard_core.probes.cuda`    torch.cuda allocator counters, ``mem_get_info``, NVML
- :mod:`memguard_core.probes.mlx`     ``mx.get_active_memory`` / peak / cache, ``mx.device_info``
- :mod:`memguard_core.probes.mps`     ``torch.mps`` allocated / driver-allocated / recommended max
  (PyTorch on Apple Silicon; not validated on a Mac)

Every backend returns a :class:`MemorySnapshot`, and offers the runtime monitor a
:class:`StepReader` (:func:`step_reader`): the per-step figures, the peak reset, the pressure
signal and the live-bytes counter that backend has, so the monitor never names a platform.
None of these modules imports torch or mlx at
import time; :func:`probe` with ``device="auto"`` only *looks* at ``sys.modules`` to decide, so
probing never imports a framework the user has not imported.

Failure policy: a probe never raises into the caller's training loop. A file or counter that
cannot be read (missing permissions, garbage, negative numbers) is logged once per source at
WARNING and treated as absent. Only a malformed ``device`` argument (or naming a backend that
is not present) raises :class:`memguard_core.errors.ConfigError`.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from memguard_core.errors import ConfigError

log = logging.getLogger("memguard.probes")

__all__ = ["MemorySnapshot", "StepReader", "probe", "step_reader", "live_bytes", "trim_heap",
           "pin_mmap_threshold", "MOE_MMAP_THRESHOLD_BYTES",
           "resolve_device", "host_source", "total_limit", "display_rows"]


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of the memory a training process can use on one device.

    All sizes are bytes.

    Attributes:
        device: ``"cpu"``, ``"cuda:<index>"``, ``"mlx"`` or ``"mps"``.
        total_bytes: the most this process may use: ``min(host or device total, container
            limit)``. On CUDA the device's total memory; on MLX/Metal the recommended working
            set (``max_recommended_working_set_size``).
        available_bytes: what it can still take, container-aware: on Linux
            ``min(MemAvailable, limit - working_set)`` over the cgroup and its ancestors; on
            CUDA the driver's free memory (sees other processes) plus the blocks this
            process's caching allocator holds but does not use (it can reuse them); never
            negative.
        process_bytes: used by this process: RSS on cpu, allocator-reserved (+ CUDA context
            where NVML tells it) on cuda, active memory on mlx.
        process_peak_bytes: VmHWM (Linux) / ``ru_maxrss`` (macOS) / peak working set
            (Windows) on cpu, ``max_memory_reserved`` on cuda, ``mx.get_peak_memory`` on mlx;
            ``None`` if unknown.
        pressure: percent 0..100. Linux: PSI ``some avg10`` of memory (share of the last 10 s
            in which at least one task stalled on memory; kernel Documentation/accounting/psi.rst).
            macOS: ``100 - kern.memorystatus_level`` (share of memory the kernel does not
            count as available; NOT a stall time: ``pressure_kind`` says which). ``None``
            elsewhere.
        limit_bytes: the container (cgroup) limit in force (smaller than the host total),
            ``None`` if none.
        limit_source: ``"host"``, ``"cgroup-v1:<dir>"``, ``"cgroup-v2:<dir>"`` (the cgroup
            directory whose limit won), ``"cuda"``, ``"mlx"`` / ``"mps"`` (Metal working set).
        source: the probe that produced it: ``"linux"``, ``"darwin"``, ``"windows"``,
            ``"cuda"``, ``"mlx"``, ``"mps"``, or ``"psutil"`` / ``"none"`` for the fallbacks used when
            the platform probe failed.
        timestamp: ``time.monotonic()`` at the reading.
        pressure_kind: what ``pressure`` measures, so that each pressure policy reads only its own
            platform's figure: ``"psi"`` (Linux stall share), ``"memorystatus"`` (macOS share in
            use), None where ``pressure`` is None or its kind is unknown.
        kernel_pressure: the kernel's own pressure level where it publishes one: macOS
            ``kern.memorystatus_vm_pressure_level`` as ``"normal"`` / ``"warn"`` / ``"critical"``
            (the ``DISPATCH_MEMORYPRESSURE_*`` levels); None elsewhere or when unreadable.
        swap_used_bytes: swap in use on the host (macOS ``vm.swapusage`` ``xsu_used``), bytes; the
            monitor turns successive readings into swap activity. None where not read.
        address_limit_bytes: a limit on this process's *virtual* memory in force, bytes: the soft
            ``RLIMIT_AS`` or ``RLIMIT_DATA`` (setrlimit(2); what ``ulimit -v`` / ``prlimit --as``
            set) with the least room left, or the Windows commit limit; None where none is set.
        address_limit_source: which one: ``"RLIMIT_AS"``, ``"RLIMIT_DATA"`` or ``"commit-limit"``;
            None with no such limit.
        address_headroom_bytes: the room left under that limit for new mappings, bytes: the limit
            minus what it counts now (``RLIMIT_AS``: ``VmSize``; ``RLIMIT_DATA``: ``VmData +
            VmStk``, /proc/self/status; the commit limit: ``ullAvailPageFile``), never negative.
            It is virtual address space, not RSS: ``available_bytes`` is capped by it (every new
            resident byte of a fresh allocation needs as much new mapping, so the cap is the
            conservative translation to the resident figures the monitor compares) and
            ``total_bytes`` by the limit itself (RSS <= VmSize <= RLIMIT_AS).
    """

    device: str
    total_bytes: int
    available_bytes: int
    process_bytes: int
    process_peak_bytes: Optional[int]
    pressure: Optional[float]
    limit_bytes: Optional[int]
    limit_source: str
    source: str
    timestamp: float
    pressure_kind: Optional[str] = None
    kernel_pressure: Optional[str] = None
    swap_used_bytes: Optional[int] = None
    address_limit_bytes: Optional[int] = None
    address_limit_source: Optional[str] = None
    address_headroom_bytes: Optional[int] = None

    @property
    def used_fraction(self) -> float:
        """``1 - available/total`` in 0..1; 0.0 when the total is unknown (``total_bytes <= 0``)."""
        if self.total_bytes <= 0:
            return 0.0
        frac = 1.0 - self.available_bytes / self.total_bytes
        return min(1.0, max(0.0, frac))


def total_limit(snap: MemorySnapshot) -> tuple:
    """The limit that set ``snap.total_bytes`` and its name, for display (``memguard probe``).

    Returns:
        ``(bytes, source)``: the virtual-memory limit (``address_limit_bytes``,
        ``"RLIMIT_AS"`` / ``"RLIMIT_DATA"`` / ``"commit-limit"``) when it capped the total; else
        the container limit (``limit_bytes``, ``limit_source``: ``"cgroup-v2:<dir>"`` ...);
        else ``(None, limit_source)``: the host's (or device's) own total, nothing below it.
    """
    a = snap.address_limit_bytes
    if a is not None and snap.address_limit_source and snap.total_bytes == a \
            and (snap.limit_bytes is None or a <= snap.limit_bytes):
        return a, snap.address_limit_source
    if snap.limit_bytes:
        return snap.limit_bytes, snap.limit_source
    return None, snap.limit_source


#: What ``MemorySnapshot.pressure`` measures, by ``pressure_kind``, with its unit (display).
PRESSURE_LABELS = {"psi": "pressure (PSI some avg10, % stalled)",
                   "memorystatus": "pressure (memory the kernel counts in use, %)"}


def display_rows(snap: MemorySnapshot, fmt: Callable[[Optional[float]], str]) -> List[tuple]:
    """``(what, value)`` rows of ``memguard probe``'s table: the totals with the limit that set
    the total and its source, the container and virtual-memory limits apart (``none`` when not
    set), the process figures, and the pressure with its unit (``pressure_kind``). ``fmt``
    formats bytes."""
    lim, src = total_limit(snap)
    rows = [("device", snap.device), ("total", fmt(snap.total_bytes)),
            ("total set by", f"{src} ({fmt(lim)})" if lim is not None else f"{src} (no lower limit)"),
            ("available", fmt(snap.available_bytes)),
            ("container limit", f"{fmt(snap.limit_bytes)} ({snap.limit_source})" if snap.limit_bytes else "none"),
            ("address-space limit", f"{fmt(snap.address_limit_bytes)} ({snap.address_limit_source}; "
                                    f"{fmt(snap.address_headroom_bytes)} left)"
             if snap.address_limit_bytes is not None else "none"),
            ("this process", fmt(snap.process_bytes)), ("this process, peak", fmt(snap.process_peak_bytes))]
    label = PRESSURE_LABELS.get(snap.pressure_kind or "", "pressure (%)")
    rows.append((label, "-" if snap.pressure is None else f"{snap.pressure:.2f}"))
    if snap.kernel_pressure:
        rows.append(("kernel pressure level", snap.kernel_pressure))
    rows.append(("used", f"{snap.used_fraction:.0%}"))
    return rows


# ----------------------------------------------------------------------------------------------
# helpers shared by the backends (not public API)

_warned: set = set()
_warned_lock = threading.Lock()


def _warn_once(key: str, msg: str, *args) -> None:
    """Log ``msg`` at WARNING the first time ``key`` (usually a file path) fails; DEBUG after."""
    with _warned_lock:
        first = key not in _warned
        if first:
            _warned.add(key)
    if first:
        log.warning(msg, *args)
    else:
        log.debug(msg, *args)


def _torch_backend(name: str, available: Callable[[Any], bool]) -> Any:
    """``torch.<name>`` (``cuda``, ``mps``; torch imported if it is not yet: the caller asked for
    that device) when ``available(torch)``, else None. A failing availability check is logged once
    and read as unavailable."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F811  (an explicit device request: importing torch is expected)
        except Exception:
            return None
    try:
        return getattr(torch, name) if available(torch) else None
    except Exception as exc:
        _warn_once(f"torch.{name}.available", "memguard: torch %s availability check failed: %r", name, exc)
        return None


def _reset_warned() -> None:
    """Forget which sources have warned (tests)."""
    with _warned_lock:
        _warned.clear()


def host_source() -> str:
    """The host backend for this interpreter: ``"linux"``, ``"darwin"`` or ``"windows"``."""
    if sys.platform.startswith("linux"):
        return "linux"
    if sys.platform == "darwin":
        return "darwin"
    if sys.platform in ("win32", "cygwin"):
        return "windows"
    return "psutil"


_DEVICE_RE = re.compile(r"^(auto|cpu|mlx|mps|cuda(?::(\d+))?)$")
_DEVICE_CHOICES = '"auto", "cpu", "cuda", "cuda:<index>", "mlx" or "mps"'


def _torch_cuda_in_use():
    """``torch.cuda`` if torch is already imported and CUDA is available, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        cuda = torch.cuda
        return cuda if cuda.is_available() else None
    except Exception as exc:  # a broken torch install must not break probing
        _warn_once("torch.cuda.is_available", "memguard: torch.cuda.is_available() failed: %r", exc)
        return None


def _mlx_metal_in_use() -> bool:
    """True if mlx.core is already imported and Metal is available."""
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return False
    try:
        from memguard_core.probes import mlx as _mlx

        return _mlx.metal_available(mx)
    except Exception as exc:
        _warn_once("mlx.metal.is_available", "memguard: mlx Metal check failed: %r", exc)
        return False


def resolve_device(device: str = "auto") -> str:
    """Turn a device request into a concrete device string.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ``"cuda:<index>"``, ``"mlx"`` or ``"mps"``.

    Returns:
        ``"cpu"``, ``"cuda:<index>"``, ``"mlx"`` or ``"mps"``. ``"auto"`` picks CUDA if torch is
        already imported and CUDA is available (the current device if CUDA is initialised, else
        0), else ``"mlx"`` if ``mlx.core`` is imported and Metal is available, else ``"mps"`` if
        torch is imported and its MPS backend is available (PyTorch on Apple Silicon, what HF's
        ``Trainer`` picks on a Mac; after MLX because mlx_lm runs import torch through
        transformers), else ``"cpu"``. Nothing is imported to decide.

    Raises:
        ConfigError: malformed device string.
    """
    if not isinstance(device, str) or _DEVICE_RE.match(device) is None:
        raise ConfigError("device", _DEVICE_CHOICES, device)
    if device == "auto":
        cuda = _torch_cuda_in_use()
        if cuda is not None:
            idx = 0
            try:
                if cuda.is_initialized():
                    idx = int(cuda.current_device())
            except Exception:
                idx = 0
            return f"cuda:{idx}"
        if _mlx_metal_in_use():
            return "mlx"
        from memguard_core.probes import mps as _mps
        if _mps.mps_in_use():
            return "mps"
        return "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def _host_probe(cheap: bool) -> MemorySnapshot:
    src = host_source()
    if src == "linux":
        from memguard_core.probes import linux

        return linux.probe(cheap=cheap)
    if src == "darwin":
        from memguard_core.probes import darwin

        return darwin.probe(cheap=cheap)
    if src == "windows":
        from memguard_core.probes import windows

        return windows.probe(cheap=cheap)
    return _psutil_fallback()


def _psutil_fallback(device: str = "cpu") -> MemorySnapshot:
    """Last-resort host snapshot from psutil (no container awareness); zeros if that fails too."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        mi = psutil.Process().memory_info()
        return MemorySnapshot(device=device, total_bytes=int(vm.total),
                              available_bytes=int(vm.available), process_bytes=int(mi.rss),
                              process_peak_bytes=None, pressure=None, limit_bytes=None,
                              limit_source="host", source="psutil", timestamp=time.monotonic())
    except Exception as exc:
        _warn_once("psutil.virtual_memory", "memguard: psutil fallback probe failed: %r", exc)
        return MemorySnapshot(device=device, total_bytes=0, available_bytes=0, process_bytes=0,
                              process_peak_bytes=None, pressure=None, limit_bytes=None,
                              limit_source="host", source="none", timestamp=time.monotonic())


def probe(device: str = "auto", *, cheap: bool = False) -> MemorySnapshot:
    """Read the memory of ``device`` now.

    Args:
        device: see :func:`resolve_device`. ``"cpu"`` means the host (Linux/macOS/Windows by
            ``sys.platform``); naming ``"cuda..."``, ``"mps"`` or ``"mlx"`` explicitly imports
            torch / mlx if needed.
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
    if dev.startswith("cuda"):
        from memguard_core.probes import cuda

        index = int(dev.split(":")[1])
        torch_cuda = cuda.torch_cuda_module()
        if torch_cuda is None:
            raise ConfigError("device", "a CUDA device (torch with CUDA available)", device)
        try:
            return cuda.probe(index, cheap=cheap, torch_cuda=torch_cuda)
        except Exception as exc:
            _warn_once(f"cuda.probe:{index}", "memguard: CUDA probe failed: %r", exc)
            return _psutil_fallback(dev)
    if dev == "mps":
        from memguard_core.probes import mps

        torch_mps = mps.torch_mps_module()
        if torch_mps is None:
            raise ConfigError("device", "torch with the MPS backend available (Apple Silicon)", device)
        try:
            return mps.probe(cheap=cheap, mps=torch_mps)
        except Exception as exc:
            _warn_once("mps.probe", "memguard: MPS probe failed: %r", exc)
            return _psutil_fallback("mps")
    if dev == "mlx":
        from memguard_core.probes import mlx

        mx = mlx.mlx_module()
        if mx is None:
            raise ConfigError("device", "mlx installed (pip install mlx)", device)
        try:
            return mlx.probe(cheap=cheap, mx=mx)
        except Exception as exc:
            _warn_once("mlx.probe", "memguard: MLX probe failed: %r", exc)
            return _psutil_fallback("mlx")
    try:
        return _host_probe(cheap)
    except Exception as exc:
        _warn_once(f"host.probe:{host_source()}", "memguard: %s probe failed: %r",
                   host_source(), exc)
        return _psutil_fallback("cpu")


class StepReader:
    """What the runtime monitor reads on one resolved device, bound once: the backend's functions
    for the per-step check and the background thread, so the monitor names no platform.

    Each backend builds one (``linux.step_reader()``, ``darwin.step_reader()``,
    ``windows.step_reader()``, ``cuda.step_reader(index)``, ``mlx.step_reader()``,
    ``mps.step_reader()``), passing only
    the functions it has; :func:`step_reader` picks the backend.

    Args:
        device: the resolved device (``"cpu"``, ``"cuda:<index>"``, ``"mlx"``).
        probe: ``probe(cheap) -> MemorySnapshot``; default :func:`probe` of ``device`` (which
            falls back to psutil when the backend fails).
        reset_peak: ``reset_peak() -> bool | None``: starts a new peak window of the counter the
            snapshots report as ``process_peak_bytes``; False where the backend could not.
            None: this backend's peak cannot be reset.
        step_figures: ``step_figures() -> (monotonic s, RSS, peak, RSS + available) | None``
            (bytes), the per-step figures without building a snapshot; None from it means "take
            the cheap probe this time". None: no such path.
        pressure: ``pressure() -> float | None``: the pressure signal read alone (percent), cheaper
            than a full probe; None: the backend has none apart from its full snapshot.
        live_bytes: ``live_bytes() -> int | None``: bytes held by live allocations (see
            :func:`live_bytes`); None: no such counter.
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

    def probe(self, cheap: bool) -> MemorySnapshot:
        """A snapshot of the device (``cheap``: the per-step path, see :func:`probe`).

        Raises:
            ConfigError: the device's backend is not present (default probe only).
        """
        if self._probe is not None:
            return self._probe(cheap)
        return probe(self.device, cheap=cheap)

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
            _warn_once(f"reset_peak:{self.device}", "memguard: resetting the %s peak failed: %r",
                       self.device, exc)
            ok = False
        if not ok:
            self._step_figures = None
        return ok

    def step_figures(self) -> Optional[Tuple[float, int, int, int]]:
        """``(monotonic s, RSS, peak since the last reset, RSS + available)``, bytes, where the
        backend has this snapshot-free path and its common case holds; else None (take
        :meth:`probe` ``(True)``)."""
        fn = self._step_figures
        if fn is None:
            return None
        try:
            return fn()
        except Exception as exc:
            _warn_once(f"step_figures:{self.device}", "memguard: per-step figures of %s failed: %r",
                       self.device, exc)
            return None

    def pressure(self) -> Optional[float]:
        """The pressure signal alone (percent, see ``MemorySnapshot.pressure``); None where the
        backend has none or it cannot be read."""
        fn = self._pressure
        if fn is None:
            return None
        try:
            return fn()
        except Exception as exc:
            _warn_once(f"pressure:{self.device}", "memguard: reading pressure of %s failed: %r",
                       self.device, exc)
            return None

    def live_bytes(self) -> Optional[int]:
        """Bytes held by live allocations (see :func:`live_bytes`), None where unknown."""
        fn = self._live_bytes
        if fn is None:
            return None
        try:
            v = fn()
            return None if v is None else int(v)
        except Exception as exc:
            _warn_once(f"live_bytes:{self.device}", "memguard: reading live bytes of %s failed: %r",
                       self.device, exc)
            return None


def step_reader(device: str = "auto") -> StepReader:
    """The :class:`StepReader` of ``device`` (see :func:`resolve_device`): CUDA and MLX from their
    allocator backends, ``cpu`` from the host's (Linux, macOS, Windows; elsewhere the psutil probe
    alone). Imports no framework: a CUDA or MLX reader reaches torch / mlx only when read.

    Raises:
        ConfigError: malformed ``device``.
    """
    dev = resolve_device(device)
    if dev.startswith("cuda"):
        from memguard_core.probes import cuda

        return cuda.step_reader(int(dev.split(":")[1]))
    if dev == "mlx":
        from memguard_core.probes import mlx

        return mlx.step_reader()
    if dev == "mps":
        from memguard_core.probes import mps

        return mps.step_reader()
    src = host_source()
    if src == "linux":
        from memguard_core.probes import linux

        return linux.step_reader()
    if src == "darwin":
        from memguard_core.probes import darwin

        return darwin.step_reader()
    if src == "windows":
        from memguard_core.probes import windows

        return windows.step_reader()
    return StepReader("cpu")


def trim_heap() -> None:
    """Hand the free heap the C library keeps back to the OS where the host backend can (glibc
    ``malloc_trim(0)`` on Linux; nothing elsewhere). Never raises."""
    try:
        if host_source() == "linux":
            from memguard_core.probes import linux

            linux.malloc_trim()
    except Exception as exc:  # an exotic libc must not break a clean
        _warn_once("trim_heap", "memguard: returning the free heap failed: %r", exc)


#: The mmap threshold the guard fixes for a mixture-of-experts run in bf16 / fp16 on a CPU (bytes):
#: every allocation of this size or more is mmapped and goes back to the kernel when freed. Lower
#: values keep fewer holes but pay a system call and fresh zeroed pages for more allocations; the
#: trade-off measured on full-depth MoE runs is in docs/monitor.md, "The CPU heap between steps".
MOE_MMAP_THRESHOLD_BYTES = 4 << 20


def pin_mmap_threshold(nbytes: int = MOE_MMAP_THRESHOLD_BYTES) -> bool:
    """Fix the C library's mmap threshold at ``nbytes`` for the rest of this process where the
    host backend can (glibc ``mallopt(M_MMAP_THRESHOLD, nbytes)`` on Linux, which also turns off
    glibc's dynamic adjustment of it: :func:`memguard_core.probes.linux.pin_mmap_threshold`), so
    large freed tensors go back to the kernel instead of staying in the heap. Returns True when it
    was set, False elsewhere or when glibc refused. Never raises."""
    try:
        if host_source() == "linux":
            from memguard_core.probes import linux

            return linux.pin_mmap_threshold(nbytes)
    except Exception as exc:  # an exotic libc must not break the run's start
        _warn_once("pin_mmap_threshold", "memguard: pinning the mmap threshold failed: %r", exc)
    return False


def live_bytes(device: str) -> Optional[int]:
    """Bytes held by live allocations on a resolved ``device``, not counting what an allocator
    keeps free for reuse: what a cleanup can lower only by freeing objects, not by returning
    cached memory.

    ======================  =================================================================
    ``cuda:<i>``            ``torch.cuda.memory_allocated(i)`` (live tensors)
    ``mlx``                 ``mx.get_active_memory()`` (live arrays)
    ``mps``                 ``torch.mps.current_allocated_memory()`` (live tensors)
    ``cpu`` on Linux        glibc ``mallinfo2()`` in-use bytes (:func:`linux.malloc_in_use`)
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
        _warn_once(f"live_bytes:{device}", "memguard: reading live bytes of %s failed: %r", device, exc)
    return None
