"""What a guarded run does after an out-of-memory error: in a forward, the rows not yet processed are
redone in more micro-batches; in a backward (or the optimizer step) that left the window's gradients
partly summed, the micro-batches are raised and the whole accumulation window is redone, or a
``WindowOOMError`` names the plan that would fit; every rank agrees on the new k. A mixin of
:class:`memguard_core.guard.Guard`; the rules: docs/lifecycle.md, "Redoing the accumulation window".
"""

from __future__ import annotations

import gc
from typing import Callable, List, Optional

from . import frameworks
from .errors import WindowOOMError
from .microbatch import free_after_oom, free_caches, split_after_oom

__all__ = ["OomRecovery", "MAX_WINDOW_REDOS"]

#: Redos of one accumulation window after which a further OOM raises ``WindowOOMError``: each
#: redo doubles the micro-batches, so a window that keeps failing at this many doublings fails
#: for a reason splitting does not reach (a leak, memory taken by another process).
MAX_WINDOW_REDOS = 4


class OomRecovery:
    """The out-of-memory moments of :class:`memguard_core.guard.Guard` (uses its ``monitor``,
    ``preflight``, ``recorder``, ``log`` and ``oom_retries``)."""

    _floor_redone = False

    def agreed(self, k: int) -> int:
        """The MAX of ``k`` over ``torch.distributed`` ranks (every rank must cut alike: FSDP /
        ZeRO-3 gathers would hang otherwise); ``k`` itself outside a process group, or with a
        warning when the all-reduce fails. Never raises."""
        try:
            return frameworks.agree_max(k)
        except Exception:
            self.log.warning("memguard: micro-batch all-reduce failed; using the local k", exc_info=True)
            return k

    def after_oom(self, exc: BaseException, k: int, units_left: int, step: Optional[int],
                  free: Callable[[], None] = free_caches) -> int:
        """After an out-of-memory error in a micro-batch's forward (nothing of it kept): the CUDA
        snapshot of the moment (:meth:`snapshot_oom`, with ``cuda_snapshots``), then double the
        micro-batches for the ``units_left`` rows (sequences) not yet processed, free memory with
        ``free`` and return the new k; counts ``oom_retries``.

        Raises:
            ``exc`` itself when a single row already failed (no split can help).
        """
        self.snapshot_oom(step)   # before anything is freed: the moment a user wants to see
        self._oom_snapshot_taken = False
        if self.monitor is not None:
            k_new = split_after_oom(self.monitor, exc, k, units_left, step, self.log, free=free)
        else:
            if units_left <= 1 or k >= units_left:
                raise exc
            k_new = min(max(2, 2 * k), units_left)
            gc.collect()
            free()
        self.oom_retries += 1
        return k_new

    _oom_snapshot_taken = False

    def snapshot_oom(self, step: Optional[int], *, peer: bool = False) -> None:
        """An out-of-memory error was caught: with ``cuda_snapshots`` on, dump this rank's allocator
        snapshot (``rank{r}_step{n}_oom.pickle``, n = optimizer steps completed, as the event
        log's ``oom_retry`` record) before anything is freed. :meth:`after_oom` and
        :meth:`after_window_oom` call it first; an adapter may call it earlier, where the failed
        step's tensors are still referenced (its ``except`` block), and the guard's own call for
        that failure then dumps nothing. ``peer``: another rank failed (``_peer-oom``). Never
        raises."""
        if self._oom_snapshot_taken:
            return
        self._oom_snapshot_taken = True
        try:
            self.recorder.oom(step, peer=peer)
        except Exception:
            self.log.debug("memguard: OOM snapshot failed", exc_info=True)

    def oom_handled(self) -> None:
        """The caught out-of-memory error has been dealt with (an adapter's own handling, e.g. an
        evaluation re-split): the next one dumps its snapshot again (:meth:`snapshot_oom`)."""
        self._oom_snapshot_taken = False

    def agree_redo(self, failed: bool) -> bool:
        """Whether any ``torch.distributed`` rank must redo its accumulation window (the MAX of the
        flag over ranks), so no rank redoes alone: every rank calls it once per micro step.
        ``failed`` itself outside a process group, or with a warning when the all-reduce fails.
        Never raises."""
        try:
            return bool(frameworks.agree_max(int(bool(failed))))
        except Exception:
            self.log.warning("memguard: redo-flag all-reduce failed; using the local flag", exc_info=True)
            return bool(failed)

    def after_window_oom(self, exc: Optional[BaseException], k: int, rows: int, step: Optional[int], *,
                         redos: int, phase: str = "backward",
                         free: Callable[[], None] = free_after_oom) -> int:
        """After an out-of-memory error in a backward (or a forward, or the optimizer step) that left
        the accumulation window's gradients partly summed, once the adapter has zeroed them and
        dropped the failed step's references: the CUDA snapshot of the moment (``snapshot_oom``, with
        ``cuda_snapshots``; every rank dumps its own, a peer's failure included), then double the
        micro-batches (at most ``rows``), free memory with ``free`` (gc, ``malloc_trim``, CUDA / MPS
        caches) and return the k to redo the whole window with; counts ``oom_retries``. ``exc``
        None: another rank failed (this one redoes with it).

        Args:
            exc: the error caught on this rank (None: another rank's).
            k: micro-batches per batch of the failed attempt.
            rows: rows (packed: sequences) of the failing batch.
            step: optimizer steps completed (for the records).
            redos: redos of this window already done.
            phase: where it failed, for the log and the error.

        Raises:
            WindowOOMError: the failed attempt already ran one row per forward, or ``redos`` reached
                :data:`MAX_WINDOW_REDOS`; it names the plan that would fit.
        """
        self.snapshot_oom(step, peer=exc is None)   # before anything is freed (with cuda_snapshots)
        self._oom_snapshot_taken = False
        rows = max(1, int(rows))
        mon = self.monitor
        k = max(int(k), mon.micro_batches if mon is not None else 1)
        if redos == 0:
            self._floor_redone = False
        at_floor = k >= rows
        # the first failure at one row per forward gets one redo after the free: what the previous
        # optimizer step left in the heap (its temporaries) may be all that was short
        if exc is not None and ((at_floor and self._floor_redone) or redos >= MAX_WINDOW_REDOS):
            reason = ("it failed at one row per forward, also after freeing memory" if at_floor
                      else f"it failed {redos + 1} times in a row")
            self.log.error("memguard: out of memory in the %s; %s: %s", phase, reason, exc)
            raise WindowOOMError(phase, k, rows, redos, f"{reason}; last error: {exc}", self.fit_plan()) from exc
        self._floor_redone = self._floor_redone or at_floor
        new_k = min(max(2, 2 * k), rows)
        if mon is not None:
            why = (f"out of memory in the {phase} ({type(exc).__name__}); redoing the accumulation window"
                   if exc is not None else "another rank ran out of memory; redoing the accumulation window")
            new_k = max(new_k, mon.request_micro_batches(new_k, why, step))
        new_k = self.agreed(new_k)
        if mon is not None and new_k > mon.micro_batches:
            mon.request_micro_batches(new_k, "another rank asked for it", step)
        try:
            free()
        except Exception:
            self.log.debug("memguard: free after OOM failed", exc_info=True)
        self.oom_retries += 1
        self.log.warning("memguard: out of memory in the %s; gradients zeroed, redoing the accumulation window "
                         "with %d micro-batches per batch", phase, new_k)
        return new_k

    def optimizer_step_oom(self, exc: BaseException, k: int, rows: int) -> WindowOOMError:
        """The error for an out-of-memory error raised inside the optimizer step, to raise from
        ``exc``: a step that failed part-way may already have updated some parameters or states in
        place, so it is never retried or redone (docs/lifecycle.md, "optimizer step"); the lazily
        allocated states, the one allocation a step makes that is redoable, are allocated before the
        first forward instead (:func:`memguard_torch.optim_state.preallocate_optimizer_state`).
        Logged; never raises itself."""
        self.log.error("memguard: out of memory in the optimizer step; a step that failed part-way cannot be "
                       "redone: %s", exc)
        plan = ["a step that allocates less: an optimizer without per-step temporaries of every parameter "
                "(torch.optim.AdamW(foreach=False) allocates one parameter's at a time; 8-bit or "
                "factored states: bitsandbytes AdamW8bit, Adafactor)"] + self.fit_plan()
        return WindowOOMError("optimizer step", k, rows, 0, f"{exc}", plan)

    def fit_plan(self) -> List[str]:
        """The plan that would fit, as lines for an error: the preflight's report when one ran, else
        the changes that lower the peak of one row's forward and backward. Never raises."""
        try:
            pf = self.preflight
            if pf is not None:
                return [line.strip() for line in pf.report_lines() if line.strip()]
        except Exception:
            self.log.debug("memguard: no preflight plan for the error", exc_info=True)
        return ["turn activation checkpointing on (gradient_checkpointing=True)",
                "shorten the sequences (max_length / max_seq_length) or use LoRA instead of a full fine-tune",
                "give the run more memory; `memguard estimate` on this run's config prints the peak it needs"]
