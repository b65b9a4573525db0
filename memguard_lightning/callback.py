"""Lightning integration: ``L.Trainer(callbacks=[MemGuardCallback()])``.

:class:`MemGuardCallback` runs the guard lifecycle (``memguard_core.guard.Guard``,
docs/lifecycle.md) in Lightning's hooks: the preflight at the first batch, the monitor, each batch
cut in place into k micro-batches inside automatic optimization (``memguard_lightning.step``), the
out-of-memory retry and window redo (under DDP, FSDP2 and FSDP1 too), the evaluation split
(``memguard_lightning.eval``), the figures in Lightning's loggers and the guard's state in the
checkpoint (``state_dict``, taken back on a resume: ``memguard_lightning.resume``). Manual optimization,
DeepSpeed and FSDP1 with parameter offload are not split (a warning says what to do instead;
:meth:`MemGuardCallback.chunks` serves manual optimization). docs/lightning.md tells what is
survived, how the step runs, and the limits. Lightning-private names are in
``memguard_lightning._compat``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterator, Optional, Tuple

from lightning.pytorch.callbacks import Callback

from memguard_torch import train_reading as tt
from memguard_core.errors import ConfigError
from memguard_core.guard import Guard, GuardAttributes
from memguard_core.options import GuardOptions, option_kwargs, with_guard_options
from memguard_core.preflight import Preflight
from memguard_torch import _compat as torch_compat
from memguard_torch.preflight_probe import measure_fn

from . import _compat
from .batch import LabelKey, batch_units
from .eval import GuardedEval, eval_split_reason
from .preflight import read_specs
from .resume import guard_state_dict, restore_guard_state
from .specs import find_model
from .step import GuardedStep

logger = logging.getLogger("memguard.lightning")


def plan_hint(automatic_optimization: bool) -> str:
    """How a user applies a planned micro-batch change the callback cannot make in place, for the
    preflight's warning: under automatic optimization the dataloader's batch size and
    ``accumulate_grad_batches``; under manual optimization, which Lightning runs without
    ``accumulate_grad_batches`` (it refuses the setting), ``guard.chunks(batch)`` in the training
    step, which cuts each batch into the planned micro-batches."""
    if automatic_optimization:
        return ": set the dataloader's batch_size and Trainer(accumulate_grad_batches=...) to these numbers"
    return (": under manual optimization, cut each batch in training_step with `for chunk, weight in "
            "guard.chunks(batch)`, which runs the planned micro-batches (Lightning refuses "
            "accumulate_grad_batches there)")


class MemGuardCallback(GuardAttributes, Callback):
    """Memory guard for ``lightning.pytorch.Trainer``.

    Args:
        budget_bytes: memory the training process may use (bytes). Default: (process RSS or device
            memory in use + available) x ``safety_ratio`` at the first batch, container-aware.
        safety_ratio: fraction of the memory available that the budget takes (default 0.8).
        thresholds: ``memguard_core.monitor.Thresholds`` (warning / critical / emergency).
        seq_length: tokens per row for the preflight (default: see ``memguard_lightning.specs``).
        apply: what preflight may change in place: ``grad_checkpoint``, ``micro_batch``.
        fail_fast: raise ``DoesNotFitError`` before the first step when the plan needs a change that
            cannot be applied in place (sequence length, LoRA rank / layers) or nothing fits.
        loss_weighting: ``auto`` | ``tokens`` | ``rows`` (see the module docstring).
        label_key: where the labels are in the batch: a key of a dict batch or an index into a
            tuple batch (default: ``labels``, or the last element of a tuple).
        shift_labels: the loss shifts labels by one (causal LM); ``None`` = auto.
        eval_micro_batches: micro-batches each validation / test / predict batch is cut into at
            the start (>= 1, default 1); doubled after an out-of-memory error in one.
        micro_batches: micro-batches each batch is cut into from the start (>= 1); default
            ``MEMGUARD_MICRO_BATCHES`` in the environment, else 1.
        monitor_interval_s: background sampling period in seconds (0 disables the thread).
        device: which memory to probe (``auto`` | ``cpu`` | ``cuda`` | ``cuda:<i>`` | ``mps``).
        preflight: run the preflight before the first step (default True).
        grow: when the micro-batches per batch may halve again after pressure has gone
            (``memguard_core.monitor.GrowPolicy``; ``None``: never).

    Attributes (the guard's, see ``memguard_core.guard.Guard``): ``guard``, ``monitor``,
    ``preflight``, ``events``, ``micro_batch_rows``, ``samples_per_step``, ``oom_retries``,
    ``split_disabled_reason``, ``summary``, ``budget_bytes``; ``step``: the in-step split
    (``memguard_lightning.step.GuardedStep``); ``evals``: the evaluation split
    (``memguard_lightning.eval.GuardedEval``).

    Raises:
        ConfigError: invalid arguments.
    """

    @with_guard_options
    def __init__(self, *, label_key: LabelKey = None, shift_labels: Optional[bool] = None,
                 **options: Any):
        options = GuardOptions.from_kwargs(**option_kwargs(
            options, own=("label_key", "shift_labels")))
        if label_key is not None and (isinstance(label_key, bool) or not isinstance(label_key, (str, int))):
            raise ConfigError("label_key", "a dict key (str), a tuple index (int) or None", label_key)
        if shift_labels is not None and not isinstance(shift_labels, bool):
            raise ConfigError("shift_labels", "True, False or None (auto)", shift_labels)
        _compat.check_version()
        self.options = options
        self.guard = Guard(options, log=logger)
        self.step = GuardedStep(self.guard, options, label_key=label_key, shift_labels=shift_labels)
        self.evals = GuardedEval(self.step, options.eval_micro_batches)
        self.trainer = None
        self.pl_module = None
        self._started = False


    # ------------------------------------------------------------------ setup / teardown
    def setup(self, trainer, pl_module, stage: str) -> None:
        self.step.trainer, self.step.pl_module = trainer, pl_module
        why_not = eval_split_reason(trainer)
        if why_not is None:
            self.evals.install(pl_module)
        else:
            logger.warning("memguard: evaluation batches are not split: %s", why_not)
        if stage != "fit":
            return
        self.trainer, self.pl_module = trainer, pl_module
        self._started = False  # a new fit: preflight and monitor again at its first batch
        reason = self._why_no_split(trainer, pl_module)
        if reason is not None:
            self.guard.split_disabled_reason = reason
            logger.warning("memguard: in-place micro-batching is off: %s", reason)
            return
        step = self.step
        if step.orig_training_step is None:
            # under FSDP1 the module's training_step runs inside the root FSDP forward (Lightning's
            # forward redirection); each micro-batch must be a root forward of its own, so the
            # strategy's training_step is the one wrapped there
            owner = trainer.strategy if _is_fsdp1_strategy(trainer.strategy) else pl_module
            step.step_owner = owner
            step.orig_training_step = owner.training_step
            step.orig_zero_grad = pl_module.optimizer_zero_grad
            step.orig_backward = pl_module.backward

            def training_step(batch, *args, **kwargs):
                return self._guarded_training_step(batch, *args, **kwargs)

            def optimizer_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs):
                return self._guarded_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs)

            # functools: Lightning reads the signature of the original through __wrapped__
            owner.training_step = functools.update_wrapper(training_step, step.orig_training_step)
            pl_module.optimizer_zero_grad = functools.update_wrapper(optimizer_zero_grad, step.orig_zero_grad)

            def backward(loss, *args, **kwargs):
                return step.backward(loss, *args, **kwargs)

            pl_module.backward = functools.update_wrapper(backward, step.orig_backward)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.evals.uninstall(pl_module)
        if stage != "fit":
            return
        self.guard.stop()
        self._uninstall(pl_module)

    def _uninstall(self, pl_module) -> None:
        """The module's (and under FSDP1 the strategy's) methods back to their own, FSDP's comms
        back to FSDP's."""
        if self.step.orig_training_step is not None:
            for name in ("training_step", "optimizer_zero_grad", "backward"):
                pl_module.__dict__.pop(name, None)  # back to the class's methods
            if self.step.step_owner is not None:
                self.step.step_owner.__dict__.pop("training_step", None)
            self.step.orig_training_step = self.step.orig_zero_grad = self.step.orig_backward = None
            self.step.step_owner = None
        self.step.release()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning runs no teardown hook after an exception: take memguard's wrappers and FSDP
        # hooks off here, so a later fit of the same module and strategy starts clean
        self.guard.stop()
        try:
            self.evals.uninstall(pl_module)
            self._uninstall(pl_module)
        except Exception:
            logger.debug("memguard: could not take the wrappers off after the exception", exc_info=True)

    @staticmethod
    def _why_no_split(trainer, pl_module) -> Optional[str]:
        strategy = trainer.strategy
        name = type(strategy).__name__
        if not pl_module.automatic_optimization:
            return ("manual optimization: the training_step owns the backward. Split it yourself with the "
                    "guard's k: `for chunk, weight in guard.chunks(batch): "
                    "self.manual_backward(loss_of(chunk) * weight)`")
        if getattr(strategy, "handles_gradient_accumulation", False) or "DeepSpeed" in name:
            return ("DeepSpeed counts micro-steps inside its engine; extra backward calls would break its "
                    "gradient accumulation. Apply memguard's plan instead: dataloader batch_size / k and "
                    "accumulate_grad_batches x k (logged by the preflight)")
        if _is_fsdp1_strategy(strategy) and getattr(getattr(strategy, "cpu_offload", None), "offload_params", False):
            return (f"{torch_compat.FSDP1_OFFLOAD_NO_SPLIT}. Apply memguard's plan instead: dataloader "
                    "batch_size / k and accumulate_grad_batches x k (logged by the preflight)")
        if "FSDP" in name and not _is_fsdp1_strategy(strategy):
            return ("an FSDP strategy memguard does not know (%s). Apply memguard's plan instead: dataloader "
                    "batch_size / k and accumulate_grad_batches x k (logged by the preflight)" % name)
        return None

    # ------------------------------------------------------------------ start (first batch)
    def _start(self, trainer, pl_module, batch) -> None:
        self._started = True
        opts = self.options
        can_checkpoint = tt.checkpoint_target(find_model(pl_module)) is not None
        self.guard.start(
            rows=batch_units(batch),
            read_specs=lambda: read_specs(trainer, pl_module, batch, seq_length=opts.seq_length, device=opts.device),
            enable_checkpointing=(lambda: tt.enable_activation_checkpointing(find_model(pl_module)))
            if can_checkpoint else None,
            plan_hint=plan_hint(pl_module.automatic_optimization),
            measure=measure_fn(find_model(pl_module), batch, step_context=_compat.forward_context(trainer)))
        self._restore_eval_split()
        if self.guard.preflight is not None:
            self._log_preflight(trainer, self.guard.preflight)
        if self.step.orig_training_step is not None:
            self.step.prepare_optimizers()

    def _log_preflight(self, trainer, pf: Preflight) -> None:
        params = {"memguard/budget_bytes": int(pf.budget_bytes),
                  "memguard/estimated_peak_bytes": int(pf.estimate.peak_bytes),
                  "memguard/planned_peak_bytes": int(pf.best_peak_bytes),
                  "memguard/planned_micro_batches": int(pf.micro_batches),
                  "memguard/changes": "; ".join(c.reason for c in pf.applied + pf.not_applied) or "none"}
        for lg in getattr(trainer, "loggers", None) or []:
            try:
                lg.log_hyperparams(params)
            except Exception:
                logger.debug("memguard: logger %s refused the preflight figures", type(lg).__name__, exc_info=True)

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._started:
            self._start(trainer, pl_module, batch)
        if self.step.orig_training_step is None and self.guard.monitor is not None:
            # not splitting (manual optimization, DeepSpeed, FSDP1 offload): still sample memory and count
            # rows per optimizer step
            self.guard.monitor.step_sample(trainer.global_step)
            self.step.rows_this_step += batch_units(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.guard.samples_per_step.append(self.step.rows_this_step)
        self.step.rows_this_step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step.end_batch()
        mon = self.guard.monitor
        if mon is None:
            return
        # after the batch that ended an optimizer step (global_step moved on): close its record
        # now, so that the figures logged below are this step's (a no-op inside a window)
        self.guard.end_step(trainer.global_step)
        if not self._should_log(trainer):
            return
        # the standard per-step figures (memguard_core.observe.FIGURE_NAMES) as memguard/<name>;
        # micro_batches: the k the step ran with (the current k before the first record)
        metrics = {"memguard/micro_batches": float(mon.micro_batches)}
        metrics.update({"memguard/" + k[len("memguard_"):]: float(v) for k, v in self.guard.figures.items()})
        metrics["memguard/events"] = float(len(self.guard.events))
        try:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False,
                               logger=bool(getattr(trainer, "loggers", None)),
                               batch_size=max(1, batch_units(batch)))
        except Exception:
            logger.debug("memguard: could not log to Lightning", exc_info=True)

    @staticmethod
    def _should_log(trainer) -> bool:
        """Log the memory figures only on the batches whose metrics Lightning writes to its loggers
        (its ``log_every_n_steps`` rule; a value logged on another batch would not be written, and
        each ``log_dict`` call costs Lightning bookkeeping). Events go to Python logging when they
        happen."""
        if not getattr(trainer, "loggers", None):
            return False          # prog_bar=False: nothing would show these figures
        return _compat.should_update_logs(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        self.evals.end_loop()

    on_test_end = on_predict_end = on_validation_end

    def on_train_end(self, trainer, pl_module) -> None:
        self.guard.finish(trainer.global_step, split_disabled=self.guard.split_disabled_reason)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        """The guard's state for Lightning's checkpoint (saved under this callback's ``state_key``):
        ``memguard_core.guard_state.GuardState.to_dict``; {} before the first batch."""
        return guard_state_dict(self.guard, self.trainer, self.evals.micro_batches)

    def load_state_dict(self, state_dict: dict) -> None:
        """Lightning restores a checkpoint (``fit(ckpt_path=...)``, before the first batch): the saved
        state is taken back at the start instead of the preflight deciding again. A state that is
        not usable is logged and ignored. A ``validate`` / ``test`` / ``predict`` checkpoint is passed
        over (no fit starts from it)."""
        trainer = self.step.trainer
        fn = getattr(getattr(trainer, "state", None), "fn", None)
        if getattr(fn, "value", fn) == "fit":
            restore_guard_state(self.guard, state_dict, getattr(trainer, "ckpt_path", None))

    def _restore_eval_split(self) -> None:
        back = self.guard.restored
        if back is not None and back.eval_micro_batches is not None:
            self.evals.micro_batches = max(self.evals.micro_batches, back.eval_micro_batches)

    # ------------------------------------------------------------------ the guarded step
    def chunks(self, batch: Any) -> Iterator[Tuple[Any, float]]:
        """Yield ``(chunk_batch, loss_weight)`` for the guard's current k (rank-agreed), for
        training steps that do their own backward (manual optimization); see
        ``memguard_lightning.step.GuardedStep.chunks``."""
        return self.step.chunks(batch)

    def _guarded_training_step(self, batch, *args, **kwargs):
        return self.step.training_step(batch, *args, **kwargs)

    def _guarded_zero_grad(self, epoch, batch_idx, optimizer, *args, **kwargs):
        return self.step.zero_grad(epoch, batch_idx, optimizer, *args, **kwargs)


def _is_fsdp1_strategy(strategy: Any) -> bool:
    """Lightning's ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``) or a subclass of it."""
    try:
        from lightning.pytorch.strategies import FSDPStrategy
    except Exception:
        return False
    return isinstance(strategy, FSDPStrategy)
