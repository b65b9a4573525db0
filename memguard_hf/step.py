"""The guarded training step of the HF adapter: each batch cut into micro-batches inside
``Trainer.training_step``, the forward OOM retry and the accumulation-window redo
(docs/lifecycle.md, "Redoing the accumulation window"); under FSDP2 and FSDP1 every micro-batch runs between
the OOM sync points of ``memguard_torch.sync`` (docs/hf_fsdp.md). A mixin of
:class:`memguard_hf.callback.MemGuardCallback`, which binds these methods onto the trainer's instance;
kept apart so the callback holds only the hooks.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from memguard_core.microbatch import free_after_oom
from memguard_torch import train_reading as tt
from memguard_core.microbatch import without_frames as _without_frames
from memguard_torch.optim_state import prepare_optimizer
from memguard_torch import _compat as torch_compat
from memguard_torch import microbatch as torch_microbatch
from memguard_torch.ranks import agreed_ranges, fsdp_after_abort
from memguard_torch.oom import is_oom_error
from memguard_torch.sync import Fsdp1SyncHooks, FsdpSyncHooks, OomSync, PeerOutOfMemoryError

from . import _compat
from .loss_weights import watch_items

__all__ = ["GuardedStep", "is_oom_error"]

logger = logging.getLogger("memguard.hf")


class GuardedStep:
    """The micro-batch split, the OOM retry and the window redo of one HF ``Trainer`` step.

    Uses the callback's ``guard``, ``trainer``, ``_orig_training_step``, ``_orig_compute_loss``,
    ``_loss_scale``, ``_rows_this_step`` and ``_oom_in_forward``.
    """

    # ------------------------------------------------------------------ the guarded step
    def _weighted_compute_loss(self, model, inputs, *args, **kwargs):
        try:
            out = self._orig_compute_loss(model, inputs, *args, **kwargs)
        except BaseException:
            self._oom_in_forward = True  # the error passed through the forward (compute_loss)
            raise
        scale = self._loss_scale
        if scale == 1.0:
            return out
        # the micro-batch's share, unless the loss computed with the whole batch's count
        # (memguard_hf.loss_weights: observed, not guessed from the forward's signature)
        scale = self._loss_rules.weight(scale, self._items_used, self._items_count, inputs)
        if scale == 1.0:
            return out
        if isinstance(out, tuple):
            return (out[0] * scale,) + tuple(out[1:])
        return out * scale

    _items_used = None
    _items_count = None

    def _splitter(self, inputs):
        """The batch's ``BatchSplitter`` with the run's loss rules (the share a micro-batch's mean is
        weighted by, shifted labels, TRL's paired rows). Raises ``ValueError`` for a batch it cannot cut."""
        rules = self._loss_rules
        return torch_microbatch.BatchSplitter(inputs, weighting=rules.weighting(inputs), shift_labels=rules.shift(inputs),
                                        paired=rules.paired)

    def _pass_items(self, num_items_in_batch, weight: float):
        """The count to hand this micro-batch's ``training_step``: watched (``loss_weights.watch_items``)
        when the micro-batch is part of a split, so its ``compute_loss`` can tell which weight applies."""
        self._items_count = num_items_in_batch
        if weight == 1.0 or _compat.compiled(self.trainer):
            # a compiled model would trace the probe (a tensor subclass): the Trainer's rule instead
            self._items_used = None
            return num_items_in_batch
        passed, self._items_used = watch_items(num_items_in_batch)
        return passed

    def _guarded_training_step(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        try:
            return self._guarded_training_step_inner(model, inputs, num_items_in_batch, *args, **kwargs)
        except BaseException:
            # the run is leaving train() without on_train_end: stop the monitor thread with it
            self.guard.stop()
            self._remove_fsdp_hooks()
            raise

    def _guarded_training_step_inner(self, model, inputs, num_items_in_batch=None, *args, **kwargs):
        if self.guard.monitor is None or self.guard.split_disabled_reason is not None:
            return self._orig_training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        if not self._states_ready:
            self._states_ready = True
            self._prepare_optimizer()
        pos = self._window_pos
        self._window_pos += 1
        window = self._window
        # the Trainer passes the window's batches in order; a subclass that calls training_step
        # another way gets the forward-only retry (a backward OOM is then re-raised)
        in_window = window is not None and pos < len(window) and window[pos] is inputs
        k = self.guard.micro_batches_for_step(self.trainer.state.global_step)
        if self._fsdp_sync_for(model) is not None:
            return self._fsdp_training_step(model, inputs, num_items_in_batch, k, pos if in_window else None,
                                            args, kwargs)
        if self.guard.split_disabled_reason is not None:   # found at the first step (FSDP1 offload)
            return self._orig_training_step(model, inputs, num_items_in_batch, *args, **kwargs)
        # under DDP every micro-batch runs under no_sync and the gradients are averaged once every
        # rank's window went through: an OOM in the last backward cannot leave the others waiting
        # in DDP's all-reduce (docs/lifecycle.md, "Ranks agree")
        self._manual_ddp = self._ddp_for_manual_reduce(model) if in_window else None
        redo = False
        while True:
            failure = None
            loss = None
            try:
                if redo:
                    self._rows_this_step = 0
                    for earlier in window[:pos]:
                        self._step_batch(model, earlier, num_items_in_batch, k, False, args, kwargs)
                loss = self._step_batch(model, inputs, num_items_in_batch, k, True, args, kwargs)
            except Exception as exc:
                if not (is_oom_error(exc) and in_window) or self._under_fsdp(model):
                    raise
                self._snapshot_oom(exc)
                failure = _without_frames(exc)
            if not self.guard.agree_redo(failure is not None):
                if self._manual_ddp is not None and pos == len(window) - 1:
                    tt.average_ddp_gradients(self._manual_ddp)
                return loss
            loss = None
            if self._manual_ddp is not None:
                tt.ddp_after_abort(self._manual_ddp)
            k = self._redo_window(model, failure, k, self._units_of(inputs))
            redo = True

    # ------------------------------------------------------------------ FSDP2 and FSDP1
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
                from memguard_torch.preflight import world_size

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

    def _snapshot_oom(self, exc: BaseException) -> None:
        """The guard's OOM snapshot (with ``cuda_snapshots`` on) while the failed micro-batch's
        tensors are still referenced, before anything is freed (``Guard.snapshot_oom``)."""
        self.guard.snapshot_oom(self.trainer.state.global_step, peer=isinstance(exc, PeerOutOfMemoryError))

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
                loss, failure = self._fsdp_batch(model, b, num_items_in_batch, max(k, self.guard.monitor.split),
                                                 args, kwargs)
                if failure is not None:
                    break
            if failure is None:
                return loss
            loss = None
            if pos is None:
                raise failure
            self._rows_this_step = 0
            k = self._redo_window(model, failure, k, self._units_of(inputs),
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
        sync, rows = self._fsdp_sync, self._rows_of(inputs)
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

    _manual_ddp = None

    def _ddp_for_manual_reduce(self, model):
        """The DDP module when the run is data-parallel over several ranks (not FSDP / DeepSpeed,
        which shard or own the reduction), else None."""
        kind = self._distributed_type()
        if "FSDP" in kind or "DEEPSPEED" in kind or getattr(self.trainer.args, "world_size", 1) <= 1:
            return None
        return tt.find_ddp(model)

    def _prepare_optimizer(self) -> None:
        """Before the first forward: allocate the optimizer's lazy states and make an OOM inside its
        step name itself (``memguard_torch.optim_state.prepare_optimizer``). Never raises."""
        opt = getattr(self.trainer, "optimizer", None)
        if opt is not None:
            prepare_optimizer(opt, self.guard, lambda: self.trainer.args.per_device_train_batch_size, is_oom_error)

    def _redo_window(self, model, failure, k: int, rows: int, phase=None) -> int:
        """Zero the window's partly summed gradients, free memory and return the k to redo the
        window with (``Guard.after_window_oom``); ``phase`` None: told from where the error came."""
        if phase is None:
            phase = "forward" if failure is not None and self._oom_in_forward else "backward"
        model.zero_grad(set_to_none=True)
        trainer_model = getattr(self.trainer, "model", None)
        if trainer_model is not None and trainer_model is not model:
            trainer_model.zero_grad(set_to_none=True)
        self._window_redos += 1
        return self.guard.after_window_oom(failure, k, rows, self.trainer.state.global_step,
                                           redos=self._window_redos - 1, phase=phase)

    def _step_batch(self, model, inputs, num_items_in_batch, k: int, final: bool, args, kwargs):
        """Forward and backward of one of the window's batches in ``k`` micro-batches; ``final``:
        the batch the Trainer is calling training_step for (its last micro-batch runs in the
        Trainer's own sync context), else an earlier batch redone (all of it under ``no_sync``).
        An OOM in a forward redoes the rows not yet processed at a doubled k (``Guard.after_oom``);
        any other error, an OOM in a backward included, propagates."""
        k = max(k, self.guard.monitor.split)   # a forward OOM in an earlier batch may have raised it
        if k <= 1:
            failure = None
            try:
                return self._run_chunk(model, inputs, num_items_in_batch, 1.0, final, args, kwargs)
            except Exception as exc:
                if not (is_oom_error(exc) and self._oom_in_forward):
                    raise
                self._snapshot_oom(exc)
                failure = _without_frames(exc)
            # freed outside the except block: its traceback's frames hold the failed forward's activations
            k = self._after_oom(failure, 1, torch_microbatch.batch_rows(inputs))
        try:
            splitter = self._splitter(inputs)
        except ValueError:
            return self._run_chunk(model, inputs, num_items_in_batch, 1.0, final, args, kwargs)
        total_loss = None
        start = 0
        while start < splitter.units:
            ranges = splitter.ranges(k, start)
            failure = None
            try:
                for u0, u1 in ranges:
                    chunk = splitter.chunk(u0, u1)
                    loss = self._run_chunk(model, chunk.inputs, num_items_in_batch, chunk.weight,
                                           final and u1 == splitter.units, args, kwargs)
                    total_loss = loss if total_loss is None else total_loss + loss
                    start = u1
                    chunk = loss = None
            except Exception as exc:
                if not (is_oom_error(exc) and self._oom_in_forward):
                    raise
                self._snapshot_oom(exc)
                failure = _without_frames(exc)
            if failure is not None:
                chunk = loss = None
                # units before `start` already added their weighted gradient: re-cut only the rest
                k = self._after_oom(failure, k, splitter.units - start)
        return total_loss

    def _after_oom(self, exc: BaseException, k: int, units_left: int) -> int:
        """Free memory after a forward OOM and return the doubled split; re-raise if none helps."""
        if self._under_fsdp():
            # every FSDP forward all-gathers parameters: a retry on one rank alone would hang the others
            logger.error("memguard: out of memory under FSDP; an in-place retry on one rank would "
                         "desynchronise the all-gathers, so it is re-raised (%s)", exc)
            raise exc
        if self._manual_ddp is not None:
            tt.ddp_after_abort(self._manual_ddp)   # the retried forward must not broadcast alone
        return self.guard.after_oom(exc, k, units_left, self.trainer.state.global_step)

    def _run_chunk(self, model, inputs, num_items_in_batch, weight, last, args, kwargs):
        """One micro-batch's forward and backward; ``last`` False runs it under ``no_sync`` (DDP).
        Under FSDP1 every chunk reduce-scatters (``memguard_torch._compat.fsdp1_sync_on``)."""
        rows = self._rows_of(inputs)
        self.guard.micro_batch_rows.append(rows)
        self._loss_scale = weight
        self._oom_in_forward = False
        ctx = contextlib.nullcontext()
        if self._under_fsdp(model):
            # FSDP1 (FSDP2 runs _fsdp_training_step): every chunk reduce-scatters, also inside the
            # Trainer's no_sync of a window's earlier batches, which would keep unsharded gradients
            ctx = torch_compat.fsdp1_sync_on(model)
        elif not last or self._manual_ddp is not None:
            ctx = self._no_sync(model)
        num_items_in_batch = self._pass_items(num_items_in_batch, weight)
        try:
            with ctx:
                loss = self._orig_training_step(model, inputs, num_items_in_batch, *args, **kwargs)
            self._rows_this_step += rows
            return loss
        finally:
            self._loss_scale = 1.0
            self._items_used = self._items_count = None

    _fsdp_seen = False
    _fsdp_looked_at = None

    def _under_fsdp(self, model=None) -> bool:
        """The run is sharded by FSDP (1 or 2): accelerate's distributed type says so, or ``model``
        holds FSDP1 ``FullyShardedDataParallel`` or FSDP2 modules (looked for once per model: the
        walk over its modules would cost every micro-batch otherwise)."""
        if model is not None and self._fsdp_looked_at != id(model):
            self._fsdp_looked_at = id(model)
            self._fsdp_seen = bool(torch_compat.fsdp1_modules(model) or torch_compat.fsdp_modules(model))
        return self._fsdp_seen or "FSDP" in self._distributed_type()

    def _no_sync(self, model):
        accel = getattr(self.trainer, "accelerator", None)
        if accel is None or self._under_fsdp(model):
            return contextlib.nullcontext()  # no_sync keeps unsharded grads under FSDP
        return accel.no_sync(model)

    @staticmethod
    def _units_of(inputs) -> int:
        """Units a batch can be cut into: rows, or packed sequences (1 when it cannot be cut)."""
        try:
            seqs = torch_microbatch.sequence_starts(inputs)
            return len(seqs) if seqs is not None else torch_microbatch.batch_rows(inputs)
        except Exception:
            return 1

    @staticmethod
    def _rows_of(inputs) -> int:
        """Rows of a forward (packed: sequences). A packed batch on an accelerator is counted on
        the device (a 0-dim tensor, resolved at ``on_step_end``): ``sequence_starts`` would copy
        its ``position_ids`` to the host and synchronise the device at every micro-batch."""
        try:
            rows = torch_microbatch.batch_rows(inputs)
        except ValueError:
            return 0
        pos = inputs.get("position_ids")
        if rows == 1 and torch.is_tensor(pos) and pos.dim() == 2 and pos.device.type != "cpu":
            p = pos[0]
            return ((p == 0).sum() + (p[0] != 0).long()).clamp(min=1)
        seqs = torch_microbatch.sequence_starts(inputs)
        return rows if seqs is None else len(seqs)


