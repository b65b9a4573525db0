"""The Lightning training step in one process: each batch cut in place into k micro-batches, the
non-final ones' backwards run by memguard, the final one's left to Lightning; a forward
out-of-memory error re-cuts the rows not yet processed, a backward one redoes the accumulation
window. The DDP strategy (``step_ddp``) builds on it. See docs/lightning.md, "How the step runs"."""

from __future__ import annotations

import contextlib
import logging

from memguard_torch.oom import is_oom_error

from .batch import batch_units
from .logs import LogRecorder
from .step_base import StrategyStep, loss_of, with_loss

logger = logging.getLogger("memguard.lightning")

__all__ = ["PlainStep"]


class PlainStep(StrategyStep):
    """One process: the batch in k micro-batches inside Lightning's automatic optimization, a
    forward OOM re-cut, a backward OOM redone over the window. With several ranks it is the base of
    ``DdpStep``, which adds the ranks' agreement."""

    def training_step(self, batch, args, kwargs, k: int, batch_idx: int):
        if k <= 1:
            units = batch_units(batch)
            self.guard.micro_batch_rows.append(units)  # every forward tried, a failed one included
            failure = None
            try:
                self._phase = "forward"
                out = self._step(batch, args, kwargs)
                self.fit.rows_this_step += units
                return out
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                failure = self._caught_oom(exc)
            k = self._after_oom(failure, 1, units)
        return self._split_step(batch, args, kwargs, k, batch_idx)

    # ------------------------------------------------------------------ hooks
    def _collectives_unsynced(self) -> bool:
        """Several ranks whose forwards run collectives without memguard's sync points: a rank
        retrying a forward alone would leave its peers waiting (never in one process)."""
        return False

    def _chunk_grad_context(self):
        """The context of a non-final chunk's forward (DDP after a kept failure: no gradients)."""
        return contextlib.nullcontext()

    def _chunk_backward(self, loss, scale: float, optimizer) -> None:
        """A non-final chunk's backward, of ``loss * scale``."""
        self._backward(loss * scale, optimizer)

    # ------------------------------------------------------------------ the chunk loop
    def _split_step(self, batch, args, kwargs, k: int, batch_idx: int):
        """The batch in k micro-batches: the non-final ones' forward and backward here, the final
        one's forward returned for Lightning's backward. A forward OOM redoes the rows not yet
        processed at a doubled k; a backward OOM redoes the window (the earlier batches by
        memguard, this one from its first row)."""
        fit = self.fit
        trainer, pl_module = self.trainer, self.pl_module
        orig = fit.orig_training_step
        try:
            sp = fit.splitter(batch)
        except ValueError:
            fit.count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        accum = fit.accum()
        optimizer = fit.optimizer()
        if fit.zero_grad_coming(batch_idx):
            # Lightning would zero after this training_step, wiping the chunks' gradients: zero now
            fit.orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            fit.zero_armed_for = batch_idx
        recorder = LogRecorder(pl_module.log)
        earlier = None  # sum of the non-final chunks' weighted losses, detached
        start = 0
        try:
            while True:
                failure = None
                pl_module.log = recorder
                try:
                    for u0, u1 in sp.ranges(k, start):
                        chunk, w, units = sp.chunk(u0, u1)
                        self._phase = "forward"
                        self.guard.micro_batch_rows.append(units)
                        with self._chunk_grad_context():
                            out = self._step(chunk, args, kwargs)
                        loss = loss_of(out)
                        if u1 == sp.units:
                            recorder.end_chunk(w, commit=True)
                            fit.rows_this_step += units
                            pl_module.__dict__.pop("log", None)
                            recorder.flush()
                            if loss is None:
                                return out
                            total = loss * w if earlier is None else loss * w + earlier
                            return with_loss(out, total)
                        if loss is not None:
                            fit.chunk_grads_for = batch_idx
                            self._chunk_backward(loss, w / accum, optimizer)
                            part = loss.detach() * w
                            earlier = part if earlier is None else earlier + part
                        out = loss = None
                        recorder.end_chunk(w, commit=True)
                        fit.rows_this_step += units
                        start = u1
                except Exception as exc:
                    recorder.end_chunk(0.0, commit=False)
                    if not is_oom_error(exc):
                        raise
                    failure = self._caught_oom(exc)
                out = loss = chunk = None
                pl_module.__dict__.pop("log", None)
                if self._phase == "forward":
                    # earlier chunks' gradients are weighted for the whole batch: re-cut only the rest
                    k = self._after_oom(failure, k, sp.units - start)
                    continue
                why = self.can_redo()
                if why is not None:
                    logger.error("memguard: out of memory in a backward; the accumulation window cannot be "
                                 "redone (%s)", why)
                    raise failure
                # the window's earlier batches again, then this one from its first row
                k = self._redo_window(failure, k, through_current=False)
                recorder = LogRecorder(recorder.real_log)
                earlier, start = None, 0
        finally:
            pl_module.__dict__.pop("log", None)

    def _after_oom(self, exc: BaseException, k: int, units_left: int) -> int:
        """Free memory after a forward OOM and return the doubled split; re-raise if none helps, or
        when the forwards run collectives without sync points (a retry on one rank would hang)."""
        if self._collectives_unsynced():
            logger.error("memguard: out of memory with several ranks whose forwards run collectives without "
                         "OOM sync points; a retry on one rank alone would leave the others waiting, so it is "
                         "re-raised (%s)", exc)
            raise exc
        return self.guard.after_oom(exc, k, units_left, self.trainer.global_step)
