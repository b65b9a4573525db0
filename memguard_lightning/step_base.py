"""What every strategy of the Lightning training step shares: the window redo, a kept batch run
again in micro-batches, the user's ``training_step`` and memguard's own backward, and the default
backward of the batch (an out-of-memory error there redoes the window). The strategies
(``step_plain``, ``step_ddp``, ``step_fsdp``) override the hooks; ``memguard_lightning.step``
chooses one per fit. See docs/lightning.md, "How the step runs"."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

from memguard_core.microbatch import without_frames
from memguard_torch.oom import is_oom_error
from memguard_torch.sync import PeerOutOfMemoryError

from . import _compat
from .batch import batch_units
from .logs import Discard, LogRecorder

logger = logging.getLogger("memguard.lightning")

__all__ = ["StrategyStep", "loss_of", "with_loss", "release_graph", "no_sync"]


def no_sync(strategy):
    """``strategy.block_backward_sync()`` (DDP ``no_sync``) where the strategy has one."""
    block = getattr(strategy, "block_backward_sync", None)
    return block() if callable(block) else contextlib.nullcontext()


def loss_of(out: Any) -> Optional[torch.Tensor]:
    """The loss in what a ``training_step`` returned (a tensor, or a dict's ``loss``), else None."""
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict):
        return out.get("loss")
    return None


def with_loss(out: Any, loss: torch.Tensor) -> Any:
    """``out`` (a tensor or a dict) with its loss replaced by ``loss``."""
    if torch.is_tensor(out):
        return loss
    new = dict(out)
    new["loss"] = loss
    return new


def release_graph(loss: Any) -> None:
    """Drop the autograd graph a failed backward left behind ``loss`` (the tensor Lightning still
    holds in its closure): ``detach_`` makes it a leaf, so the graph's unfreed saved tensors go
    with the last reference. Under a ``GradScaler`` ``loss`` is the scaled copy and the graph stays
    reachable from Lightning's unscaled loss until the batch ends."""
    try:
        if torch.is_tensor(loss) and loss.grad_fn is not None:
            loss.detach_()
    except Exception:
        logger.debug("memguard: could not detach the failed loss", exc_info=True)


class StrategyStep:
    """One fit's strategy of the training step: its chunk loop, out-of-memory handling and window
    redo. The state every strategy shares (the wrapped methods, the window's kept batches, the
    zero_grad arming, the counters) is the fit's ``memguard_lightning.step.GuardedStep``, ``fit``.

    Hooks for the strategies: :meth:`training_step` (the batch, after the guard chose k and kept
    the batch in the window), :meth:`backward`, :meth:`_grad_sync` / :meth:`_own_backward_sync`
    (the context of a micro-batch and of a backward memguard runs), :meth:`_ranges` (how a kept
    batch is cut), :meth:`_chunk_begin` / :meth:`_chunk_end` / :meth:`_chunk_abandoned` (the
    micro-batch between sync points), :meth:`_ranks_redo_together`, :meth:`_grad_owner`.
    """

    #: a kept batch's micro-batch that runs out of memory is ended between the sync points (FSDP),
    #: instead of raising the error at once
    catches_chunk_oom = False

    def __init__(self, fit):
        self.fit = fit
        self._phase = "forward"
        self._redone_loss = None        # the current batch's loss from a redo (_redo_window(log_current=True))

    @property
    def guard(self):
        return self.fit.guard

    @property
    def trainer(self):
        return self.fit.trainer

    @property
    def pl_module(self):
        return self.fit.pl_module

    def _caught_oom(self, exc: BaseException) -> BaseException:
        """An out-of-memory error caught in this step's ``except`` block: the guard's CUDA
        snapshot of the moment (with ``cuda_snapshots`` on), taken here while the failed
        micro-batch's tensors are still referenced (``Guard.snapshot_oom``: the guard's own call
        for this failure then dumps nothing), and the error without its frames, which would keep
        those tensors alive."""
        self.guard.snapshot_oom(self.trainer.global_step, peer=isinstance(exc, PeerOutOfMemoryError))
        return without_frames(exc)

    # ------------------------------------------------------------------ per batch, per fit
    def new_batch(self) -> None:
        """A ``training_step`` begins (guarded or not)."""

    def end_batch(self) -> None:
        """After the batch (``on_train_batch_end``)."""
        self._redone_loss = None

    def release(self) -> None:
        """The fit has ended: take off what the strategy put into the strategy's comms."""

    def training_step(self, batch, args, kwargs, k: int, batch_idx: int):
        """The guarded batch at k micro-batches (already kept in the window)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks
    def _grad_sync(self):
        """The context each micro-batch runs in (FSDP1: its gradient sync on)."""
        return contextlib.nullcontext()

    def _own_backward_sync(self):
        """The context of a backward memguard runs (DDP ``no_sync`` where the strategy has it)."""
        return no_sync(self.trainer.strategy)

    def _ranks_redo_together(self) -> bool:
        """With several ranks: whether they all redo the window together."""
        return False

    def _grad_owner(self):
        """What the window redo zeroes (every parameter of the run is under it)."""
        return self.pl_module

    def _ranges(self, sp, k: int):
        """A kept batch's micro-batch ranges at k."""
        return sp.ranges(k)

    def _chunk_begin(self) -> None:
        """A micro-batch begins (FSDP: between the sync points)."""

    def _chunk_abandoned(self) -> None:
        """An error other than out-of-memory left a micro-batch."""

    def _chunk_end(self, exc: Optional[BaseException]) -> Optional[BaseException]:
        """A micro-batch ended (``exc``: its out-of-memory error); the failure to redo the window
        for, or None."""
        return exc

    # ------------------------------------------------------------------ the window redo
    def can_redo(self) -> Optional[str]:
        """Why the accumulation window cannot be redone now (None: it can)."""
        trainer = self.trainer
        if self.guard.monitor is None or trainer is None or not trainer.training:
            return "not in a guarded training step"
        if self.guard.split_disabled_reason is not None:
            return "in-place micro-batching is off"
        if int(getattr(trainer, "world_size", 1) or 1) > 1 and not self._ranks_redo_together():
            return ("several processes without memguard's DDP gradient average: the other ranks are inside the "
                    "gradient all-reduce of this backward or would run a different number of backwards")
        if not self.fit.window_ok:
            return "the accumulation window's batches were not all seen in order"
        return None

    def _redo_window(self, failure: Optional[BaseException], k: int, *, through_current: bool,
                     phase: Optional[str] = None, log_current: bool = False) -> int:
        """After an out-of-memory error that left the window's gradients partly summed (``failure``;
        None: another rank's): zero them, free memory, raise k (``Guard.after_window_oom``, the new k
        agreed over the ranks) and run the window's kept batches again, all their micro-batches'
        forwards and backwards by memguard: the earlier batches, and the current one too when
        ``through_current``. After each attempt the ranks agree whether every one went through
        (``Guard.agree_redo``); if not, all redo again at a larger k. ``log_current``: the current
        batch's ``self.log`` values are recorded in the attempt that goes through and logged once;
        its weighted loss is kept in ``_redone_loss``. ``WindowOOMError`` at the floor or cap.
        Returns the k used."""
        fit = self.fit
        window = fit.window
        last = len(window) if through_current else len(window) - 1
        rows = max([batch_units(b) for b, _, _ in window] + [1])
        phase = phase or self._phase
        while True:
            self._grad_owner().zero_grad(set_to_none=True)
            k = self.guard.after_window_oom(failure, k, rows, self.trainer.global_step,
                                            redos=fit.window_redos, phase=phase)
            failure = recorder = None
            fit.window_redos += 1
            fit.rows_this_step = 0
            self._redone_loss = None
            try:
                for i, (batch, args, kwargs) in enumerate(window[:last]):
                    current = log_current and i == last - 1
                    recorder = LogRecorder(self.pl_module.log) if current else None
                    loss = self._run_whole(batch, args, kwargs, k, recorder)
                    if current:
                        self._redone_loss = loss
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                failure = self._caught_oom(exc)
                phase = self._phase
            if not self.guard.agree_redo(failure is not None):
                if recorder is not None:
                    with _compat.logging_as(self.pl_module, "training_step"):
                        recorder.flush()
                return k

    def _run_whole(self, batch, args, kwargs, k: int, recorder: Optional[LogRecorder] = None):
        """Forward and backward of every micro-batch of a kept window batch; its logs discarded
        (they were logged when it first ran), or kept in ``recorder``. Returns the batch's loss (the
        chunks' weighted sum, detached; None when the step returns no loss)."""
        fit = self.fit
        accum, optimizer = fit.accum(), fit.optimizer()
        try:
            sp = fit.splitter(batch) if k > 1 else None
        except ValueError:
            sp = None
        if sp is None:
            pieces = [(batch, 1.0, batch_units(batch))]
        else:
            pieces = (sp.chunk(u0, u1) for u0, u1 in self._ranges(sp, k))
        self.pl_module.log = recorder if recorder is not None else Discard()
        total = None
        try:
            for chunk, w, units in pieces:
                self._phase = "forward"
                self.guard.micro_batch_rows.append(units)
                exc = None
                self._chunk_begin()
                try:
                    with self._grad_sync():
                        loss = loss_of(self._step(chunk, args, kwargs, outside_step=True))
                        if loss is not None:
                            self._backward(loss * (w / accum), optimizer)
                    if loss is not None:
                        part = loss.detach() * w
                        total = part if total is None else total + part
                except Exception as e:
                    if not self.catches_chunk_oom or not is_oom_error(e):
                        self._chunk_abandoned()
                        raise
                    exc = self._caught_oom(e)
                loss = chunk = None
                failure = self._chunk_end(exc)
                if failure is not None:
                    if recorder is not None:
                        recorder.end_chunk(0.0, commit=False)   # its values may hold the failed graph
                    raise failure
                if recorder is not None:
                    recorder.end_chunk(w, commit=True)
                fit.rows_this_step += units
        finally:
            self.pl_module.__dict__.pop("log", None)
        return total

    # ------------------------------------------------------------------ a step, a backward
    def _step(self, batch, args, kwargs, *, outside_step: bool = False):
        """The user's ``training_step`` on ``batch`` (a micro-batch), through what was wrapped: the
        module's method, or under FSDP1 the strategy's (a root FSDP1 forward, in the precision
        plugin's ``train_step_context``), its forward patch undone if it fails before reaching the
        module (``_compat.forward_patch_undone_on_error``). ``outside_step``: the call may come from
        Lightning's backward (a window redo), outside the strategy's ``training_step``, so the
        module's method runs in ``train_step_context`` too (autocast under ``*-mixed``; nested in
        the strategy's own it changes nothing)."""
        fit = self.fit
        if fit.step_owner is not None and fit.step_owner is not self.pl_module:
            with _compat.forward_patch_undone_on_error(self.pl_module):
                return fit.orig_training_step(batch, *args, **kwargs)
        if outside_step:
            with self.trainer.strategy.precision_plugin.train_step_context():
                return fit.orig_training_step(batch, *args, **kwargs)
        return fit.orig_training_step(batch, *args, **kwargs)

    def _backward(self, loss, optimizer) -> None:
        """A backward memguard runs itself: through ``strategy.backward`` (the precision plugin's
        loss scaling, the backward hooks), in :meth:`_own_backward_sync`."""
        self._phase = "backward"
        self.fit.own_backward = True
        try:
            with self._own_backward_sync():
                self.trainer.strategy.backward(loss, optimizer)
        finally:
            self.fit.own_backward = False

    def backward(self, loss, *args, **kwargs):
        """``LightningModule.backward``: Lightning's own backward of the batch's (final micro-batch's)
        loss. An out-of-memory error there redoes the window's batches, this one included, at a
        larger k, all by memguard; Lightning then goes on with the gradients complete."""
        orig_backward = self.fit.orig_backward
        if self.can_redo() is not None:
            with self._grad_sync():   # FSDP1 without sync points: still reduce-scatter this micro-batch
                return orig_backward(loss, *args, **kwargs)
        self._phase = "backward"
        failure = None
        try:
            with self._grad_sync():
                return orig_backward(loss, *args, **kwargs)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            failure = self._caught_oom(exc)
        release_graph(loss)
        loss = None
        mon = self.guard.monitor
        self._redo_window(failure, mon.micro_batches if mon is not None else 1, through_current=True)
        return None
