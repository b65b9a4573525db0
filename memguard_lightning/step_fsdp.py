"""The Lightning training step under FSDP: FSDP2 (``fully_shard`` under ``ModelParallelStrategy``)
and FSDP1 (``FSDPStrategy``). Every micro-batch runs between memguard's OOM sync points
(``memguard_torch.sync``) and reduce-scatters; an out-of-memory error on any rank makes every rank
redo the accumulation window. See docs/lightning.md, "Limits" (FSDP2, FSDP1) and "How the step
runs"."""

from __future__ import annotations

import logging
from typing import Optional

from memguard_torch import _compat as torch_compat
from memguard_torch.oom import is_oom_error
from memguard_torch.ranks import agreed_ranges, fsdp_after_abort
from memguard_torch.sync import OomSync, PeerOutOfMemoryError

from . import _compat
from .batch import batch_units
from .logs import LogRecorder
from .step_base import StrategyStep, loss_of, release_graph, with_loss
from .step_ddp import DdpStep

logger = logging.getLogger("memguard.lightning")

__all__ = ["FsdpStep", "Fsdp1Step", "Fsdp1UnsyncedStep"]


class FsdpStep(StrategyStep):
    """FSDP2 on several ranks with the OOM sync points: each batch's micro-batches agreed by every
    rank (``agreed_ranges``), each forward and backward between the sync points, every backward
    reduce-scattering (no ``no_sync`` for FSDP2); the last micro-batch's backward is Lightning's and
    its micro-batch ends in :meth:`backward`. The batch's ``self.log`` values are logged once every
    rank knows it went through.

    Args:
        fit: the fit's ``GuardedStep``.
        model: what FSDP's reset after an abort walks and the window redo zeroes (the module; FSDP1:
            the root).
        sync: the run's ``OomSync``.
        hooks: the sync points in FSDP's comms (``FsdpSyncHooks`` / ``Fsdp1SyncHooks``; None in one
            process), taken out at ``release``.
    """

    catches_chunk_oom = True

    def __init__(self, fit, model, sync: OomSync, hooks=None):
        super().__init__(fit)
        self.model = model
        self.sync = sync
        self.hooks = hooks
        self._final = False             # the batch's last micro-batch ends in Lightning's backward
        self._skip_backward = False     # the batch was redone in training_step: Lightning's backward is not run
        self._final_recorder: Optional[LogRecorder] = None  # the batch's values, logged after its backward

    # ------------------------------------------------------------------ per batch, per fit
    def end_batch(self) -> None:
        self._final = self._skip_backward = False
        super().end_batch()
        self._final_recorder = None
        self.sync.inside = False   # a final micro-batch whose backward Lightning skipped

    def release(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()     # FSDP gets its comms back
        self.hooks = None

    # ------------------------------------------------------------------ hooks
    def _ranks_redo_together(self) -> bool:
        return True

    def _grad_owner(self):
        return self.model

    def _ranges(self, sp, k: int):
        return agreed_ranges(sp, k, 0, self.sync.group)

    def _chunk_begin(self) -> None:
        """A micro-batch begins between the FSDP sync points."""
        sync = self.sync
        sync.grads_added = False
        if self.hooks is not None:
            self.hooks.new_chunk()
        sync.inside = sync.group is not None

    def _chunk_abandoned(self) -> None:
        """An error other than out-of-memory left a micro-batch: it propagates (the run ends), and
        the sync points stop answering."""
        self.sync.inside = False

    def _chunk_end(self, exc: Optional[BaseException]) -> Optional[BaseException]:
        """The end of a micro-batch: ``exc`` this rank's out-of-memory error (None: it went
        through); every rank learns whether any failed (``OomSync.end``). Returns None when none
        did, else the failure to redo the window for (this rank's error, or a
        ``PeerOutOfMemoryError``), FSDP's state reset and memory freed (``fsdp_after_abort``)."""
        sync = self.sync
        sync.inside = False
        if exc is not None:
            self.fit.oom_errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        top, _low = sync.end(0 if exc is None else (2 if sync.grads_added else 1))
        if top == 0:
            return None
        fsdp_after_abort(self.model)
        return exc if exc is not None else PeerOutOfMemoryError("at the end of a micro-batch")

    # ------------------------------------------------------------------ the batch
    def training_step(self, batch, args, kwargs, k: int, batch_idx: int):
        """The batch's micro-batches between the sync points; the last one's backward is Lightning's,
        ended in :meth:`_final_backward`. An out-of-memory error on any rank, learnt by every rank at
        the end of the micro-batch, makes every rank redo the window, this batch included (here, or
        in :meth:`_final_backward` on a rank that had already returned); the batch's loss is then the
        redone one, detached, and Lightning's backward of it is skipped (its gradients are in)."""
        fit = self.fit
        trainer, pl_module, sync = self.trainer, self.pl_module, self.sync
        try:
            sp = fit.splitter(batch) if k > 1 else None
        except ValueError:
            sp = None
        ranges = [(0, batch_units(batch))] if sp is None else agreed_ranges(sp, k, 0, sync.group)
        accum, optimizer = fit.accum(), fit.optimizer()
        if len(ranges) > 1 and fit.zero_grad_coming(batch_idx):
            # Lightning would zero after this training_step, wiping the chunks' gradients: zero now
            fit.orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            fit.zero_armed_for = batch_idx
        recorder = LogRecorder(pl_module.log)
        earlier = failure = None
        try:
            for i, (u0, u1) in enumerate(ranges):
                chunk, w, units = (batch, 1.0, batch_units(batch)) if sp is None else sp.chunk(u0, u1)
                final = i == len(ranges) - 1
                self._phase = "forward"
                self.guard.micro_batch_rows.append(units)
                pl_module.log = recorder
                exc = out = loss = None
                self._chunk_begin()
                try:
                    with self._grad_sync():
                        out = self._step(chunk, args, kwargs)
                        loss = loss_of(out)
                        if loss is not None and not final:
                            fit.chunk_grads_for = batch_idx
                            self._backward(loss * (w / accum), optimizer)
                    if loss is not None and not final:
                        part = loss.detach() * w
                        earlier = part if earlier is None else earlier + part
                except Exception as e:
                    if not is_oom_error(e):
                        self._chunk_abandoned()
                        raise
                    exc = self._caught_oom(e)
                pl_module.__dict__.pop("log", None)
                chunk = None
                if final and exc is None and loss is not None:
                    # this micro-batch ends in Lightning's backward of the returned loss; its values
                    # are logged there, once every rank knows it went through (a sync_dist log is a
                    # collective: logged here, it could wait for a rank that failed)
                    recorder.end_chunk(w, commit=True)
                    self._final_recorder = recorder
                    fit.rows_this_step += units
                    self._final = True
                    return with_loss(out, loss * w if earlier is None else loss * w + earlier)
                loss = None
                if exc is not None:
                    out = None   # the failed chunk's graph goes before memory is freed
                failure = self._chunk_end(exc)
                if failure is not None:
                    out = None
                    break
                recorder.end_chunk(w, commit=True)
                fit.rows_this_step += units
                if final:
                    recorder.flush()
                    return out   # the step returned no loss: Lightning runs no backward
                out = None
        finally:
            pl_module.__dict__.pop("log", None)
        recorder = earlier = None   # logged values may hold the failed micro-batch's graph
        why = self.can_redo()
        if why is not None:
            logger.error("memguard: out of memory under FSDP; the accumulation window cannot be redone (%s)", why)
            raise failure
        # one process has no sync points to set grads_added: its own phase tells
        self._redo_window(failure, k, through_current=True, log_current=True,
                          phase="backward" if sync.grads_added or self._phase == "backward" else "forward")
        if fit.zero_grad_coming(batch_idx):
            fit.zero_armed_for = batch_idx   # Lightning's zero_grad would wipe the redone gradients
        self._skip_backward = True
        loss, self._redone_loss = self._redone_loss, None
        return loss

    def backward(self, loss, *args, **kwargs):
        if self._skip_backward:
            self._skip_backward = False   # redone in training_step, gradients complete
            return None
        if self._final:
            return self._final_backward(loss, *args, **kwargs)
        return super().backward(loss, *args, **kwargs)

    def _final_backward(self, loss, *args, **kwargs):
        """Lightning's backward of the batch's last micro-batch, still between the sync points its
        forward began: at its end every rank learns whether any failed; on a failure every rank
        redoes the window, this batch included (its values were logged when its forward went
        through), and Lightning goes on with complete gradients."""
        self._final = False
        self._phase = "backward"
        exc = None
        try:
            with self._grad_sync():
                self.fit.orig_backward(loss, *args, **kwargs)
        except Exception as e:
            if not is_oom_error(e):
                self._chunk_abandoned()
                raise
            exc = self._caught_oom(e)
        if exc is not None:
            release_graph(loss)
        loss = None
        failure = self._chunk_end(exc)
        recorder, self._final_recorder = self._final_recorder, None
        if failure is None:
            if recorder is not None:
                with _compat.logging_as(self.pl_module, "training_step"):
                    recorder.flush()
            return None
        recorder = None
        why = self.can_redo()
        if why is not None:
            logger.error("memguard: out of memory under FSDP; the accumulation window cannot be redone (%s)", why)
            raise failure
        mon = self.guard.monitor
        # every rank logs this batch's values from the redo, at the same point (after the ranks agreed)
        self._redo_window(failure, mon.micro_batches if mon is not None else 1, through_current=True, phase="backward",
                          log_current=True)
        return None


class Fsdp1Step(FsdpStep):
    """FSDP1 under ``FSDPStrategy`` (several ranks with ``Fsdp1SyncHooks``, or one process without
    flags): the FSDP2 step, with FSDP1's gradient sync turned back on for each micro-batch (Lightning
    runs a window's earlier batches in FSDP1's ``no_sync``), so every micro-batch reduce-scatters;
    ``model`` is the root ``FullyShardedDataParallel``."""

    def _grad_sync(self):
        return torch_compat.fsdp1_sync_on(self.model)

    _own_backward_sync = _grad_sync


class Fsdp1UnsyncedStep(DdpStep):
    """FSDP1 on several ranks without OOM sync points (a hybrid sharding strategy, a communication
    hook of the user's): the step without a redo across ranks, FSDP1's gradient sync on for each
    micro-batch; an out-of-memory error is re-raised."""

    def __init__(self, fit, root):
        super().__init__(fit)
        self.root = root

    def _grad_sync(self):
        return torch_compat.fsdp1_sync_on(self.root)

    _own_backward_sync = _grad_sync

    def _grad_owner(self):
        return self.root

    def _collectives_unsynced(self) -> bool:
        return True
