"""The runtime monitor's reads: the per-step peak, full snapshots, pressure and live bytes of one
device, and the background thread that takes samples between steps.

:class:`StepSampler` binds the device's :class:`memguard_core.probes.StepReader` once (the
backend decides what it can read cheaply), or the caller's own functions (tests, custom probes);
it decides nothing. :class:`SamplerThread` only calls a function at an interval. What is done with
the figures is :class:`memguard_core.monitor_policy.MicroBatchPolicy`'s; which sample is taken when is
:class:`memguard_core.monitor.MemoryMonitor`'s. See docs/monitor.md.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Tuple

__all__ = ["StepSampler", "SamplerThread"]


class StepSampler:
    """Reads one device for the monitor, through its step reader or the given functions.

    Args:
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:<index>`` | ``mlx`` | ``mps`` (resolved on the first
            read, so ``auto`` sees the frameworks imported by then).
        probe_fn: ``probe_fn(cheap) -> snapshot`` replacing the reader's probe; with it, the
            reader's snapshot-free per-step figures and pressure-alone reads are not used (they
            would read another source than the snapshots).
        peak_fn: ``peak_fn() -> bytes | None``: the peak since its last call, resetting it;
            replaces the snapshot's ``process_peak_bytes`` and the reader's peak reset.
        live_fn: ``live_fn() -> bytes | None`` replacing the reader's live bytes.
        reset_rss_peak: on a CPU device, restart the process's own peak (VmHWM on Linux, through
            ``/proc/self/clear_refs``) at every step sample (default). False leaves it intact: a
            step's peak is then VmHWM where the step raised it (exact), else the largest RSS a
            snapshot read since the step sample before (a lower bound; docs/monitor.md, "The
            process's own peak"). Device allocators' peaks (CUDA, MLX) are restarted either way.

    Attributes ``probe_fn``, ``peak_fn`` and ``live_fn`` may be replaced while running. Reads
    raise what the probe raises (the monitor logs and skips them), except :meth:`live`.
    """

    def __init__(self, device: str, *, probe_fn: Optional[Callable[[bool], object]] = None,
                 peak_fn: Optional[Callable[[], Optional[int]]] = None,
                 live_fn: Optional[Callable[[], Optional[int]]] = None, reset_rss_peak: bool = True):
        self.device = device
        self.probe_fn = probe_fn
        self.peak_fn = peak_fn
        self.live_fn = live_fn
        self.reset_rss_peak = bool(reset_rss_peak)
        #: with ``reset_rss_peak`` off on a CPU device: a step sample saw VmHWM rise past its value
        #: at :meth:`prime` (the largest step peak is then exact, not a lower bound)
        self.peak_rose = False
        self._hwm_seen: Optional[int] = None   # VmHWM at the last step sample (or prime), reset off
        self._rss_seen = 0                     # the largest RSS read since the last step sample, reset off
        self._reader = None

    @property
    def reader(self):
        """The device's :class:`memguard_core.probes.StepReader`, built on first use: resolving
        ``auto`` looks at the imported frameworks, which is not for every step."""
        r = self._reader
        if r is None:
            from .probes import step_reader
            r = self._reader = step_reader(self.device)
        return r

    @property
    def pressure_alone(self) -> bool:
        """True when :meth:`pressure` reads the pressure signal without a full snapshot."""
        return self.probe_fn is None and self.reader.pressure_alone

    @property
    def pressure_kind(self) -> Optional[str]:
        """The model of what :meth:`pressure` reads (``"psi"``, ...), None where unknown."""
        return getattr(self.reader, "pressure_kind", None)

    def probe(self, cheap: bool):
        """A snapshot (``cheap``: the per-step path)."""
        snap = self.probe_fn(cheap) if self.probe_fn is not None else self.reader.probe(cheap)
        if not self.reset_rss_peak:   # the step's lower bound where VmHWM does not rise (the thread's too)
            rss = getattr(snap, "process_bytes", 0) or 0
            if rss > self._rss_seen:
                self._rss_seen = int(rss)
        return snap

    @property
    def keeps_rss_peak(self) -> bool:
        """True where the step samples leave the process's own peak intact: ``reset_rss_peak``
        off on a CPU device without a ``peak_fn``."""
        return not self.reset_rss_peak and self.peak_fn is None and self.reader.device == "cpu"

    @property
    def peaks_exact(self) -> bool:
        """True where the largest step peak read is the steps' true peak: always with the reset
        (or a device allocator's window); with the process's peak kept intact, once a step
        raised VmHWM past its value at :meth:`prime` (before that every step peak is a lower
        bound)."""
        return not self.keeps_rss_peak or self.peak_rose

    def _kept_peak(self, hwm: Optional[int], rss: int) -> int:
        """A step's peak with the process's peak kept intact (bytes): VmHWM where it rose since
        the last step sample, else the largest RSS read since then."""
        seen, self._rss_seen = max(self._rss_seen, rss), 0
        if hwm is not None and (self._hwm_seen is None or hwm > self._hwm_seen):
            self.peak_rose = self.peak_rose or self._hwm_seen is not None
            self._hwm_seen = int(hwm)
            return max(int(hwm), rss)
        return seen

    def pressure(self) -> Optional[float]:
        """The pressure signal read alone (percent), None where there is none."""
        return self.reader.pressure()

    def reset_peak(self) -> None:
        """Start a new peak window on the device. Where the reader has no resettable peak, a
        software baseline is kept instead (``stats.reset_peak_memory``; its peak figures, not the
        snapshots', start again). Nothing on a CPU device with ``reset_rss_peak`` off."""
        reader = self.reader
        if not self.reset_rss_peak and reader.device == "cpu":
            return
        if not reader.reset_peak():
            from .stats import reset_peak_memory
            reset_peak_memory(reader.device)

    def prime(self) -> None:
        """Start the first step's peak window (at train start: the model loading before it is not
        the first step's peak)."""
        if self.peak_fn is not None:
            self.peak_fn()
        elif self.keeps_rss_peak:
            snap = self.probe(True)
            self._hwm_seen, self._rss_seen = snap.process_peak_bytes, 0
        else:
            self.reset_peak()

    def read_step(self) -> Tuple[float, int, int, int]:
        """One step sample's figures, the peak window restarted after:
        ``(monotonic s, RSS, used, capacity)``; used = the peak of the last micro-batch (at least
        the RSS), capacity = process + available (bytes)."""
        kept = self.keeps_rss_peak
        if self.probe_fn is None and self.peak_fn is None and not kept:
            figs = self.reader.step_figures()
            if figs is not None:     # the common Linux CPU case: no snapshot object
                self.reset_peak()
                return figs
        snap = self.probe(True)
        if self.peak_fn is not None:
            peak = self.peak_fn()
        elif kept:
            peak = self._kept_peak(snap.process_peak_bytes, int(snap.process_bytes))
        else:
            peak = snap.process_peak_bytes
            if peak is not None:
                self.reset_peak()
        now = getattr(snap, "timestamp", None) or time.monotonic()
        rss = int(snap.process_bytes)
        return now, rss, max(int(peak or 0), rss), rss + getattr(snap, "available_bytes", 0)

    def take_window(self):
        """The counters the device's reader read as the last peak window closed, taken (a second
        call returns None until the next window closes): on CUDA the allocator's window peaks and
        its ``num_alloc_retries`` / ``num_ooms`` counts (``memguard_torch.probes_cuda.CudaStepReader.window``);
        None on other devices, before a reader was built, or with a ``peak_fn`` (no reader
        window is closed then)."""
        reader = self._reader
        if reader is None or self.peak_fn is not None:
            return None
        w = getattr(reader, "window", None)
        if w is not None:
            reader.window = None
        return w

    def live(self) -> Optional[int]:
        """Bytes held by live allocations, None when unknown.

        Raises:
            Exception: what ``live_fn`` raises (the reader's own failures read as None).
        """
        v = self.live_fn() if self.live_fn is not None else self.reader.live_bytes()
        return None if v is None else int(v)


class SamplerThread:
    """A daemon thread calling ``sample()`` every ``interval_s`` seconds until stopped.

    ``sample`` should not raise; if it does, the failure goes to ``on_error(exc)`` and sampling
    goes on (a monitor thread that dies would leave the run unguarded without a word).
    """

    def __init__(self, sample: Callable[[], object], on_error: Callable[[BaseException], None],
                 name: str = "memguard-monitor"):
        self._sample = sample
        self._on_error = on_error
        self._name = name
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def running(self) -> bool:
        """True while the thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, interval_s: float) -> None:
        """Start sampling every ``interval_s`` (> 0) seconds; no-op when already running."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, args=(float(interval_s),), name=self._name,
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and wait up to ``timeout`` seconds for the thread (not when called from it)."""
        self._stop.set()
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self._sample()
            except Exception as exc:
                self._on_error(exc)
