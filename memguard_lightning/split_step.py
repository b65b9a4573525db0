"""How one batch runs as k micro-batches inside Lightning's automatic optimization: the
Lightning adapter's ``training_step`` / ``optimizer_zero_grad`` / ``backward`` wrappers (installed by
``memguard_lightning.callback.MemGuardCallback``), the per-chunk backward and the chunk-weighted
``self.log`` values, the forward OOM retry and the accumulation-window redo. The guard's decisions
(k, OOM re-split, window redo) come from ``memguard_core.guard.Guard``.

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

Out-of-memory errors (``memguard_torch.oom.is_oom_error``): one in a chunk's *forward* frees memory, doubles k and redoes
only the rows not yet processed (the earlier chunks' gradients are already weighted for the whole
batch). One in a *backward* has added part of a gradient that cannot be taken back, so the whole
accumulation window is redone (the HF adapter's rule, docs/lifecycle.md "Redoing the accumulation
window"; ``Guard.after_window_oom``: gradients set to None, memory freed, k doubled, floor and cap
ending in ``WindowOOMError``):

* the window's batches: ``training_step`` keeps a reference to each batch of the current window
  (already in memory: Lightning fetched it and moved it to the device), the window starting where
  Lightning's zero_grad rule says (``batch_idx % accumulate_grad_batches == 0``), so nothing is
  drawn from the dataloader twice and ``global_step``, the LR schedule and the samples per
  optimizer step stay exact. The earlier batches are redone with all their micro-batches' forwards
  and backwards run by memguard, their ``self.log`` values discarded (they were logged when the
  batch first ran; the redone ones are equal up to summation order).
* a failure in a non-final chunk's backward (memguard's, inside ``training_step``): the earlier
  batches are redone there, then this batch from its first row at the new k, its last chunk again
  returned for Lightning's backward.
* a failure in Lightning's own backward of the returned loss (the final chunk, or the whole batch
  at k = 1): it cannot be caught in ``training_step``, which has returned. memguard wraps the
  module's ``backward`` hook (``LightningModule.backward``, what the precision plugin calls inside
  ``strategy.backward``) on the instance; on an OOM there it detaches the failed loss (so the
  graph's saved tensors go; under a ``GradScaler`` Lightning's unscaled loss keeps them until the
  batch ends), redoes the window's batches, this one included, all by memguard, and returns:
  Lightning goes on with complete gradients (``on_after_backward``, the optimizer step). The loss
  Lightning logs and returns is the first attempt's, whose forward completed.
  Returning a detached loss and running every backward inside ``training_step`` instead was
  rejected: under DDP ``training_step`` runs inside the DDP forward, before ``_post_forward``
  prepares the reducer, so a backward there would never all-reduce.
* under DDP (several ranks: ``_ddp_for_window``) see below; with several processes otherwise the
  other ranks are inside the failing backward's gradient all-reduce (or would run a different
  number of backwards), so the error is re-raised there (``can_redo``), as it is when the window's
  batches were not all seen in order.

Under DDP: memguard's gradient average
--------------------------------------
In an unguarded run the backward at a window's end all-reduces in DDP's reducer hooks, so a rank
failing there would leave the others waiting. memguard takes the reduction over (the HF adapter's
rule, docs/lifecycle.md "Ranks agree"; docs/lightning.md "Under DDP"):

* ``training_step`` runs inside the DDP module's forward (Lightning's ``_DDPForwardRedirection``)
  and DDP reads ``require_backward_grad_sync`` in its ``_post_forward``, after it returns, to
  prepare the reducer. The wrapped ``training_step`` switches it off on every batch of the window
  (``_compat.ddp_sync_off``), so no backward of the window all-reduces; it is put back when
  Lightning's backward of the batch starts.
* In the wrapped ``backward`` of every batch, every rank all-reduces whether its batch failed
  (``Guard.agree_redo``); on any failure every rank redoes the window, this batch included, at
  the agreed k, and agrees again after each redo. An OOM in a non-final chunk's backward inside
  ``training_step`` is kept for that agreement (``_pending``), and the batch's remaining chunks run
  their forwards without gradients, so its ``self.log`` values and returned loss stay complete.
* Where Lightning steps the optimizer after the batch (``_compat.window_ends``) the gradients are
  averaged once (``memguard_core.torch_train.average_ddp_gradients``) before ``on_after_backward``
  and clipping, and DDP's buffer broadcast is armed for the next forward.

Under FSDP: every micro-batch between the OOM sync points
--------------------------------------------------------
With several ranks and ``fully_shard`` modules (``ModelParallelStrategy`` with a tensor-parallel
size of 1: tensor-parallel collectives have no sync points, and there an OOM is re-raised) every
forward and backward runs FSDP collectives, so a rank that retries alone would leave the others
waiting. Every
batch, k = 1 included, goes through ``_fsdp_step``: the micro-batches agreed by every rank
(``memguard_torch.ranks.agreed_ranges``), each between the sync points of
``memguard_torch.sync`` (``OomSync``; ``FsdpSyncHooks`` inside FSDP's all-gathers and
reduce-scatters, as the HF adapter does: docs/hf_fsdp.md), every backward reduce-scattering (the
strategy has no ``no_sync`` for FSDP2). The non-final micro-batches end in ``training_step``
(``OomSync.end``); the final one's forward is returned and its micro-batch ends in the wrapped
``backward`` once Lightning's backward of it is done (``_fsdp_backward``). Between the two
Lightning runs only its zero_grad and hooks, no FSDP collective. The batch's ``self.log`` values
are replayed after that end, when every rank knows the batch went through (a ``sync_dist`` value is
a collective of its own), filed under ``training_step`` (``_compat.logging_as``); after a failure
every rank logs them from the redo, at the same point. When any rank failed, every rank
resets FSDP's iteration state (``fsdp_after_abort``) and redoes the window through this batch at
2k, wherever it learnt of it: in ``training_step`` (the redone loss is returned detached and
Lightning's backward of it skipped, its zero_grad of the window start too) or in ``backward``. The redo's micro-batches run between the
sync points as well, so a failure during a redo is redone again by every rank, and a
``WindowOOMError`` is raised by every rank alike.

FSDP1 (``FSDPStrategy``) runs the same step, with two differences. Lightning calls
``training_step`` inside the root ``FullyShardedDataParallel``'s forward (its forward redirection):
a micro-batch's backward there would fire the root's post-backward hook before the root's
pre-backward hook ran (FSDP1 asserts on it) and reshard parameters the next micro-batch's forward
still uses. The callback therefore wraps the strategy's ``training_step`` (``step_owner``), so each
micro-batch is one root forward, and the step's "original" is the strategy's method. And Lightning
runs a window's earlier batches in ``strategy.block_backward_sync()``, FSDP1's ``no_sync`` for an
FSDP1 root: each micro-batch turns FSDP1's gradient sync back on (``_fsdp1_sync``), so every
micro-batch reduce-scatters; the sync points are ``Fsdp1SyncHooks``, the reset after an abort
``fsdp_after_abort`` on the root. A failure inside the root's forward before it reached the module
(its unshard) leaves Lightning's ``forward`` patch on the module, which memguard undoes
(``_step``). One process runs the same step without flags.

The optimizer step: AdamW's states are allocated before the first forward
(``memguard_core.optim_state.preallocate_optimizer_state``, see ``prepare_optimizers``), so the
first step does not allocate them; an OOM inside the update itself is never redone (it may have
changed parameters in place) and ends in ``WindowOOMError`` with the plan.

Chunk loss weights (``loss_weighting``): ``tokens`` = each chunk's share of valid (!= -100) labels
(right for token-mean losses such as HF causal LM / ``cross_entropy(ignore_index=-100)`` over
tokens), ``rows`` = share of rows (right for per-sample-mean losses); ``auto`` = ``tokens`` when the
batch has labels, else ``rows``. ``shift_labels`` (``None`` = auto: a dict batch with ``input_ids``
and ``labels`` of one shape fed to a HF ``*ForCausalLM``) counts labels as the causal LM shifts them.
Values the ``training_step`` logs with ``self.log`` / ``self.log_dict`` are combined over the
chunks by their ``reduce_fx``: the chunk-weighted mean (the batch value of a mean) by default, the
sum / max / min for those (a ``torchmetrics.Metric`` object is logged once, its state having been
updated by every chunk), so logged metrics equal the unsplit run's. Other side effects of
``training_step`` (counters, prints) happen once per chunk, and again for a redone one.

"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from memguard_core import torch_train as tt
from memguard_core.distributed import flag_group
from memguard_core.guard import Guard
from memguard_core.microbatch import without_frames as _without_frames
from memguard_core.optim_state import prepare_optimizer
from memguard_core.options import GuardOptions
from memguard_torch import _compat as torch_compat
from memguard_torch.oom import is_oom_error
from memguard_torch.ranks import agreed_ranges, fsdp_after_abort
from memguard_torch.sync import Fsdp1SyncHooks, FsdpSyncHooks, OomSync, PeerOutOfMemoryError

from . import _compat
from .batch import LabelKey, LightningBatchSplitter, batch_units
from .preflight import find_model

logger = logging.getLogger("memguard.lightning")


class _LogRecorder:
    """Stands in for ``LightningModule.log`` during a split step: records each chunk's calls and
    replays them once per name, combined over the chunks by the call's ``reduce_fx``: ``sum`` /
    ``max`` / ``min`` over the chunks' values, anything else (``mean``, the default) as the
    chunk-weighted mean; an explicit ``batch_size`` is replayed as the chunks' total."""

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
            value = last_value
            if all(_is_scalar(v) for _, v, _, _ in entries):
                value = _reduce(entries, _reduce_name(args, kwargs))
                if not torch.is_tensor(last_value):
                    value = float(value)
            sizes = [e[3].get("batch_size") for e in entries]
            if len(entries) > 1 and all(isinstance(b, int) for b in sizes):
                kwargs = dict(kwargs, batch_size=sum(sizes))
            self.real_log(name, value, *args, **kwargs)


def _reduce_name(args: tuple, kwargs: dict) -> str:
    """The ``reduce_fx`` of a ``LightningModule.log`` call (its 7th parameter) as a name."""
    fx = kwargs.get("reduce_fx", args[4] if len(args) > 4 else "mean")
    for name in ("sum", "max", "min"):
        if fx == name or fx is getattr(torch, name):
            return name
    return "mean"


def _reduce(entries: List[tuple], how: str):
    """The chunks' scalar values combined (see ``_LogRecorder``); a tensor."""
    values = [(v.detach().float() if torch.is_tensor(v) else torch.tensor(float(v))).reshape(())
              for _, v, _, _ in entries]
    if how == "sum":
        return torch.stack(values).sum()
    if how == "max":
        return torch.stack(values).max()
    if how == "min":
        return torch.stack(values).min()
    wsum = sum(w for w, _, _, _ in entries) or 1.0
    total = None
    for (w, _, _, _), v in zip(entries, values):
        term = v * (w / wsum)
        total = term if total is None else total + term
    return total


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


def _release_graph(loss: Any) -> None:
    """Drop the autograd graph a failed backward left behind ``loss`` (the tensor Lightning still
    holds in its closure): ``detach_`` makes it a leaf, so the graph's unfreed saved tensors go
    with the last reference. Under a ``GradScaler`` ``loss`` is the scaled copy and the graph stays
    reachable from Lightning's unscaled loss until the batch ends."""
    try:
        if torch.is_tensor(loss) and loss.grad_fn is not None:
            loss.detach_()
    except Exception:
        logger.debug("memguard: could not detach the failed loss", exc_info=True)


class _Discard:
    """``LightningModule.log`` during a redo: the values were already logged by the first attempt
    (the redone values are the same up to summation order)."""

    def __call__(self, *args, **kwargs):
        return None


class SplitStep:
    """The in-step split and the window redo of one Lightning fit (see the module doc).

    Args:
        guard: the run's ``Guard`` (monitor, OOM re-split, window redo, micro-batch rows).
        options: the guard's options (``loss_weighting``).
        label_key, shift_labels: where the labels are and whether the loss shifts them (see
            ``MemGuardCallback``).

    Attributes: ``window_redos`` (redos of the current accumulation window), ``ddp_averages``
    (windows whose gradients memguard averaged over the DDP ranks itself), ``rows_this_step``.
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
        self.step_owner = None          # what training_step was wrapped on: the module, or the FSDP1 strategy
        self.orig_zero_grad = None
        self.orig_backward = None
        self.rows_this_step = 0
        self.window_redos = 0          # redos of the current accumulation window
        self.ddp_averages = 0          # windows whose gradients memguard averaged over the DDP ranks
        self._phase = "forward"
        self._zero_armed_for: Optional[int] = None
        self._chunk_grads_for: Optional[int] = None
        self._window: List[tuple] = []  # (batch, args, kwargs) of the window's batches so far
        self._window_ok = False         # the window's batches are all kept, in Lightning's order
        self._own_backward = False      # a backward memguard runs (its errors are handled where it runs)
        self._ddp = None                # this batch's DDP module when memguard averages the gradients
        self._ddp_found: Any = None     # the fit's DDP module (False: none, or not averaged by memguard)
        self._sync_was: Optional[bool] = None  # DDP's require_backward_grad_sync before memguard turned it off
        self._pending: Optional[BaseException] = None  # a chunk's backward OOM awaiting the ranks' agreement
        self._fsdp_sync: Optional[OomSync] = None  # FSDP with several ranks: the run's OOM sync points
        self._fsdp_hooks: Any = None    # FsdpSyncHooks (FSDP2) or Fsdp1SyncHooks
        self._fsdp_model: Any = None    # what FSDP's reset after an abort walks: the module, or FSDP1's root
        self._fsdp_v1 = False           # FSDP1 under FSDPStrategy: every micro-batch with FSDP1's sync on
        self._fsdp_checked = False
        self._fsdp_final = False        # the batch's last micro-batch ends in Lightning's backward
        self._skip_backward = False     # the batch was redone in training_step: Lightning's backward is not run
        self._redone_loss = None        # the current batch's loss from a redo (_redo_window(log_current=True))
        self._final_recorder: Optional[_LogRecorder] = None  # FSDP: the batch's values, logged after its backward
        self.oom_errors: List[str] = []  # out-of-memory errors met under FSDP (this rank's, or a peer's)

    # ------------------------------------------------------------------ bookkeeping
    def end_batch(self) -> None:
        """After a batch: check that Lightning's zero_grad came where its rule said it would."""
        self._restore_sync()
        self._pending = None
        self._fsdp_final = self._skip_backward = False
        self._redone_loss = self._final_recorder = None
        if self._fsdp_sync is not None:
            self._fsdp_sync.inside = False   # a final micro-batch whose backward Lightning skipped
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
        sp = self.splitter(batch)
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

    def splitter(self, batch) -> LightningBatchSplitter:
        """The batch's splitter with the run's loss weighting (``auto``: tokens when the batch has
        labels, else rows). Raises ``ValueError`` for a batch without a batch dimension."""
        weighting = self.options.loss_weighting
        sp = LightningBatchSplitter(batch, weighting="rows" if weighting == "rows" else "tokens",
                                    shift_labels=self._shift(batch), label_key=self.label_key)
        if weighting == "auto" and not sp.flat.labels_found:
            sp.core = type(sp.core)(sp.core.inputs, weighting="rows")
        return sp

    _splitter = splitter

    def zero_grad_coming(self, batch_idx: int) -> bool:
        """Lightning's rule (``_AutomaticOptimization._make_zero_grad_fn``): it zeroes after the
        ``training_step`` of the first batch of each accumulation window, unless it skips the
        backward."""
        if _compat.skip_backward(self.trainer):
            return False
        return batch_idx % self.trainer.accumulate_grad_batches == 0

    def _accum(self) -> int:
        return max(1, int(self.trainer.accumulate_grad_batches))

    def _optimizer(self):
        return self.trainer.optimizers[0] if self.trainer.optimizers else None

    # ------------------------------------------------------------------ the window
    def _remember(self, batch, args, kwargs, batch_idx: int) -> None:
        """Keep a reference to this batch (already in memory: Lightning fetched and moved it) as
        the next batch of the accumulation window, which starts where Lightning's zero_grad rule
        says (``batch_idx % accumulate_grad_batches == 0``)."""
        pos = batch_idx % self._accum()
        if pos == 0:
            self._window = []
            self._window_ok = True
            self.window_redos = 0
        self._window_ok = self._window_ok and len(self._window) == pos
        self._window.append((batch, args, kwargs))

    def release(self) -> None:
        """Drop the kept window's batches (the fit has ended)."""
        self._restore_sync()
        self._window = []
        self._window_ok = False
        self._ddp = self._pending = None
        self._ddp_found = None
        if self._fsdp_hooks is not None:
            self._fsdp_hooks.remove()     # FSDP gets its comms back
        self._fsdp_sync = self._fsdp_hooks = self._fsdp_model = None
        self._fsdp_checked = self._fsdp_final = self._skip_backward = self._fsdp_v1 = False

    def can_redo(self) -> Optional[str]:
        """Why the accumulation window cannot be redone now (None: it can)."""
        trainer = self.trainer
        if self.guard.monitor is None or trainer is None or not trainer.training:
            return "not in a guarded training step"
        if self.guard.split_disabled_reason is not None:
            return "in-place micro-batching is off"
        if int(getattr(trainer, "world_size", 1) or 1) > 1 and self._ddp is None and self._fsdp_sync is None:
            return ("several processes without memguard's DDP gradient average: the other ranks are inside the "
                    "gradient all-reduce of this backward or would run a different number of backwards")
        if not self._window_ok:
            return "the accumulation window's batches were not all seen in order"
        return None

    def _redo_window(self, failure: Optional[BaseException], k: int, *, through_current: bool,
                     phase: Optional[str] = None, log_current: bool = False) -> int:
        """After an out-of-memory error that left the window's gradients partly summed (``failure``;
        None: another rank's): zero them, free memory, raise k (``Guard.after_window_oom``, the new k
        agreed over the ranks) and run the window's kept batches again, all their micro-batches'
        forwards and backwards by memguard: the earlier batches, and the current one too when
        ``through_current`` (a failure in Lightning's own backward of it, or any failure under DDP
        or FSDP). After each attempt the ranks agree whether every one went through
        (``Guard.agree_redo``; this rank's own answer in one process); if not, all redo again at a
        larger k. ``log_current``: the current batch's ``self.log`` values (not logged yet: its first
        attempt failed in ``training_step``) are recorded in the attempt that goes through and
        logged once; its weighted loss is kept in ``_redone_loss``. ``WindowOOMError`` at the floor
        or cap. Returns the k used."""
        last = len(self._window) if through_current else len(self._window) - 1
        rows = max([batch_units(b) for b, _, _ in self._window] + [1])
        phase = phase or self._phase
        while True:
            # under FSDP1 the root: every parameter of the run, flat or original, is under it
            (self._fsdp_model or self.pl_module).zero_grad(set_to_none=True)
            k = self.guard.after_window_oom(failure, k, rows, self.trainer.global_step,
                                            redos=self.window_redos, phase=phase)
            failure = recorder = None
            self.window_redos += 1
            self.rows_this_step = 0
            self._redone_loss = None
            try:
                for i, (batch, args, kwargs) in enumerate(self._window[:last]):
                    current = log_current and i == last - 1
                    recorder = _LogRecorder(self.pl_module.log) if current else None
                    loss = self._run_whole(batch, args, kwargs, k, recorder)
                    if current:
                        self._redone_loss = loss
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                failure = _without_frames(exc)
                phase = self._phase
            if not self.guard.agree_redo(failure is not None):
                if recorder is not None:
                    with _compat.logging_as(self.pl_module, "training_step"):
                        recorder.flush()
                return k

    def _run_whole(self, batch, args, kwargs, k: int, recorder: Optional[_LogRecorder] = None):
        """Forward and backward of every micro-batch of a kept window batch; its logs discarded
        (they were logged when it first ran), or kept in ``recorder``. Under FSDP with several
        ranks every micro-batch runs between the OOM sync points (:meth:`_chunk_begin` /
        :meth:`_chunk_end`), the chunks agreed by every rank. Returns the batch's loss (the chunks'
        weighted sum, detached; None when the step returns no loss)."""
        accum, optimizer = self._accum(), self._optimizer()
        sync = self._fsdp_sync
        try:
            sp = self.splitter(batch) if k > 1 else None
        except ValueError:
            sp = None
        if sp is None:
            pieces = [(batch, 1.0, batch_units(batch))]
        elif sync is not None:
            pieces = (sp.chunk(u0, u1) for u0, u1 in agreed_ranges(sp, k, 0, sync.group))
        else:
            pieces = (sp.chunk(u0, u1) for u0, u1 in sp.ranges(k))
        self.pl_module.log = recorder if recorder is not None else _Discard()
        total = None
        try:
            for chunk, w, units in pieces:
                self._phase = "forward"
                self.guard.micro_batch_rows.append(units)
                exc = None
                self._chunk_begin()
                try:
                    with self._fsdp1_sync():
                        loss = _loss_of(self._step(chunk, args, kwargs, outside_step=True))
                        if loss is not None:
                            self._backward(loss * (w / accum), optimizer)
                    if loss is not None:
                        part = loss.detach() * w
                        total = part if total is None else total + part
                except Exception as e:
                    if sync is None or not is_oom_error(e):
                        self._chunk_abandoned()
                        raise
                    exc = _without_frames(e)
                loss = chunk = None
                failure = self._chunk_end(exc)
                if failure is not None:
                    if recorder is not None:
                        recorder.end_chunk(0.0, commit=False)   # its values may hold the failed graph
                    raise failure
                if recorder is not None:
                    recorder.end_chunk(w, commit=True)
                self.rows_this_step += units
        finally:
            self.pl_module.__dict__.pop("log", None)
        return total

    def _step(self, batch, args, kwargs, *, outside_step: bool = False):
        """The user's ``training_step`` on ``batch`` (a micro-batch), through what was wrapped: the
        module's method, or under FSDP1 the strategy's (a root FSDP1 forward, in the precision
        plugin's ``train_step_context``), its forward patch undone if it fails before reaching the
        module (``_compat.forward_patch_undone_on_error``). ``outside_step``: the call may come from
        Lightning's backward (a window redo), outside the strategy's ``training_step``, so the
        module's method runs in ``train_step_context`` too (autocast under ``*-mixed``; nested in
        the strategy's own it changes nothing)."""
        if self.step_owner is not None and self.step_owner is not self.pl_module:
            with _compat.forward_patch_undone_on_error(self.pl_module):
                return self.orig_training_step(batch, *args, **kwargs)
        if outside_step:
            with self.trainer.strategy.precision_plugin.train_step_context():
                return self.orig_training_step(batch, *args, **kwargs)
        return self.orig_training_step(batch, *args, **kwargs)

    def _backward(self, loss, optimizer) -> None:
        """A backward memguard runs itself: through ``strategy.backward`` (the precision plugin's
        loss scaling, the backward hooks), under ``no_sync`` (DDP); under FSDP1 with FSDP1's
        gradient sync on instead (:meth:`_fsdp1_sync`)."""
        self._phase = "backward"
        self._own_backward = True
        try:
            with self._fsdp1_sync() if self._fsdp_v1 else _no_sync(self.trainer.strategy):
                self.trainer.strategy.backward(loss, optimizer)
        finally:
            self._own_backward = False

    # ------------------------------------------------------------------ DDP
    def _ddp_for_window(self):
        """The DDP module when this batch's gradients are averaged by memguard once the ranks agreed
        that the window went through (module doc, "Under DDP"), else None: several ranks,
        Lightning's DDP wrapper reducing by plain averaging (no communication hook, no static
        graph), Lightning's optimizer-step point readable, a backward to come, and the window's
        batches all kept in order. The same answer on every rank (nothing here is rank-local)."""
        trainer = self.trainer
        if int(getattr(trainer, "world_size", 1) or 1) <= 1 or not self._window_ok:
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

    def _chunk_backward(self, loss, optimizer) -> None:
        """A non-final chunk's backward. Under DDP an out-of-memory error there is kept for the
        ranks' agreement at this batch's backward (the other ranks are not told here: they run no
        collective until then); the rest of the batch runs its forwards without gradients, so its
        logged values and returned loss are complete."""
        if self._ddp is None:
            self._backward(loss, optimizer)
            return
        try:
            self._backward(loss, optimizer)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            self._pending = _without_frames(exc)

    def _ddp_backward(self, loss, *args, **kwargs):
        """Lightning's backward of a batch under DDP with memguard's gradient average: its backward
        (no all-reduce: DDP's reducer was left unprepared), then every rank says whether its batch
        went through (``Guard.agree_redo``); if one did not, every rank zeroes the gradients and
        redoes the window at a larger k. At the window's end the gradients are averaged once
        (``memguard_core.torch_train.average_ddp_gradients``), before ``on_after_backward`` and
        gradient clipping, as DDP's all-reduce would be."""
        ddp = self._ddp
        self._restore_sync()
        failure, self._pending = self._pending, None
        self._phase = "backward"
        if failure is None:
            try:
                self.orig_backward(loss, *args, **kwargs)
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                failure = _without_frames(exc)
            if failure is not None:
                _release_graph(loss)
        loss = None
        if self.guard.agree_redo(failure is not None):
            mon = self.guard.monitor
            self._redo_window(failure, mon.split if mon is not None else 1, through_current=True,
                              phase="backward")
        if _compat.window_ends(self.trainer):
            # the has-gradient mask on a gloo group of its own: a CPU tensor on an NCCL group would fail
            tt.average_ddp_gradients(ddp, flag_group())
            _compat.ddp_buffers_at_next_forward(ddp)
            self.ddp_averages += 1
        return None

    # ------------------------------------------------------------------ FSDP
    def _fsdp_for_fit(self) -> Optional[OomSync]:
        """The fit's ``OomSync`` when the fit runs on several ranks and the module holds
        ``fully_shard`` modules (``ModelParallelStrategy``) or the strategy wrapped it in FSDP1
        (``FSDPStrategy``), else None. At the first call (the first guarded training batch, on
        every rank alike: the flag group is made collectively) the sync points go into FSDP's comms
        (``memguard_torch.sync.FsdpSyncHooks`` / ``Fsdp1SyncHooks``); ``release`` takes them out.
        FSDP1 without sync points (a hybrid strategy, a communication hook of the user's): None,
        and an OOM is re-raised (``_collectives_unsynced``)."""
        if not self._fsdp_checked:
            self._fsdp_checked = True
            several = int(getattr(self.trainer, "world_size", 1) or 1) > 1
            root = getattr(self.trainer.strategy, "model", None)
            if self.step_owner is self.trainer.strategy and torch_compat.fsdp1_modules(root):
                self._fsdp_model, self._fsdp_v1 = root, True
                if not several:
                    # one process: no flags to exchange, but the same step (an aborted FSDP1
                    # backward is reset before the window is redone)
                    self._fsdp_sync = OomSync(None)
                else:
                    sync = OomSync(flag_group())
                    hooks = Fsdp1SyncHooks(root, sync)
                    if hooks.installed:
                        self._fsdp_sync, self._fsdp_hooks = sync, hooks
                    else:
                        logger.warning("memguard: FSDP1 without OOM sync points (a hybrid sharding strategy or a "
                                       "communication hook of its own): an out-of-memory error is raised, not "
                                       "redone")
            elif several and torch_compat.fsdp_modules(self.pl_module):
                self._fsdp_model = self.pl_module
                tp = _compat.tensor_parallel_size(self.trainer.strategy)
                if "ModelParallel" in type(self.trainer.strategy).__name__ and tp != 1:
                    # tensor-parallel collectives have no sync points: an OOM is raised, not redone
                    logger.warning("memguard: tensor parallelism (size %s) under ModelParallelStrategy: its "
                                   "collectives have no OOM sync points, so an out-of-memory error is raised, "
                                   "not redone", tp if tp is not None else "unknown")
                else:
                    self._fsdp_sync = OomSync(flag_group())
                    self._fsdp_hooks = FsdpSyncHooks(self.pl_module, self._fsdp_sync)
        return self._fsdp_sync

    def _collectives_unsynced(self) -> bool:
        """Several ranks whose forwards run collectives (FSDP2, FSDP1, tensor parallelism) without
        memguard's sync points: a rank retrying a forward alone would leave its peers waiting."""
        if self._fsdp_sync is not None or int(getattr(self.trainer, "world_size", 1) or 1) <= 1:
            return False
        # _fsdp_for_fit (run at the batch's start) set _fsdp_model for FSDP1 and for several FSDP2 ranks
        return self._fsdp_model is not None or "ModelParallel" in type(self.trainer.strategy).__name__

    def _fsdp1_sync(self):
        """Under FSDP1: FSDP1's gradient sync on for a micro-batch (``torch_compat.fsdp1_sync_on``).
        Lightning runs a window's earlier batches inside ``strategy.block_backward_sync()``, which
        for an FSDP1 root is FSDP1's ``no_sync`` (Lightning's ``DistributedDataParallel`` protocol
        matches any module with a ``no_sync``): unsharded gradients kept until the window's last
        backward, the memory a split is meant to save. With it on, every micro-batch
        reduce-scatters. A no-op otherwise."""
        return torch_compat.fsdp1_sync_on(self._fsdp_model) if self._fsdp_v1 else contextlib.nullcontext()

    def _chunk_begin(self) -> None:
        """A micro-batch begins between the FSDP sync points (a no-op without them)."""
        sync = self._fsdp_sync
        if sync is None:
            return
        sync.grads_added = False
        if self._fsdp_hooks is not None:
            self._fsdp_hooks.new_chunk()
        sync.inside = sync.group is not None

    def _chunk_abandoned(self) -> None:
        """An error other than out-of-memory left a micro-batch: it propagates (the run ends), and
        the sync points stop answering."""
        if self._fsdp_sync is not None:
            self._fsdp_sync.inside = False

    def _chunk_end(self, exc: Optional[BaseException]) -> Optional[BaseException]:
        """The end of a micro-batch under FSDP with several ranks: ``exc`` this rank's
        out-of-memory error (None: it went through); every rank learns whether any failed
        (``OomSync.end``). Returns None when none did, else the failure to redo the window for
        (this rank's error, or a ``PeerOutOfMemoryError``), FSDP's state reset and memory freed
        (``fsdp_after_abort``). Without the sync points: ``exc``."""
        sync = self._fsdp_sync
        if sync is None:
            return exc
        sync.inside = False
        if exc is not None:
            self.oom_errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        top, _low = sync.end(0 if exc is None else (2 if sync.grads_added else 1))
        if top == 0:
            return None
        fsdp_after_abort(self._fsdp_model)
        return exc if exc is not None else PeerOutOfMemoryError("at the end of a micro-batch")

    def _fsdp_step(self, batch, args, kwargs, k: int, batch_idx: int):
        """The batch under FSDP with several ranks (FSDP1: one rank too; module doc, "Under FSDP"):
        its micro-batches agreed by every rank (``agreed_ranges``), each forward and backward between the OOM sync
        points, every backward reduce-scattering; the last micro-batch's backward is Lightning's,
        ended in :meth:`_fsdp_backward`. An out-of-memory error on any rank, learnt by every rank at
        the end of the micro-batch, makes every rank redo the window, this batch included (here,
        or in :meth:`_fsdp_backward` on a rank that had already returned); the batch's loss is then
        the redone one, detached, and Lightning's backward of it is skipped (its gradients are in)."""
        trainer, pl_module, sync = self.trainer, self.pl_module, self._fsdp_sync
        try:
            sp = self.splitter(batch) if k > 1 else None
        except ValueError:
            sp = None
        ranges = [(0, batch_units(batch))] if sp is None else agreed_ranges(sp, k, 0, sync.group)
        accum, optimizer = self._accum(), self._optimizer()
        if len(ranges) > 1 and self.zero_grad_coming(batch_idx):
            # Lightning would zero after this training_step, wiping the chunks' gradients: zero now
            self.orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            self._zero_armed_for = batch_idx
        recorder = _LogRecorder(pl_module.log)
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
                    with self._fsdp1_sync():
                        out = self._step(chunk, args, kwargs)
                        loss = _loss_of(out)
                        if loss is not None and not final:
                            self._chunk_grads_for = batch_idx
                            self._backward(loss * (w / accum), optimizer)
                    if loss is not None and not final:
                        part = loss.detach() * w
                        earlier = part if earlier is None else earlier + part
                except Exception as e:
                    if not is_oom_error(e):
                        self._chunk_abandoned()
                        raise
                    exc = _without_frames(e)
                pl_module.__dict__.pop("log", None)
                chunk = None
                if final and exc is None and loss is not None:
                    # this micro-batch ends in Lightning's backward of the returned loss; its values
                    # are logged there, once every rank knows it went through (a sync_dist log is a
                    # collective: logged here, it could wait for a rank that failed)
                    recorder.end_chunk(w, commit=True)
                    self._final_recorder = recorder
                    self.rows_this_step += units
                    self._fsdp_final = True
                    return _with_loss(out, loss * w if earlier is None else loss * w + earlier)
                loss = None
                if exc is not None:
                    out = None   # the failed chunk's graph goes before memory is freed
                failure = self._chunk_end(exc)
                if failure is not None:
                    out = None
                    break
                recorder.end_chunk(w, commit=True)
                self.rows_this_step += units
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
        if self.zero_grad_coming(batch_idx):
            self._zero_armed_for = batch_idx   # Lightning's zero_grad would wipe the redone gradients
        self._skip_backward = True
        loss, self._redone_loss = self._redone_loss, None
        return loss

    def _fsdp_backward(self, loss, *args, **kwargs):
        """Lightning's backward of the batch's last micro-batch under FSDP with several ranks, still
        between the sync points its forward began: at its end every rank learns whether any failed;
        on a failure every rank redoes the window, this batch included (its values were logged
        when its forward went through), and Lightning goes on with complete gradients."""
        self._fsdp_final = False
        self._phase = "backward"
        exc = None
        try:
            with self._fsdp1_sync():
                self.orig_backward(loss, *args, **kwargs)
        except Exception as e:
            if not is_oom_error(e):
                self._chunk_abandoned()
                raise
            exc = _without_frames(e)
        if exc is not None:
            _release_graph(loss)
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
        self._redo_window(failure, mon.split if mon is not None else 1, through_current=True, phase="backward",
                          log_current=True)
        return None

    # ------------------------------------------------------------------ wrapped module methods
    def zero_grad(self, epoch, batch_idx, optimizer, *args, **kwargs):
        if self._zero_armed_for is not None and self._zero_armed_for == batch_idx:
            self._zero_armed_for = None  # memguard zeroed before this batch's first chunk
            return None
        if self._chunk_grads_for is not None and self._chunk_grads_for == batch_idx:
            self.disable_split("Lightning zeroed the gradients after training_step where its rule says "
                                "it would not; this batch's non-final chunks lost their gradients")
        return self.orig_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs)

    def backward(self, loss, *args, **kwargs):
        """``LightningModule.backward``: Lightning's own backward of the batch's (final micro-batch's)
        loss. An out-of-memory error there redoes the window's batches, this one included, at a
        larger k, all by memguard; Lightning then goes on with the gradients complete (under DDP
        with every rank: ``_ddp_backward``; under FSDP: ``_fsdp_backward``)."""
        if self._own_backward:
            return self.orig_backward(loss, *args, **kwargs)
        if self._skip_backward:
            self._skip_backward = False   # redone in training_step, gradients complete
            return None
        if self._fsdp_final:
            return self._fsdp_backward(loss, *args, **kwargs)
        if self._ddp is not None:
            return self._ddp_backward(loss, *args, **kwargs)
        if self.can_redo() is not None:
            with self._fsdp1_sync():   # FSDP1 without sync points: still reduce-scatter this micro-batch
                return self.orig_backward(loss, *args, **kwargs)
        self._phase = "backward"
        failure = None
        try:
            with self._fsdp1_sync():
                return self.orig_backward(loss, *args, **kwargs)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            failure = _without_frames(exc)
        _release_graph(loss)
        loss = None
        mon = self.guard.monitor
        self._redo_window(failure, mon.split if mon is not None else 1, through_current=True)
        return None

    def training_step(self, batch, *args, **kwargs):
        trainer = self.trainer
        mon = self.guard.monitor
        orig = self.orig_training_step
        self._ddp = None
        if mon is None or trainer is None or not trainer.training:
            return orig(batch, *args, **kwargs)
        if self.guard.split_disabled_reason is not None:
            mon.step_sample(trainer.global_step)
            self._count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        k = self.guard.micro_batches_for_step(trainer.global_step)
        batch_idx = self._batch_idx(args, kwargs)
        self._remember(batch, args, kwargs, batch_idx)
        if self._fsdp_for_fit() is not None:
            return self._fsdp_step(batch, args, kwargs, k, batch_idx)
        ddp = self._ddp_for_window()
        if ddp is not None:
            self._ddp = self._sync_off(ddp)
        if k <= 1:
            units = batch_units(batch)
            self.guard.micro_batch_rows.append(units)  # every forward tried, a failed one included
            failure = None
            try:
                self._phase = "forward"
                out = self._step(batch, args, kwargs)
                self.rows_this_step += units
                return out
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                failure = _without_frames(exc)
            k = self._after_oom(failure, 1, units)
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
        """The batch in k micro-batches: the non-final ones' forward and backward here, the final
        one's forward returned for Lightning's backward. A forward OOM redoes the rows not yet
        processed at a doubled k; a backward OOM redoes the window (the earlier batches by
        memguard, this one from its first row)."""
        trainer, pl_module = self.trainer, self.pl_module
        orig = self.orig_training_step
        try:
            sp = self.splitter(batch)
        except ValueError:
            self._count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        accum = self._accum()
        optimizer = self._optimizer()
        if self.zero_grad_coming(batch_idx):
            # Lightning would zero after this training_step, wiping the chunks' gradients: zero now
            self.orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
            self._zero_armed_for = batch_idx
        recorder = _LogRecorder(pl_module.log)
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
                        with torch.no_grad() if self._pending is not None else contextlib.nullcontext():
                            out = self._step(chunk, args, kwargs)
                        loss = _loss_of(out)
                        if u1 == sp.units:
                            recorder.end_chunk(w, commit=True)
                            self.rows_this_step += units
                            pl_module.__dict__.pop("log", None)
                            recorder.flush()
                            if loss is None:
                                return out
                            total = loss * w if earlier is None else loss * w + earlier
                            return _with_loss(out, total)
                        if loss is not None:
                            self._chunk_grads_for = batch_idx
                            if self._pending is None:
                                self._chunk_backward(loss * (w / accum), optimizer)
                            part = loss.detach() * w
                            earlier = part if earlier is None else earlier + part
                        out = loss = None
                        recorder.end_chunk(w, commit=True)
                        self.rows_this_step += units
                        start = u1
                except Exception as exc:
                    recorder.end_chunk(0.0, commit=False)
                    if not is_oom_error(exc):
                        raise
                    failure = _without_frames(exc)
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
                recorder = _LogRecorder(recorder.real_log)
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

    # ------------------------------------------------------------------ the optimizer
    def prepare_optimizers(self) -> None:
        """Before the first forward: allocate the optimizers' lazy states and wrap each ``step`` so
        an out-of-memory error inside the update itself ends in ``WindowOOMError`` with the plan
        (``memguard_core.optim_state.prepare_optimizer``; the closure Lightning passes, training_step
        and backward, keeps its own handling). Never raises."""
        rows = lambda: max([batch_units(b) for b, _, _ in self._window] + [1])  # noqa: E731
        for opt in list(getattr(self.trainer, "optimizers", None) or []):
            prepare_optimizer(opt, self.guard, rows, is_oom_error)
