"""The Lightning training step on several ranks without FSDP: under plain DDP memguard turns DDP's
gradient all-reduce off for the window, the ranks agree after each batch's backward whether any
failed (every rank then redoes the window), and memguard averages the gradients once at the
window's end. See docs/lightning.md, "Under DDP" and "How the step runs"."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

from memguard_torch import train_reading as tt
from memguard_torch.distributed import flag_group
from memguard_torch.oom import is_oom_error

from . import _compat
from .step_base import release_graph
from .step_plain import PlainStep

logger = logging.getLogger("memguard.lightning")

__all__ = ["DdpStep"]


class DdpStep(PlainStep):
    """Several ranks, no FSDP sync points: the one-process step, and under Lightning's DDP reducing
    by plain averaging memguard's own gradient average, so that every rank redoes a window that
    failed on any. The DDP module is looked up once, at the first batch whose window is kept in
    order; each batch is averaged by memguard only where Lightning's optimizer-step point is readable
    and a backward comes (:meth:`_ddp_for_window`). Without it a backward OOM is re-raised
    (``can_redo``)."""

    def __init__(self, fit):
        super().__init__(fit)
        self._ddp = None                # this batch's DDP module when memguard averages the gradients
        self._ddp_found: Any = None     # the fit's DDP module (False: none, or not averaged by memguard)
        self._sync_was: Optional[bool] = None  # DDP's require_backward_grad_sync before memguard turned it off
        self._pending: Optional[BaseException] = None  # a chunk's backward OOM awaiting the ranks' agreement

    # ------------------------------------------------------------------ per batch, per fit
    def new_batch(self) -> None:
        self._ddp = None

    def end_batch(self) -> None:
        self._restore_sync()
        self._pending = None
        super().end_batch()

    def release(self) -> None:
        self._restore_sync()
        self._ddp = self._pending = None
        self._ddp_found = None

    def training_step(self, batch, args, kwargs, k: int, batch_idx: int):
        ddp = self._ddp_for_window()
        if ddp is not None:
            self._ddp = self._sync_off(ddp)
        return super().training_step(batch, args, kwargs, k, batch_idx)

    def backward(self, loss, *args, **kwargs):
        if self._ddp is not None:
            return self._ddp_backward(loss, *args, **kwargs)
        return super().backward(loss, *args, **kwargs)

    # ------------------------------------------------------------------ hooks
    def _collectives_unsynced(self) -> bool:
        # tensor parallelism under ModelParallelStrategy: its collectives have no sync points
        return "ModelParallel" in type(self.trainer.strategy).__name__

    def _ranks_redo_together(self) -> bool:
        return self._ddp is not None

    def _chunk_grad_context(self):
        return torch.no_grad() if self._pending is not None else contextlib.nullcontext()

    def _chunk_backward(self, loss, scale: float, optimizer) -> None:
        """A non-final chunk's backward. Under memguard's average an out-of-memory error there is
        kept for the ranks' agreement at this batch's backward (the other ranks are not told here:
        they run no collective until then); the rest of the batch runs its forwards without
        gradients, so its logged values and returned loss are complete."""
        if self._pending is not None:
            return
        if self._ddp is None:
            self._backward(loss * scale, optimizer)
            return
        try:
            self._backward(loss * scale, optimizer)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            self._pending = self._caught_oom(exc)

    # ------------------------------------------------------------------ DDP
    def _ddp_for_window(self):
        """The DDP module when this batch's gradients are averaged by memguard once the ranks agreed
        that the window went through, else None: Lightning's DDP wrapper reducing by plain averaging
        (no communication hook, no static graph), Lightning's optimizer-step point readable, a
        backward to come, and the window's batches all kept in order. The same answer on every rank
        (nothing here is rank-local)."""
        trainer = self.trainer
        if not self.fit.window_ok:
            return None
        if self._ddp_found is None:
            strategy = trainer.strategy
            ddp = tt.find_ddp(getattr(strategy, "model", None))
            why = _compat.ddp_reduces_its_own_way(strategy, ddp) if ddp is not None else None
            if why is not None:
                logger.warning("memguard: %s; an out-of-memory error in a backward under DDP is re-raised, "
                               "not redone", why)
                ddp = None
            self._ddp_found = ddp if ddp is not None else False
        if self._ddp_found is False or _compat.skip_backward(trainer) or _compat.window_ends(trainer) is None:
            return None
        return self._ddp_found

    def _sync_off(self, ddp) -> Any:
        """Turn DDP's gradient all-reduce off for this batch (it runs inside DDP's forward: DDP's
        ``_post_forward`` then leaves the reducer unprepared); the DDP module, or None when the flag
        could not be set (DDP then reduces as usual and memguard must not average again)."""
        if self._sync_was is None:
            self._sync_was = _compat.ddp_sync_off(ddp)
        return ddp if self._sync_was is not None else None

    def _restore_sync(self) -> None:
        if self._sync_was is not None and self._ddp is not None:
            _compat.ddp_sync_restore(self._ddp, self._sync_was)
        self._sync_was = None

    def _ddp_backward(self, loss, *args, **kwargs):
        """Lightning's backward of a batch under memguard's gradient average: its backward (no
        all-reduce: DDP's reducer was left unprepared), then every rank says whether its batch went
        through (``Guard.agree_redo``); if one did not, every rank zeroes the gradients and redoes
        the window at a larger k. At the window's end the gradients are averaged once
        (``memguard_torch.train_reading.average_ddp_gradients``), before ``on_after_backward`` and
        gradient clipping, as DDP's all-reduce would be."""
        ddp = self._ddp
        self._restore_sync()
        failure, self._pending = self._pending, None
        self._phase = "backward"
        if failure is None:
            try:
                self.fit.orig_backward(loss, *args, **kwargs)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                failure = self._caught_oom(exc)
            if failure is not None:
                release_graph(loss)
        loss = None
        if self.guard.agree_redo(failure is not None):
            mon = self.guard.monitor
            self._redo_window(failure, mon.micro_batches if mon is not None else 1, through_current=True,
                              phase="backward")
        if _compat.window_ends(self.trainer):
            # the has-gradient mask on a gloo group of its own: a CPU tensor on an NCCL group would fail
            tt.average_ddp_gradients(ddp, flag_group())
            _compat.ddp_buffers_at_next_forward(ddp)
            self.fit.ddp_averages += 1
        return None
