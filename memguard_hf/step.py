"""The guarded training step of the HF adapter: each batch cut into micro-batches inside
``Trainer.training_step``, the forward OOM retry and the accumulation-window redo
(docs/lifecycle.md, "Redoing the accumulation window"); under FSDP2 and FSDP1 every micro-batch runs between
the OOM sync points of ``memguard_torch.sync`` (``memguard_hf.step_fsdp``, docs/hf_fsdp.md). A mixin of
:class:`memguard_hf.callback.MemGuardCallback`, which binds these methods onto the trainer's instance;
kept apart so the callback holds only the hooks.
"""

from __future__ import annotations

import contextlib
import logging

from memguard_core.microbatch import without_frames as _without_frames
from memguard_torch import _compat as torch_compat
from memguard_torch import microbatch as torch_microbatch
from memguard_torch import train_reading as tt
from memguard_torch.oom import is_oom_error
from memguard_torch.optim_state import prepare_optimizer
from memguard_torch.sync import PeerOutOfMemoryError

from . import _compat
from .loss_weights import watch_items
from .rows import rows_of, units_of
from .step_fsdp import FsdpStep

__all__ = ["GuardedStep", "is_oom_error"]

logger = logging.getLogger("memguard.hf")


class GuardedStep(FsdpStep):
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
            k = self._redo_window(model, failure, k, units_of(inputs))
            redo = True

    def _snapshot_oom(self, exc: BaseException) -> None:
        """The guard's OOM snapshot (with ``cuda_snapshots`` on) while the failed micro-batch's
        tensors are still referenced, before anything is freed (``Guard.snapshot_oom``)."""
        self.guard.snapshot_oom(self.trainer.state.global_step, peer=isinstance(exc, PeerOutOfMemoryError))

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
        k = max(k, self.guard.monitor.micro_batches)   # a forward OOM in an earlier batch may have raised it
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
        rows = rows_of(inputs)
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
