"""The Lightning adapter's training step: each batch cut in place into k micro-batches inside
Lightning's automatic optimization, an out-of-memory error re-cut or the accumulation window redone.
``GuardedStep`` is what ``MemGuardCallback`` wraps ``training_step`` / ``optimizer_zero_grad`` /
``backward`` with; it keeps what every strategy shares and, at the fit's first guarded training
batch, chooses the strategy that runs the batches (``choose_strategy``: ``step_plain``,
``step_ddp``, ``step_fsdp``). See docs/lightning.md, "How the step runs"."""

from __future__ import annotations

import logging
from typing import Any, Iterator, List, Optional, Tuple

import torch

from memguard_torch.distributed import flag_group
from memguard_core.guard import Guard
from memguard_torch.optim_state import prepare_optimizer
from memguard_core.options import GuardOptions
from memguard_torch import _compat as torch_compat
from memguard_torch.oom import is_oom_error
from memguard_torch.sync import Fsdp1SyncHooks, FsdpSyncHooks, OomSync
from memguard_torch.train_reading import peft_base

from . import _compat
from .batch import LabelKey, LightningBatchSplitter, batch_units
from .specs import find_model
from .step_base import StrategyStep
from .step_ddp import DdpStep
from .step_fsdp import Fsdp1Step, Fsdp1UnsyncedStep, FsdpStep
from .step_plain import PlainStep

logger = logging.getLogger("memguard.lightning")

__all__ = ["GuardedStep", "choose_strategy"]


def choose_strategy(fit: "GuardedStep") -> StrategyStep:
    """The strategy of the fit's training step, chosen at its first guarded training batch (on every
    rank alike: the flag group is made collectively), when the strategy has wrapped the model:

    * FSDP1 (``training_step`` wrapped on ``FSDPStrategy`` and its model holds FSDP1 modules):
      ``Fsdp1Step``, in one process without flags, on several ranks with ``Fsdp1SyncHooks``; where
      they cannot be installed (a hybrid sharding strategy, a communication hook of the user's)
      ``Fsdp1UnsyncedStep`` and a warning.
    * several ranks and ``fully_shard`` modules: ``FsdpStep`` with ``FsdpSyncHooks``; with tensor
      parallelism under ``ModelParallelStrategy`` (no sync points) ``DdpStep`` and a warning.
    * several ranks otherwise: ``DdpStep`` (memguard's gradient average under plain DDP).
    * one process: ``PlainStep``.
    """
    trainer = fit.trainer
    strategy = trainer.strategy
    several = int(getattr(trainer, "world_size", 1) or 1) > 1
    root = getattr(strategy, "model", None)
    if fit.step_owner is strategy and torch_compat.fsdp1_modules(root):
        if not several:
            # one process: no flags to exchange, but the same step (an aborted FSDP1 backward is
            # reset before the window is redone)
            return Fsdp1Step(fit, root, OomSync(None))
        sync = OomSync(flag_group())
        hooks = Fsdp1SyncHooks(root, sync)
        if hooks.installed:
            return Fsdp1Step(fit, root, sync, hooks)
        logger.warning("memguard: FSDP1 without OOM sync points (a hybrid sharding strategy or a "
                       "communication hook of its own): an out-of-memory error is raised, not "
                       "redone")
        return Fsdp1UnsyncedStep(fit, root)
    if several and torch_compat.fsdp_modules(fit.pl_module):
        tp = _compat.tensor_parallel_size(strategy)
        if "ModelParallel" in type(strategy).__name__ and tp != 1:
            # tensor-parallel collectives have no sync points: an OOM is raised, not redone
            logger.warning("memguard: tensor parallelism (size %s) under ModelParallelStrategy: its "
                           "collectives have no OOM sync points, so an out-of-memory error is raised, "
                           "not redone", tp if tp is not None else "unknown")
            return DdpStep(fit)
        sync = OomSync(flag_group())
        return FsdpStep(fit, fit.pl_module, sync, FsdpSyncHooks(fit.pl_module, sync))
    if several:
        return DdpStep(fit)
    return PlainStep(fit)


class GuardedStep:
    """The in-step split and the window redo of one Lightning fit: the wrapped methods' entry
    points and the state every strategy shares (the window's kept batches, the splitter, the
    zero_grad arming, the counters); the batches run in ``strategy``, chosen once per fit.

    Args:
        guard: the run's ``Guard`` (monitor, OOM re-split, window redo, micro-batch rows).
        options: the guard's options (``loss_weighting``).
        label_key, shift_labels: where the labels are and whether the loss shifts them (see
            ``MemGuardCallback``).

    Attributes: ``strategy`` (the fit's ``StrategyStep``; None before its first guarded training
    batch), ``window_redos`` (redos of the current accumulation window), ``ddp_averages`` (windows
    whose gradients memguard averaged over the DDP ranks itself), ``rows_this_step``,
    ``oom_errors`` (out-of-memory errors met under FSDP: this rank's, or a peer's).
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
        self.strategy: Optional[StrategyStep] = None
        self.rows_this_step = 0
        self.window_redos = 0          # redos of the current accumulation window
        self.ddp_averages = 0          # windows whose gradients memguard averaged over the DDP ranks
        self.zero_armed_for: Optional[int] = None   # memguard zeroed before this batch: skip Lightning's
        self.chunk_grads_for: Optional[int] = None  # this batch's non-final chunks hold gradients
        self.window: List[tuple] = []   # (batch, args, kwargs) of the window's batches so far
        self.window_ok = False          # the window's batches are all kept, in Lightning's order
        self.own_backward = False       # a backward memguard runs (its errors are handled where it runs)
        self.oom_errors: List[str] = []  # out-of-memory errors met under FSDP (this rank's, or a peer's)

    # ------------------------------------------------------------------ bookkeeping
    def end_batch(self) -> None:
        """After a batch: check that Lightning's zero_grad came where its rule said it would."""
        if self.strategy is not None:
            self.strategy.end_batch()
        if self.zero_armed_for is not None:
            self.zero_armed_for = None
            self.disable_split("Lightning did not zero the gradients after training_step on a batch where "
                               "its rule says it would; the gradients of the earlier batches of this "
                               "accumulation window were cleared too early")
        self.chunk_grads_for = None

    def chunks(self, batch: Any) -> Iterator[Tuple[Any, float]]:
        """Yield ``(chunk_batch, loss_weight)`` for the guard's current k (rank-agreed), for
        training steps that do their own backward (manual optimization)::

            for chunk, w in guard.chunks(batch):
                self.manual_backward(self.compute_loss(chunk) * w)

        The weights sum to 1 (see ``loss_weighting``); with k = 1 the batch itself comes back with
        weight 1.0. Rows of each chunk are recorded in the guard's ``micro_batch_rows``.
        """
        mon = self.guard.monitor
        k = self.guard.agreed(mon.micro_batches if mon is not None else self.options.micro_batches)
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
        base = peft_base(model)
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

    def zero_grad_coming(self, batch_idx: int) -> bool:
        """Lightning's rule (``_AutomaticOptimization._make_zero_grad_fn``): it zeroes after the
        ``training_step`` of the first batch of each accumulation window, unless it skips the
        backward."""
        if _compat.skip_backward(self.trainer):
            return False
        return batch_idx % self.trainer.accumulate_grad_batches == 0

    def accum(self) -> int:
        """Lightning's ``accumulate_grad_batches`` (at least 1)."""
        return max(1, int(self.trainer.accumulate_grad_batches))

    def optimizer(self):
        """The fit's (first) optimizer, None before it has one."""
        return self.trainer.optimizers[0] if self.trainer.optimizers else None

    def count(self, units: int) -> None:
        """A batch run whole, outside the split: its rows counted."""
        self.guard.micro_batch_rows.append(units)
        self.rows_this_step += units

    # ------------------------------------------------------------------ the window
    def _remember(self, batch, args, kwargs, batch_idx: int) -> None:
        """Keep a reference to this batch (already in memory: Lightning fetched and moved it) as
        the next batch of the accumulation window, which starts where Lightning's zero_grad rule
        says (``batch_idx % accumulate_grad_batches == 0``)."""
        pos = batch_idx % self.accum()
        if pos == 0:
            self.window = []
            self.window_ok = True
            self.window_redos = 0
        self.window_ok = self.window_ok and len(self.window) == pos
        self.window.append((batch, args, kwargs))

    def release(self) -> None:
        """Drop the kept window's batches and the fit's strategy (the fit has ended; the next fit
        chooses again)."""
        if self.strategy is not None:
            self.strategy.release()
        self.strategy = None
        self.window = []
        self.window_ok = False

    # ------------------------------------------------------------------ wrapped module methods
    def zero_grad(self, epoch, batch_idx, optimizer, *args, **kwargs):
        if self.zero_armed_for is not None and self.zero_armed_for == batch_idx:
            self.zero_armed_for = None  # memguard zeroed before this batch's first chunk
            return None
        if self.chunk_grads_for is not None and self.chunk_grads_for == batch_idx:
            self.disable_split("Lightning zeroed the gradients after training_step where its rule says "
                               "it would not; this batch's non-final chunks lost their gradients")
        return self.orig_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs)

    def backward(self, loss, *args, **kwargs):
        """``LightningModule.backward``: Lightning's own backward of the batch's (final micro-batch's)
        loss, handled by the fit's strategy (an out-of-memory error there redoes the window)."""
        if self.own_backward or self.strategy is None:
            return self.orig_backward(loss, *args, **kwargs)
        return self.strategy.backward(loss, *args, **kwargs)

    def training_step(self, batch, *args, **kwargs):
        trainer = self.trainer
        mon = self.guard.monitor
        orig = self.orig_training_step
        if self.strategy is not None:
            self.strategy.new_batch()
        if mon is None or trainer is None or not trainer.training:
            return orig(batch, *args, **kwargs)
        if self.guard.split_disabled_reason is not None:
            mon.step_sample(trainer.global_step)
            self.count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        k = self.guard.micro_batches_for_step(trainer.global_step)
        batch_idx = self._batch_idx(args, kwargs)
        self._remember(batch, args, kwargs, batch_idx)
        if self.strategy is None:
            self.strategy = choose_strategy(self)
        return self.strategy.training_step(batch, args, kwargs, k, batch_idx)

    @staticmethod
    def _batch_idx(args, kwargs) -> int:
        if "batch_idx" in kwargs:
            return int(kwargs["batch_idx"])
        if args and isinstance(args[0], int):
            return int(args[0])
        return 0

    # ------------------------------------------------------------------ the optimizer
    def prepare_optimizers(self) -> None:
        """Before the first forward: allocate the optimizers' lazy states and wrap each ``step`` so
        an out-of-memory error inside the update itself ends in ``WindowOOMError`` with the plan
        (``memguard_torch.optim_state.prepare_optimizer``; the closure Lightning passes, training_step
        and backward, keeps its own handling). Never raises."""
        rows = lambda: max([batch_units(b) for b, _, _ in self.window] + [1])  # noqa: E731
        for opt in list(getattr(self.trainer, "optimizers", None) or []):
            prepare_optimizer(opt, self.guard, rows, is_oom_error)
