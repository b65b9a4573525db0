"""The HF guarded step under FSDP2 and FSDP1 (``memguard_hf.step.GuardedStep`` runs it when the
model is sharded): every micro-batch between the OOM sync points of ``memguard_torch.sync``, k and
the chunks agreed by every rank, a failure re-cut or redone by all ranks alike (docs/hf_fsdp.md).
A mixin of :class:`memguard_hf.step.GuardedStep`, on the callback's instance.
"""

from __future__ import annotations

import contextlib
import logging

from memguard_core.microbatch import free_after_oom, without_frames as _without_frames
from memguard_torch import _compat as torch_compat
from memguard_torch.oom import is_oom_error
from memguard_torch.ranks import agreed_ranges, fsdp_after_abort
from memguard_torch.sync import Fsdp1SyncHooks, FsdpSyncHooks, OomSync, PeerOutOfMemoryError

from .rows import rows_of, units_of

__all__ = ["FsdpStep"]

logger = logging.getLogger("memguard.hf")


class FsdpStep:
    """The FSDP2 / FSDP1 step of :class:`memguard_hf.step.GuardedStep`: the sync points, the batch in
    agreed chunks, the window redone by every rank.

    Uses the callback's ``guard``, ``trainer``, ``_window``, ``_orig_training_step``, ``_loss_scale``,
    ``_rows_this_step``, ``oom_errors`` and the step's ``_splitter``, ``_pass_items``,
    ``_snapshot_oom``, ``_redo_window``.
    """

    _fsdp_sync = None
    _fsdp_hooks = None
    _fsdp_checked = False
    _fsdp_v1 = False

    def _fsdp_sync_for(self, model):
        """The run's ``OomSync`` when ``model`` is an FSDP2 (``fully_shard``) or FSDP1 model, else
        None. At the first call (the first training step, on every rank alike: the flag group is
        made collectively) the sync points go into FSDP's comms (``FsdpSyncHooks``; FSDP1:
        ``Fsdp1SyncHooks``, None where they cannot be placed: an OOM is then re-raised)."""
        if not self._fsdp_checked:
            self._fsdp_checked = True
            v2, v1 = torch_compat.fsdp_modules(model), torch_compat.fsdp1_modules(model)
            if v1 and not v2 and torch_compat.fsdp1_offloads_params(model):
                self.guard.split_disabled_reason = (
                    f"{torch_compat.FSDP1_OFFLOAD_NO_SPLIT}; apply memguard's plan instead (per_device_train_batch_size"
                    " / k, gradient_accumulation_steps x k: memguard_hf.plan_training_arguments)")
                logger.warning("memguard: in-place micro-batching disabled: %s", self.guard.split_disabled_reason)
            elif v2 or v1:
                from memguard_torch.distributed import flag_group
                from memguard_torch.specs import world_size

                self._fsdp_sync = OomSync(flag_group() if world_size() > 1 else None)
                if v2:
                    self._fsdp_hooks = FsdpSyncHooks(model, self._fsdp_sync)
                else:
                    self._fsdp_hooks = Fsdp1SyncHooks(model, self._fsdp_sync)
                    self._fsdp_v1 = True
                    if not self._fsdp_hooks.installed:
                        logger.warning("memguard: FSDP1 without OOM sync points (a hybrid sharding strategy or "
                                       "a communication hook of its own): an out-of-memory error is re-raised")
                        self._fsdp_hooks = self._fsdp_sync = None
        return self._fsdp_sync

    def _remove_fsdp_hooks(self) -> None:
        """Give FSDP its comms back (train end, or the run leaving train() on an error)."""
        if self._fsdp_hooks is not None:
            self._fsdp_hooks.remove()
            self._fsdp_hooks = None
        self._fsdp_sync = None
        self._fsdp_checked = self._fsdp_v1 = False

    def _fsdp_training_step(self, model, inputs, num_items_in_batch, k: int, pos, args, kwargs):
        """One ``training_step`` call under FSDP (2, or 1 with its sync points): the batch in ``k`` micro-batches (k and the
        number of chunks agreed by every rank), each reduce-scattering its gradients, each ending
        with every rank learning whether any failed (``OomSync.end``). A failure that added no
        gradient on any rank re-cuts the rows not yet processed; else, when ``pos`` (the call's
        position in the window) is known, every rank redoes the window's batches up to this one at
        a doubled k; otherwise every rank raises. Returns the batch's loss."""
        redo = False
        while True:
            loss = failure = None
            todo = self._window[:pos + 1] if redo else [inputs]
            for b in todo:
                loss, failure = self._fsdp_batch(model, b, num_items_in_batch, max(k, self.guard.monitor.micro_batches),
                                                 args, kwargs)
                if failure is not None:
                    break
            if failure is None:
                return loss
            loss = None
            if pos is None:
                raise failure
            self._rows_this_step = 0
            k = self._redo_window(model, failure, k, units_of(inputs),
                                  phase="backward" if self._fsdp_sync.grads_added else "forward")
            redo = True

    def _fsdp_batch(self, model, inputs, num_items_in_batch, k: int, args, kwargs):
        """One batch in ``k`` chunks under FSDP (see :meth:`_fsdp_training_step`); returns
        ``(loss, None)``, or ``(None, error)`` (this rank's, or a ``PeerOutOfMemoryError``) when the
        window must be redone."""
        try:
            sp = self._splitter(inputs)
        except ValueError:
            loss, top, _low, exc = self._fsdp_chunk(model, inputs, num_items_in_batch, 1.0, args, kwargs)
            return (loss, None) if top == 0 else (None, exc or PeerOutOfMemoryError("at the end of the micro-batch"))
        total = None
        start = 0
        while start < sp.units:
            ranges = agreed_ranges(sp, k, start, self._fsdp_sync.group)
            for u0, u1 in ranges:
                whole = u0 == 0 and u1 == sp.units
                chunk = None if whole else sp.chunk(u0, u1)
                loss, top, low, exc = self._fsdp_chunk(
                    model, inputs if whole else chunk.inputs, num_items_in_batch,
                    1.0 if whole else chunk.weight, args, kwargs)
                chunk = None
                if top == 0:
                    total = loss if total is None else total + loss
                    start = u1
                    continue
                loss = None
                fsdp_after_abort(model)
                units_left = sp.units - start
                exc = exc or PeerOutOfMemoryError("at the end of the micro-batch")
                if low >= 1 and top == 1 and k < units_left:
                    # no rank added a gradient in this chunk: every rank re-cuts the same rows
                    k = self.guard.agreed(self.guard.after_oom(exc, k, units_left, self.trainer.state.global_step,
                                                               free=free_after_oom))
                    break
                return None, exc
        return total, None

    def _fsdp_chunk(self, model, inputs, num_items_in_batch, weight, args, kwargs):
        """One micro-batch's forward and backward through the Trainer's ``training_step`` between
        the sync points; returns ``(loss, max_flag, min_flag, error)`` over the ranks (flags: 0 done,
        1 stopped before any reduce-scatter, 2 after; ``error`` this rank's OOM, without frames).
        The Trainer's ``no_sync`` (``set_requires_gradient_sync(False)`` for a window's earlier
        batches) is overridden: every chunk reduce-scatters (docs/hf_fsdp.md). Errors other than
        out-of-memory propagate."""
        sync, rows = self._fsdp_sync, rows_of(inputs)
        self.guard.micro_batch_rows.append(rows)
        self._loss_scale = weight
        self._oom_in_forward = False
        sync.grads_added = False
        exc = loss = None
        self._fsdp_hooks.new_chunk()
        num_items_in_batch = self._pass_items(num_items_in_batch, weight)
        if self._fsdp_v1:
            ctx = torch_compat.fsdp1_sync_on(model)   # every chunk reduce-scatters, also inside no_sync
        else:
            ctx = contextlib.nullcontext()
            model.set_requires_gradient_sync(True)
        sync.inside = sync.group is not None
        try:
            with ctx:
                loss = self._orig_training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        except Exception as e:
            if not is_oom_error(e):
                raise
            self._snapshot_oom(e)
            exc = _without_frames(e)
            self.oom_errors.append(f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            sync.inside = False
            self._loss_scale = 1.0
            self._items_used = self._items_count = None
        top, low = sync.end(0 if exc is None else (2 if sync.grads_added else 1))
        if top == 0:
            self._rows_this_step += rows
        return loss, top, low, exc
