"""What a guarded run leaves to look at: the event log, the one-line WARNING of every decision, the
per-step figures under standard names, the leak check and the CUDA snapshots.

:class:`RunRecorder` is owned by :class:`memguard_core.guard.Guard`, which calls it at each moment;
nothing here raises into the training loop (every failure is logged once and the recorder goes on
without the part that failed).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Tuple

from . import frameworks
from .events import LOG_DIR_ENV, EventLog
from .leak import LeakDetector
from .process_peak import process_peak_rss_bytes

__all__ = ["RunRecorder", "step_figures", "FIGURE_NAMES", "SNAPSHOTS_ENV", "fragmentation_note",
           "FRAGMENTATION_WARN_SHARE"]

SNAPSHOTS_ENV = "MEMGUARD_CUDA_SNAPSHOTS"
GiB = float(1 << 30)

#: The per-step figures every adapter reports, under these names (GiB as the names say; the HF
#: ``logs`` / ``log_history``, Lightning's ``log_dict`` with a ``memguard/`` prefix, mlx_lm's report
#: dicts). Names follow what torchtitan and Composer users read (``memory/peak_*``, reserved on CUDA,
#: ``num_alloc_retries`` / ``num_ooms``).
FIGURE_NAMES = ("memguard_peak_gib", "memguard_current_gib", "memguard_budget_gib", "memguard_usage",
                "memguard_micro_batches", "memguard_reserved_gib", "memguard_num_alloc_retries",
                "memguard_num_ooms")


def step_figures(peak: Optional[int], current: Optional[int], budget: Optional[int], micro_batches: int,
                 cuda_stats: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The per-step figures as a dict of :data:`FIGURE_NAMES` (GiB rounded to 3 decimals; usage a
    fraction of the budget); the CUDA ones only when ``cuda_stats`` (``torch.cuda.memory_stats()``)
    is given."""
    out: Dict[str, Any] = {"memguard_micro_batches": int(micro_batches)}
    if peak is not None:
        out["memguard_peak_gib"] = round(peak / GiB, 3)
    if current is not None:
        out["memguard_current_gib"] = round(current / GiB, 3)
    if budget:
        out["memguard_budget_gib"] = round(budget / GiB, 3)
        if peak is not None:
            out["memguard_usage"] = round(peak / budget, 4)
    if cuda_stats:
        out["memguard_reserved_gib"] = round(cuda_stats.get("reserved_bytes.all.current", 0) / GiB, 3)
        out["memguard_num_alloc_retries"] = int(cuda_stats.get("num_alloc_retries", 0))
        out["memguard_num_ooms"] = int(cuda_stats.get("num_ooms", 0))
    return out


#: The note on the allocator's expandable segments was logged in this process (once per process).
_SEGMENTS_NOTED = False

#: The share of the reserved peak, held but not allocated at it, from which that note is a WARNING
#: (an INFO below).
FRAGMENTATION_WARN_SHARE = 0.05


def fragmentation_note(step: int, reserved_peak: Optional[int], allocated_peak: Optional[int]) -> Tuple[int, str]:
    """The one line said when the CUDA caching allocator runs without expandable segments:
    ``(logging level, message)``. The cost is the reserved peak minus the allocated peak of the
    window with the largest reserved peak in optimizer step ``step`` (bytes): memory the allocator
    held from the driver at the step's peak without a tensor in it, cached blocks whose sizes the
    peak's requests did not fit (fragmentation). A WARNING from :data:`FRAGMENTATION_WARN_SHARE`
    of the reserved peak, else INFO; INFO without figures."""
    head = ("memguard: the CUDA caching allocator runs without expandable segments (PYTORCH_CUDA_ALLOC_CONF / "
            "PYTORCH_ALLOC_CONF has no expandable_segments:True)")
    tail = ("; with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the environment before the first CUDA "
            "allocation (memguard run sets it) the allocator grows its segments in place instead, PyTorch's advice "
            "for reserved but unallocated memory")
    if not reserved_peak or allocated_peak is None:
        return logging.INFO, head + tail
    gap = max(0, int(reserved_peak) - int(allocated_peak))
    share = gap / int(reserved_peak)
    level = logging.WARNING if share >= FRAGMENTATION_WARN_SHARE else logging.INFO
    return level, (f"{head}: at step {step}'s peak it reserved {reserved_peak / GiB:.2f} GiB for "
                   f"{allocated_peak / GiB:.2f} GiB allocated, {gap / GiB:.2f} GiB ({share:.0%}) held in cached "
                   f"blocks the peak's requests did not fit (fragmentation){tail}")


def _rank() -> int:
    r = frameworks.rank()
    if r is not None:
        return int(r)
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RunRecorder:
    """The run's event log, leak check and CUDA snapshots, driven by the guard.

    Args:
        options: the run's ``GuardOptions`` (``log_dir``, ``cuda_snapshots``, ``snapshot_steps``,
            ``leak_detector``).
        log: the adapter's logger: every decision gets one WARNING line there.
    """

    def __init__(self, options: Any, log: logging.Logger):
        self.options = options
        self.log = log
        self.events: Optional[EventLog] = None
        self.leak: Optional[LeakDetector] = None
        self.snapshots: Any = None
        self.cuda_stats: Any = None
        self.last_figures: Dict[str, Any] = {}
        self.max_usage = 0.0                # the largest step usage recorded (fraction of the budget)
        self._seen_step: Optional[int] = None
        self._window_peak = 0
        self._last_k: Optional[int] = None
        self._segments_off = False          # CUDA without expandable segments: say it at the first step
        self._cuda_peak: Optional[Tuple[int, int]] = None   # (reserved, allocated) peaks of the step's largest window

    def start(self, device: str, budget_bytes: int) -> None:
        """Open the event log, arm the leak check and start recording CUDA history (as configured)."""
        o = self.options
        self.max_usage = 0.0
        rank = _rank()
        try:
            log_dir = o.log_dir or os.environ.get(LOG_DIR_ENV)
            if log_dir:
                self.events = EventLog(log_dir, rank=rank, device=device, budget_bytes=budget_bytes)
                if self.events.enabled:
                    self.log.info("memguard: event log %s (draw it: memguard report %s)", self.events.path,
                                  self.events.path)
        except Exception:
            self.log.warning("memguard: event log off", exc_info=True)
            self.events = None
        if o.leak_detector:
            what = "CUDA memory at step start" if str(device).startswith("cuda") else "process memory at step start"
            self.leak = LeakDetector(what=what, on_leak=lambda r: self.decision("leak", r.message, r.step))
        if str(device).startswith("cuda"):
            self._start_cuda(rank)

    def _start_cuda(self, rank: int) -> None:
        self.cuda_stats = frameworks.cuda_memory_stats()
        try:
            from .probes.alloc_conf import allocator_settings, expandable_segments

            self._segments_off = expandable_segments(allocator_settings()) is False
        except Exception:
            self.log.debug("memguard: allocator settings not read", exc_info=True)
        folder = self.options.cuda_snapshots or os.environ.get(SNAPSHOTS_ENV)
        if folder:
            factory = frameworks.cuda_snapshots()
            self.snapshots = None if factory is None else factory(folder, rank, self.options.snapshot_steps)
            if self.snapshots is None:
                self.log.warning("memguard: cuda_snapshots needs torch (memguard_torch): no snapshots")
            elif not self.snapshots.start():
                self.snapshots = None

    def decision(self, kind: str, message: str, step: Optional[int] = None, *, warn: bool = True,
                 **fields: Any) -> None:
        """One decision: a WARNING line on the adapter's logger (unless the monitor already logged
        it) and a record in the event log."""
        if warn:
            self.log.warning("memguard: %s", message)
        if self.events is not None:
            self.events.decision(kind, message, step=step, **fields)

    def event(self, event: Any) -> None:
        """A monitor decision (``MemoryEvent``): the monitor logs it; this records it."""
        if self.events is not None:
            d = event.to_dict()
            kind = {"split": "split", "grow": "grow", "clean": "clean"}.get(d.get("action"), "pressure")
            if "out of memory" in str(d.get("message", "")):
                kind = "oom_retry"
            self.events.decision(kind, d.get("message", ""), step=d.get("step"), level=d.get("level"),
                                 usage=d.get("usage"), micro_batches=d.get("micro_batches"), source=d.get("source"))

    def oom(self, step: Optional[int], *, peer: bool = False) -> None:
        """An out-of-memory error was caught (the monitor's split event records and logs the
        re-split): the CUDA snapshot of that moment, before anything is freed (``peer``: another
        rank's error)."""
        if self.snapshots is not None:
            self.snapshots.oom(step, peer=peer)

    @property
    def closed_step(self) -> Optional[int]:
        """The last step number :meth:`step` saw (its record written, or due at the next new
        one); None before the first."""
        return self._seen_step

    def next_micro_batches(self, micro_batches: int) -> None:
        """The k a batch boundary decided when the step before it was already recorded
        (``Guard.end_step``): the next record says its step ran with it."""
        self._last_k = int(micro_batches)

    def step(self, step: Optional[int], figures: Optional[Dict[str, int]], micro_batches: int, level: str) -> None:
        """A batch boundary's sample (``MemoryMonitor.last_step_figures``: the peak of the batch
        just done, the process figure now, the budget; bytes), ``step`` = optimizer steps completed.
        With gradient accumulation several boundaries share one ``step``: the first one that shows a
        new ``step`` closes that optimizer step (its last batch), so a record is written then, with
        the largest peak of the step's batches: event log record, leak check, snapshots."""
        if not figures:
            return
        if figures.get("peak") is not None:
            self._window_peak = max(self._window_peak, int(figures["peak"]))
        if figures.get("reserved_peak") is not None and (self._cuda_peak is None
                                                         or figures["reserved_peak"] > self._cuda_peak[0]):
            self._cuda_peak = (int(figures["reserved_peak"]), int(figures.get("allocated_peak") or 0))
        # the batch just done ran with the k of the previous boundary; ``micro_batches`` is the next one's
        k_done, self._last_k = (self._last_k or micro_batches), micro_batches
        if step is None or step == self._seen_step:
            return
        micro_batches = k_done
        self._seen_step = step
        figures = dict(figures, peak=self._window_peak or figures.get("peak"))
        self._window_peak = 0
        cuda_peak, self._cuda_peak = self._cuda_peak, None
        if step < 1:
            return
        if self._segments_off:
            self._note_segments(step, cuda_peak)
        try:
            stats = self.cuda_stats() if self.cuda_stats is not None else None
        except Exception:
            stats = None
        self.last_figures = step_figures(figures.get("peak"), figures.get("current"), figures.get("budget"),
                                         micro_batches, stats)
        self.max_usage = max(self.max_usage, self.last_figures.get("memguard_usage") or 0.0)
        if self.events is not None:
            # the process's peak over its life on every record: a run killed before its end record
            # still says it (the per-step resets took it from ru_maxrss)
            self.events.step(step, peak_bytes=figures.get("peak"), current_bytes=figures.get("current"),
                             budget_bytes=figures.get("budget"), micro_batches=micro_batches, pressure=level,
                             reserved_bytes=None if not stats else stats.get("reserved_bytes.all.current"),
                             num_alloc_retries=None if not stats else stats.get("num_alloc_retries"),
                             process_peak_rss_bytes=process_peak_rss_bytes())
        if self.leak is not None and figures.get("current") is not None:
            self.leak.sample(step, figures["current"])
        if self.snapshots is not None:
            self.snapshots.step_end(step, level)

    def _note_segments(self, step: int, cuda_peak: Optional[Tuple[int, int]]) -> None:
        """Once per process, at the first optimizer step's record (its peak is known then, and a run
        that dies later has said it): expandable segments are off, and what fragmentation cost at
        that step's peak (:func:`fragmentation_note`)."""
        global _SEGMENTS_NOTED
        self._segments_off = False
        if _SEGMENTS_NOTED:
            return
        _SEGMENTS_NOTED = True
        level, msg = fragmentation_note(step, *(cuda_peak or (None, None)))
        self.log.log(level, "%s", msg)

    def finish(self, summary: Optional[Dict[str, Any]]) -> None:
        """Close the event log (with the summary) and stop the CUDA history."""
        if self.snapshots is not None:
            self.snapshots.stop()
        if self.events is not None:
            self.events.close(**{k: v for k, v in (summary or {}).items() if isinstance(v, (int, float, str, list))})
            self.log.info("memguard: event log written: %s (memguard report %s)", self.events.path, self.events.path)
