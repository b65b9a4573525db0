"""The guarded evaluation step of the HF adapter: each batch of ``Trainer.evaluate`` / ``predict``
cut into micro-batches inside ``Trainer.prediction_step``, and an out-of-memory error there redone
at a doubled split, so an evaluation OOM never ends a healthy training run (docs/evaluation.md).

A mixin of :class:`memguard_hf.callback.MemGuardCallback`, which binds
``_guarded_prediction_step`` onto the trainer's instance; kept apart so the callback holds only the
hooks. The evaluation split has its own state (:attr:`GuardedEval.eval_micro_batches`): it never
changes the training micro-batches, and the training split never changes it.

Why evaluation starts unsplit (``eval_micro_batches = 1``) rather than at the training split: an
evaluation forward runs under ``torch.no_grad``, so it keeps no activations for a backward, no
gradients and no optimizer temporaries; per row it needs a fraction of a training micro-batch, and
cutting it by the training k would slow every evaluation for nothing. Its failure is also cheap to
recover from: nothing was accumulated, so the batch is simply run again in smaller pieces.

Under DDP (world size > 1) each rank splits and retries on its own, without agreeing with the
others: the evaluation forward runs on the bare model (no collective in it), the one collective
``prediction_step`` makes (the token count's gather) is made once per batch whatever the split, and
``evaluation_loop``'s gathers run after ``prediction_step`` on outputs shaped as unsplit
(docs/evaluation.md, "Under DDP"). Where a forward does run collectives (FSDP, DeepSpeed, tensor
parallelism, a DDP-wrapped module) the split is off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, List, Optional

import torch

from memguard_torch import train_reading as tt
from memguard_core.errors import ConfigError
from memguard_core.microbatch import free_after_oom, without_frames as _without_frames
from memguard_torch.oom import is_oom_error

from . import _compat
from .loss_weights import watch_items
from .rows import units_of

__all__ = ["GuardedEval", "concat_outputs"]

logger = logging.getLogger("memguard.hf")

#: Where HF pads predictions and labels of unequal length (``EvalLoopContainer(padding_index=-100)``,
#: ``accelerator.pad_across_processes(..., pad_index=-100)`` in ``Trainer.evaluation_loop``).
PAD_INDEX = -100


class _Uncombinable(TypeError):
    """A chunk's output that cannot be put back together into the batch's (a cache object, a
    string): the batch is then evaluated unsplit."""


def _cat_tensors(pieces: List[torch.Tensor], axis: int, weights: List[float]) -> torch.Tensor:
    if pieces[0].dim() == 0:
        # a scalar per chunk (an auxiliary loss in the outputs): the chunks' weighted mean, the
        # batch's value for a mean over rows or tokens
        if not pieces[0].is_floating_point():
            raise _Uncombinable("integer scalar output")
        return sum(w * p for w, p in zip(weights, pieces))
    if pieces[0].dim() <= axis:
        raise _Uncombinable(f"output of {pieces[0].dim()} dims, cut along dim {axis}")
    dims = pieces[0].dim()
    if any(p.dim() != dims for p in pieces):
        raise _Uncombinable("outputs of different ranks")
    # chunks of one padded batch share its sequence length, so their outputs have equal shapes
    # beyond the cut axis; generated tokens need not (generation stops per chunk): pad those as
    # evaluation_loop pads batches of unequal length
    shape = [max(p.shape[d] for p in pieces) for d in range(dims)]
    padded = []
    for p in pieces:
        pad = []
        for d in reversed(range(dims)):
            pad += [0, 0 if d == axis else shape[d] - p.shape[d]]
        if any(pad):
            p = torch.nn.functional.pad(p, pad, value=PAD_INDEX)
        padded.append(p)
    return torch.cat(padded, dim=axis)


def concat_outputs(pieces: List[Any], axis: int = 0, weights: Optional[List[float]] = None) -> Any:
    """Put the chunks' ``logits`` / ``labels`` (as ``Trainer.prediction_step`` returns them: a
    tensor, or tuples / lists / dicts of them, or None) back into the batch's.

    Args:
        pieces: one output per chunk, in batch order, all of the same structure.
        axis: the axis the batch was cut along: 0 (rows), 1 (a packed ``(1, T, ...)`` batch cut at
            sequence boundaries).
        weights: the chunks' loss weights (summing to 1), for scalar outputs (their weighted mean).

    Tensors are concatenated along ``axis``; where their other dimensions differ (generated
    tokens) the shorter are right-padded with ``-100``, as ``Trainer.evaluation_loop`` pads
    batches.

    Raises:
        TypeError: a piece that cannot be combined (not a tensor, tuple, list, dict or None).
    """
    weights = weights if weights is not None else [1.0 / len(pieces)] * len(pieces)
    first = pieces[0]
    if first is None:
        if any(p is not None for p in pieces):
            raise _Uncombinable("None in some chunks only")
        return None
    if torch.is_tensor(first):
        if not all(torch.is_tensor(p) for p in pieces):
            raise _Uncombinable("tensor in some chunks only")
        return _cat_tensors(pieces, axis, weights)
    if isinstance(first, (tuple, list)):
        if any(not isinstance(p, type(first)) or len(p) != len(first) for p in pieces):
            raise _Uncombinable("sequences of different lengths")
        items = [concat_outputs([p[i] for p in pieces], axis, weights) for i in range(len(first))]
        return type(first)(items) if not hasattr(first, "_fields") else type(first)(*items)
    if isinstance(first, dict):
        if any(not isinstance(p, dict) or p.keys() != first.keys() for p in pieces):
            raise _Uncombinable("dicts with different keys")
        out = type(first)() if type(first) is not dict else {}
        for key in first:
            out[key] = concat_outputs([p[key] for p in pieces], axis, weights)
        return out
    raise _Uncombinable(f"cannot combine outputs of type {type(first).__name__}")


def _watched(count: Any, used: list) -> Any:
    """``count`` as :func:`memguard_hf.loss_weights.watch_items` hands it out, its flag kept in ``used``."""
    passed, flag = watch_items(count)
    if flag is not None:
        used.append(flag)
    return passed


def _has_fsdp(model) -> bool:
    """Whether ``model`` is or holds an FSDP module (``FullyShardedDataParallel`` or FSDP2's
    ``fully_shard``)."""
    kinds = []
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        kinds.append(FullyShardedDataParallel)
    except Exception:  # pragma: no cover - torch without FSDP
        pass
    try:
        from torch.distributed.fsdp import FSDPModule
        kinds.append(FSDPModule)
    except Exception:  # pragma: no cover - torch before FSDP2
        pass
    if not kinds or not hasattr(model, "modules"):
        return False
    kinds = tuple(kinds)
    return any(isinstance(m, kinds) for m in model.modules())


class GuardedEval:
    """The evaluation split and its OOM retry, for one HF ``Trainer``.

    Uses the callback's ``guard``, ``trainer``, ``options`` and ``_orig_prediction_step``.

    Attributes:
        eval_micro_batches: micro-batches each evaluation batch is cut into (>= 1; the option
            ``eval_micro_batches``, default 1). It doubles after an out-of-memory error in an
            evaluation and stays there for later evaluations of the run; settable before
            ``evaluate()`` / ``predict()``.
        eval_oom_retries: out-of-memory errors in evaluation recovered by a re-split.
        eval_micro_batch_rows: rows (packed batches: sequences) of every evaluation forward that ran.
        split_evaluation: False runs every evaluation batch as it comes, unguarded (for a
            ``compute_loss`` / ``prediction_step`` that couples the rows of a batch); default True.
    """

    _eval_k = 1
    eval_oom_retries = 0
    _eval_off_reason: Optional[str] = None
    split_evaluation = True

    @property
    def eval_micro_batches(self) -> int:
        return self._eval_k

    @eval_micro_batches.setter
    def eval_micro_batches(self, k: Any) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError("eval_micro_batches", "an int >= 1", k)
        self._eval_k = k

    def _init_eval(self) -> None:
        self._eval_k = self.options.eval_micro_batches
        self.eval_oom_retries = 0
        self.eval_micro_batch_rows: List[int] = []
        self._orig_prediction_step = None
        self._eval_off_reason = None

    def _bind_eval(self, trainer) -> None:
        """Wrap ``trainer.prediction_step`` on the instance (Seq2SeqTrainer's generation included)."""
        self._orig_prediction_step = trainer.prediction_step
        trainer.prediction_step = self._guarded_prediction_step

    # ------------------------------------------------------------------ the guarded step
    def _guarded_prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **kwargs):
        """``Trainer.prediction_step`` in ``eval_micro_batches`` chunks; on an out-of-memory error the
        split doubles and the batch is redone from its start (nothing was accumulated). Returns
        what ``prediction_step`` returns: ``(loss, logits, labels)``.

        Raises:
            the original out-of-memory error, with a note, when one row per chunk already failed;
            every other error unchanged.
        """
        orig = self._orig_prediction_step
        why_not = self._why_not_split(model, inputs, kwargs)
        if why_not is not None:
            return orig(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        units = units_of(inputs)
        # the batch's token count taken once, for every chunk and retry (under DDP its gather then
        # runs once per batch, as unsplit: a retry on one rank makes no collective the others miss)
        with _compat.count_items_once(self.trainer, inputs) as counted:
            return self._predict_with_retry(model, inputs, prediction_loss_only, ignore_keys, kwargs, units,
                                            counted)

    def _predict_with_retry(self, model, inputs, prediction_loss_only, ignore_keys, kwargs, units: int,
                            counted: Optional[dict]):
        while True:
            k = min(self._eval_k, units)
            failure = None
            try:
                return self._predict_in_chunks(model, inputs, prediction_loss_only, ignore_keys, k, kwargs,
                                               counted)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                if k >= units or self._eval_off_reason is not None:
                    why = (f"the evaluation split is off ({self._eval_off_reason})" if k < units
                           else "no further split can help")
                    msg = (f"memguard: out of memory in an evaluation forward at {k} micro-batch(es) for a batch "
                           f"of {units} rows; {why}: shorten the evaluation sequences, evaluate with "
                           "prediction_loss_only=True (no logits kept), or give the run more memory")
                    logger.error("%s (%s)", msg, exc)
                    exc.add_note(msg)
                    raise
                failure = _without_frames(exc)
            self._eval_after_oom(failure, k, units)
            failure = None

    def _why_not_split(self, model, inputs, kwargs=None) -> Optional[str]:
        """Why this batch is evaluated as it comes (None: it can be cut)."""
        t = self.trainer
        if not self.split_evaluation:
            return "split_evaluation is False"
        if self._eval_off_reason is not None:
            return self._eval_off_reason
        args = getattr(t, "args", None)
        if int(getattr(args, "world_size", 1) or 1) > 1:
            why = self._distributed_off_reason(model, kwargs or {})
            if why is not None:
                self._eval_off_reason = why
                logger.info("memguard: evaluation not split: %s", why)
                return why
        if not isinstance(inputs, Mapping):
            return "batch is not a dict"
        label_names = list(getattr(t, "label_names", None) or [])
        if not label_names:
            return_loss = inputs.get("return_loss")
            if return_loss is None:
                return_loss = getattr(t, "can_return_loss", False)
            if return_loss:
                # a loss without labels (CLIP-like): an in-batch contrastive loss, which a cut changes
                return "loss without labels (in-batch)"
        return None

    _forward_checked = (None, None)   # (id of the model last checked, why its forward is off or None)

    def _distributed_off_reason(self, model, kwargs) -> Optional[str]:
        """Under torch.distributed: why a chunk's forward could make a collective the other ranks do
        not make (a split or a retry on one rank would then hang them), None when it makes none:
        data parallelism over the bare model, which is what ``Trainer.evaluation_loop`` hands to
        ``prediction_step`` under DDP (``_wrap_model(training=False)`` does not wrap, accelerate's
        ``prepare_model(evaluation_mode=True)`` adds no DDP)."""
        t = self.trainer
        kind = str(getattr(getattr(t, "accelerator", None), "distributed_type", ""))
        if "FSDP" in kind or getattr(t, "is_fsdp_enabled", False):
            return "FSDP forwards all-gather parameters on every rank (world size > 1)"
        if "DEEPSPEED" in kind or getattr(t, "is_deepspeed_enabled", False):
            return "DeepSpeed ZeRO-3 forwards all-gather parameters on every rank (world size > 1)"
        if "MULTI_" not in kind:
            return f"distributed type {kind.rsplit('.', 1)[-1] or 'unknown'} is not data parallel (world size > 1)"
        for size in ("get_tp_size", "get_cp_size", "get_sp_size"):
            try:
                n = int(getattr(t, size)())
            except Exception:
                n = 1
            if n > 1:
                return f"{size[4:6]} size {n}: the forward's collectives span ranks (world size > 1)"
        if not _compat.counts_items(t):
            return ("this transformers has no Trainer._get_num_items_in_batch, whose per-batch gather the "
                    "split must keep to one call (world size > 1)")
        gen = {**_compat.generation_kwargs(t), **kwargs}
        if gen.get("synced_gpus"):
            return "generation with synced_gpus all-reduces at every generated token (world size > 1)"
        checked_id, why = self._forward_checked
        if checked_id != id(model):
            why = None
            if tt.find_ddp(model) is not None:
                why = "prediction_step got a DistributedDataParallel module, whose forward broadcasts buffers"
            elif _has_fsdp(model):
                why = "prediction_step got an FSDP module, whose forward all-gathers parameters"
            self._forward_checked = (id(model), why)
        return why

    def _predict_in_chunks(self, model, inputs, prediction_loss_only, ignore_keys, k: int, kwargs,
                           counted: Optional[dict] = None):
        orig = self._orig_prediction_step
        splitter = None
        if k > 1:
            try:
                splitter = self._splitter(inputs)
            except ValueError:
                splitter = None
        ranges = splitter.ranges(k) if splitter is not None else []
        if len(ranges) <= 1:
            self.eval_micro_batch_rows.append(units_of(inputs))
            return orig(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
        losses, logits, labels, weights, loss_weights = [], [], [], [], []
        for u0, u1 in ranges:
            chunk = splitter.chunk(u0, u1)
            self.eval_micro_batch_rows.append(u1 - u0)
            used = []
            if counted is not None:
                # whether this chunk's loss computed with the batch's count (then it adds up as is)
                counted["wrap"] = lambda n, used=used: _watched(n, used)
            with torch.no_grad():
                loss, lg, lb = orig(model, chunk.inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)
            losses.append(loss)
            logits.append(lg)
            labels.append(lb)
            weights.append(chunk.weight)
            count = counted.get("n") if counted else None
            loss_weights.append(self._loss_rules.weight(chunk.weight, used[0] if used else None, count,
                                                        chunk.inputs))
            chunk = loss = lg = lb = None
        if counted is not None:
            counted.pop("wrap", None)
        axis = 1 if splitter.packed else 0
        try:
            if any(x is None for x in losses):
                loss = concat_outputs(losses, axis, weights)  # all None, or raises
            else:
                # a chunk whose loss computed with the batch's count (its label sum over the batch's
                # token count) adds up as is; a chunk's mean loss is weighted by its share of the
                # batch's valid labels or rows: the batch's loss, as in the training split
                loss = sum(w * x for w, x in zip(loss_weights, losses))
            return loss, concat_outputs(logits, axis, weights), concat_outputs(labels, axis, weights)
        except _Uncombinable as exc:
            self._eval_off_reason = f"prediction_step's outputs cannot be put back together ({exc})"
            logger.warning("memguard: evaluation no longer split: %s", self._eval_off_reason)
            losses = logits = labels = None
            return orig(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs)

    def _eval_after_oom(self, exc: BaseException, k: int, units: int) -> None:
        """Free what the failed chunk left and double the evaluation split (at most ``units``);
        records an ``eval_split`` decision. The training split is left alone."""
        state = getattr(self.trainer, "state", None)
        step = getattr(state, "global_step", None)
        self.guard.snapshot_oom(step)          # before the free, with cuda_snapshots on
        self.guard.oom_handled()
        new_k = min(max(2, 2 * k), units)
        self._eval_k = max(self._eval_k, new_k)
        self.eval_oom_retries += 1
        free_after_oom()
        msg = (f"out of memory in an evaluation forward ({type(exc).__name__}); redoing the batch of {units} "
               f"rows in {self._eval_k} micro-batches (training micro-batches unchanged)")
        try:
            self.guard.recorder.decision("eval_split", msg, step, micro_batches=self._eval_k, phase="evaluation")
        except Exception:
            logger.warning("memguard: %s", msg)
