"""How one batch runs as k micro-batches inside Lightning's automatic optimization: the
Lightning adapter's ``training_step`` / ``optimizer_zero_grad`` wrappers (installed by
``memguard_lightning.callback.MemGuardCallback``), the per-chunk backward and the chunk-weighted
``self.log`` values. The guard's decisions (k, OOM re-split) come from ``memguard_core.guard.Guard``.

Design: the k-chunk step inside automatic optimization
------------------------------------------------------
Lightning 2.x (``loops/optimization/automatic.py``, ``Closure.closure``) runs, for each batch::

    out = training_step(batch, batch_idx)            # _training_step; loss = out / accumulate_grad_batches
    if batch_idx % accumulate_grad_batches == 0:     # _make_zero_grad_fn: first batch of a window
        on_before_zero_grad(); optimizer_zero_grad(epoch, batch_idx, optimizer)
    strategy.backward(loss, optimizer)               # DDP all-reduce here unless accumulating

so ``zero_grad`` runs *after* ``training_step`` and *before* the backward. memguard wraps
``training_step`` on the module instance (``functools.wraps``, so Lightning's signature checks see
the original). For k > 1 the wrapper, for each non-final chunk i, runs the user's
``training_step(chunk_i, batch_idx)`` and immediately ``trainer.strategy.backward(loss_i * w_i / A,
optimizer)`` (A = ``accumulate_grad_batches``; ``strategy.backward`` applies the precision plugin:
AMP ``GradScaler`` scaling, as ``manual_backward`` does) inside ``strategy.block_backward_sync()``
(DDP ``no_sync``: no all-reduce), so each chunk's activations are freed before the next chunk runs.
The final chunk's forward is returned as ``w_k * loss_k + sum_{i<k} (w_i * loss_i).detach()``:
Lightning divides it by A and back-propagates it (with the DDP all-reduce of the *accumulated*
gradient when the window ends); its value equals the unsplit batch loss, so the loss Lightning
logs and returns is the unsplit one.

The zero_grad problem: on the first batch of a window, Lightning's ``zero_grad`` would wipe the
gradients the non-final chunks just accumulated. memguard therefore calls the module's own
``optimizer_zero_grad(epoch, batch_idx, optimizer)`` itself *before* the first chunk (freeing the
previous step's gradients earlier, never later, than Lightning would) and makes the wrapped
``optimizer_zero_grad`` skip Lightning's call for that batch, once. Whether Lightning will zero is
predicted with Lightning's own rule (``not _skip_backward and batch_idx % accumulate_grad_batches
== 0``) and verified: if Lightning's call does not come, or comes when not predicted, memguard logs
an error and stops splitting (a changed Lightning would be noticed, not silently wrong). Hooks:
``on_before_backward`` / ``on_after_backward`` run once per chunk (a chunk is one more accumulation
micro-batch for them); ``on_before_zero_grad`` still runs at Lightning's point, and on a split
window-start batch it sees the non-final chunks' gradients instead of the previous step's.

Chunk loss weights (``loss_weighting``): ``tokens`` = each chunk's share of valid (!= -100) labels
(right for token-mean losses such as HF causal LM / ``cross_entropy(ignore_index=-100)`` over
tokens), ``rows`` = share of rows (right for per-sample-mean losses); ``auto`` = ``tokens`` when the
batch has labels, else ``rows``. ``shift_labels`` (``None`` = auto: a dict batch with ``input_ids``
and ``labels`` of one shape fed to a HF ``*ForCausalLM``) counts labels as the causal LM shifts them.
Values the ``training_step`` logs with ``self.log`` / ``self.log_dict`` are combined over the
chunks as the chunk-weighted mean (the batch value of a mean; a ``torchmetrics.Metric`` object is
logged once, its state having been updated by every chunk), so logged metrics equal the unsplit
run's. Other side effects of ``training_step`` (counters, prints) happen once per chunk.

"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from lightning.pytorch.utilities.memory import is_oom_error

from memguard_core.guard import Guard
from memguard_core.options import GuardOptions

from . import _compat
from .batch import LabelKey, LightningBatchSplitter, batch_units
from .preflight import find_model

logger = logging.getLogger("memguard.lightning")


class _LogRecorder:
    """Stands in for ``LightningModule.log`` during a split step: records each chunk's calls and
    replays them once, combined as the chunk-weighted mean."""

    def __init__(self, real_log):
        self.real_log = real_log
        self.committed: List[Tuple[float, List[tuple]]] = []
        self.current: List[tuple] = []

    def __call__(self, name, value, *args, **kwargs):
        self.current.append((name, value, args, kwargs))

    def end_chunk(self, weight: float, commit: bool) -> None:
        if commit:
            self.committed.append((weight, self.current))
        self.current = []

    def flush(self) -> None:
        order: List[str] = []
        by_name: Dict[str, List[tuple]] = {}
        for weight, calls in self.committed:
            for name, value, args, kwargs in calls:
                if name not in by_name:
                    order.append(name)
                    by_name[name] = []
                by_name[name].append((weight, value, args, kwargs))
        for name in order:
            entries = by_name[name]
            _, last_value, args, kwargs = entries[-1]
            if all(_is_scalar(v) for _, v, _, _ in entries):
                wsum = sum(w for w, _, _, _ in entries) or 1.0
                total = None
                for w, v, _, _ in entries:
                    term = (v.detach() if torch.is_tensor(v) else torch.tensor(float(v))) * (w / wsum)
                    total = term if total is None else total + term
                value = total if torch.is_tensor(last_value) else float(total)
            else:
                value = last_value
            self.real_log(name, value, *args, **kwargs)


def _is_scalar(v: Any) -> bool:
    if torch.is_tensor(v):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _no_sync(strategy):
    """``strategy.block_backward_sync()`` (DDP ``no_sync``) where the strategy has one."""
    block = getattr(strategy, "block_backward_sync", None)
    return block() if callable(block) else contextlib.nullcontext()


def _loss_of(out: Any) -> Optional[torch.Tensor]:
    if torch.is_tensor(out):
        return out
    if isinstance(out, dict):
        return out.get("loss")
    return None


def _with_loss(out: Any, loss: torch.Tensor) -> Any:
    if torch.is_tensor(out):
        return loss
    new = dict(out)
    new["loss"] = loss
    return new


class SplitStep:
    """The in-step split of one Lightning fit (see the module doc).

    Args:
        guard: the run's ``Guard`` (monitor, OOM re-split, micro-batch rows).
        options: the guard's options (``loss_weighting``).
        label_key, shift_labels: where the labels are and whether the loss shifts them (see
            ``MemGuardCallback``).
    """

    def __init__(self, guard: Guard, options: GuardOptions, label_key: LabelKey = None,
                 shift_labels: Optional[bool] = None):
        self.guard = guard
        self.options = options
        self.label_key = label_key
        self.shift_labels = shift_labels
        self.trainer = None
        self.pl_module = None
        self.orig_training_step = None
        self.orig_zero_grad = None
        self.rows_this_step = 0
        self._phase = "forward"
        self._zero_armed_for: Optional[int] = None
        self._chunk_grads_for: Optional[int] = None

    def end_batch(self) -> None:
        """After a batch: check that Lightning's zero_grad came where its rule said it would."""
        if self._zero_armed_for is not None:
            self._zero_armed_for = None
            self.disable_split("Lightning did not zero the gradients after training_step on a batch where "
                               "its rule says it would; the gradients of the earlier batches of this "
                               "accumulation window were cleared too early")
        self._chunk_grads_for = None

    def chunks(self, batch: Any) -> Iterator[Tuple[Any, float]]:
        """Yield ``(chunk_batch, loss_weight)`` for the guard's current k (rank-agreed), for
        training steps that do their own backward (manual optimization)::

            for chunk, w in guard.chunks(batch):
                self.manual_backward(self.compute_loss(chunk) * w)

        The weights sum to 1 (see ``loss_weighting``); with k = 1 the batch itself comes back with
        weight 1.0. Rows of each chunk are recorded in the guard's ``micro_batch_rows``.
        """
        mon = self.guard.monitor
        k = self.guard.agreed(mon.split if mon is not None else self.options.micro_batches)
        if k <= 1:
            self.guard.micro_batch_rows.append(batch_units(batch))
            yield batch, 1.0
            return
        sp = self._splitter(batch)
        for u0, u1 in sp.ranges(k):
            chunk, w, units = sp.chunk(u0, u1)
            self.guard.micro_batch_rows.append(units)
            yield chunk, w

    def disable_split(self, why: str) -> None:
        """Stop cutting batches for the rest of the run (logged as an error with ``why``)."""
        logger.error("memguard: %s. In-place micro-batching is switched off for the rest of the run.", why)
        self.guard.split_disabled_reason = why

    def _shift(self, batch) -> bool:
        if self.shift_labels is not None:
            return self.shift_labels
        if not (isinstance(batch, dict) or hasattr(batch, "keys")):
            return False
        ids, labels = batch.get("input_ids"), batch.get("labels")
        if not (torch.is_tensor(ids) and torch.is_tensor(labels) and ids.shape == labels.shape):
            return False
        model = find_model(self.pl_module)
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        return type(base).__name__.endswith("ForCausalLM")

    def _splitter(self, batch) -> LightningBatchSplitter:
        weighting = self.options.loss_weighting
        sp = LightningBatchSplitter(batch, weighting="rows" if weighting == "rows" else "tokens",
                                    shift_labels=self._shift(batch), label_key=self.label_key)
        if weighting == "auto" and not sp.flat.labels_found:
            sp.core = type(sp.core)(sp.core.inputs, weighting="rows")
        return sp

    def zero_grad_coming(self, batch_idx: int) -> bool:
        """Lightning's rule (``_AutomaticOptimization._make_zero_grad_fn``): it zeroes after the
        ``training_step`` of the first batch of each accumulation window, unless it skips the
        backward."""
        if _compat.skip_backward(self.trainer):
            return False
        return batch_idx % self.trainer.accumulate_grad_batches == 0

    def zero_grad(self, epoch, batch_idx, optimizer, *args, **kwargs):
        if self._zero_armed_for is not None and self._zero_armed_for == batch_idx:
            self._zero_armed_for = None  # memguard zeroed before this batch's first chunk
            return None
        if self._chunk_grads_for is not None and self._chunk_grads_for == batch_idx:
            self.disable_split("Lightning zeroed the gradients after training_step where its rule says "
                                "it would not; this batch's non-final chunks lost their gradients")
        return self.orig_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs)

    def training_step(self, batch, *args, **kwargs):
        trainer = self.trainer
        mon = self.guard.monitor
        orig = self.orig_training_step
        if mon is None or trainer is None or not trainer.training:
            return orig(batch, *args, **kwargs)
        if self.guard.split_disabled_reason is not None:
            mon.step_sample(trainer.global_step)
            self._count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        k = self.guard.micro_batches_for_step(trainer.global_step)
        batch_idx = self._batch_idx(args, kwargs)
        if k <= 1:
            units = batch_units(batch)
            self.guard.micro_batch_rows.append(units)  # every forward tried, a failed one included
            try:
                out = orig(batch, *args, **kwargs)
                self.rows_this_step += units
                return out
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                k = self._after_oom(exc, 1, units)
        return self._split_step(batch, args, kwargs, k, batch_idx)

    @staticmethod
    def _batch_idx(args, kwargs) -> int:
        if "batch_idx" in kwargs:
            return int(kwargs["batch_idx"])
        if args and isinstance(args[0], int):
            return int(args[0])
        return 0

    def _count(self, units: int) -> None:
        self.guard.micro_batch_rows.append(units)
        self.rows_this_step += units

    def _split_step(self, batch, args, kwargs, k: int, batch_idx: int):
        trainer, pl_module = self.trainer, self.pl_module
        orig = self.orig_training_step
        try:
            sp = self._splitter(batch)
        except ValueError:
            self._count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        accum = max(1, int(trainer.accumulate_grad_batches))
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if self.zero_grad_coming(batch_idx):
            # Lightning would zero after this training_step, wiping the chunks' gradients: zero now
            self.orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            self._zero_armed_for = batch_idx
        recorder = _LogRecorder(pl_module.log)
        pl_module.log = recorder
        earlier = None  # sum of the non-final chunks' weighted losses, detached
        start = 0
        out = None
        ok = False
        try:
            while start < sp.units:
                try:
                    for u0, u1 in sp.ranges(k, start):
                        chunk, w, units = sp.chunk(u0, u1)
                        last = u1 == sp.units
                        self._phase = "forward"
                        self.guard.micro_batch_rows.append(units)
                        out = orig(chunk, *args, **kwargs)
                        loss = _loss_of(out)
                        if last:
                            recorder.end_chunk(w, commit=True)
                            self.rows_this_step += units
                            start = u1
                            ok = True
                            if loss is None:
                                return out
                            total = loss * w
                            if earlier is not None:
                                total = total + earlier
                            return _with_loss(out, total)
                        if loss is not None:
                            self._phase = "backward"
                            self._chunk_grads_for = batch_idx
                            with _no_sync(trainer.strategy):
                                trainer.strategy.backward(loss * (w / accum), optimizer)
                            part = loss.detach() * w
                            earlier = part if earlier is None else earlier + part
                        del out, loss
                        out = None
                        recorder.end_chunk(w, commit=True)
                        self.rows_this_step += units
                        start = u1
                except Exception as exc:
                    recorder.end_chunk(0.0, commit=False)
                    if not (is_oom_error(exc) and self._phase == "forward"):
                        raise
                    out = None
                    k = self._after_oom(exc, k, sp.units - start)
            ok = True
            return out
        finally:
            pl_module.__dict__.pop("log", None)
            if ok:
                recorder.flush()

    def _after_oom(self, exc: BaseException, k: int, units_left: int) -> int:
        """Free memory after a forward OOM and return the doubled split; re-raise if none helps."""
        return self.guard.after_oom(exc, k, units_left, self.trainer.global_step)
