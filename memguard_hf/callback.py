"""Hugging Face ``Trainer`` integration: ``trainer.add_callback(MemGuardCallback())``.

:class:`MemGuardCallback` runs the guard lifecycle (``memguard_core.guard.Guard``,
docs/lifecycle.md) in the Trainer's events: the preflight at ``on_train_begin``, the monitor,
``trainer.training_step`` wrapped to cut each batch into k weighted micro-batches (a subclass's
``compute_loss`` still applies), the out-of-memory retry and accumulation-window redo (under DDP,
FSDP2 and FSDP1 too: docs/hf_fsdp.md), and ``trainer.prediction_step`` wrapped for the evaluation
split (``memguard_hf.eval``, docs/evaluation.md). The dataloader, accumulation, scheduler and step
counters are untouched; the guard's state is saved in each checkpoint folder and taken back on a
resume (``memguard_hf.resume``). HF passes no trainer to callbacks: the callback finds it on the call stack,
or :meth:`MemGuardCallback.attach` names it (docs/design.md). Transformers-private names are in
``memguard_hf._compat``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from transformers import TrainerCallback

from memguard_torch import train_reading as tt
from memguard_torch.preflight_probe import measure_fn
from memguard_core.guard import Guard, GuardAttributes
from memguard_core.monitor import MemoryEvent
from memguard_core.options import GuardOptions, option_kwargs, with_guard_options

from . import _compat
from .preflight import probe_batch, read_specs
from .resume import restore_guard_state, save_guard_state
from .eval import GuardedEval
from .loss_weights import LossWeights
from .step import GuardedStep, is_oom_error  # noqa: F401  (is_oom_error: public here too)

logger = logging.getLogger("memguard.hf")


class MemGuardCallback(GuardAttributes, GuardedStep, GuardedEval, TrainerCallback):
    """Memory guard for ``transformers.Trainer`` (and subclasses: TRL ``SFTTrainer``, Unsloth).

    Args:
        budget_bytes: memory the training process may use (bytes). Default: (process RSS or
            device memory in use + available) x ``safety_ratio`` at train start, container-aware.
        safety_ratio: fraction of the memory available that the budget takes (default 0.8).
        thresholds: ``memguard_core.monitor.Thresholds`` (warning/critical/emergency).
        seq_length: tokens per row for the preflight; default: ``args.max_length`` /
            ``max_seq_length`` if set, else the longest of the first 2048 training rows.
        apply: what preflight may change in place: ``grad_checkpoint``, ``micro_batch``.
        fail_fast: raise ``DoesNotFitError`` at train start when the plan needs a change that
            cannot be applied in place (sequence length, LoRA rank/layers) or nothing fits.
        loss_weighting: ``auto`` (token share when the loss is a token mean, else none needed),
            ``tokens`` or ``rows`` (per-sample mean losses).
        micro_batches: micro-batches each batch is cut into from the start (>= 1); default
            ``MEMGUARD_MICRO_BATCHES`` in the environment (``memguard run`` sets it after an OOM
            kill), else 1.
        eval_micro_batches: micro-batches each ``evaluate()`` / ``predict()`` batch is cut into at
            the start (>= 1, default 1); doubled after an out-of-memory error in one.
        monitor_interval_s: background sampling period (0 disables the thread).
        device: which memory to probe (``auto`` | ``cpu`` | ``cuda`` | ``cuda:<i>`` | ``mps``).
        preflight: run the preflight at train start (default True).
        grow: when the micro-batches per batch may halve again after pressure has gone
            (``memguard_core.monitor.GrowPolicy``; ``None``: never). Also settable as
            ``callback.grow`` before ``train()``.

    Attributes (the guard's, see ``memguard_core.guard.Guard``): ``guard``, ``monitor``,
    ``preflight``, ``events``, ``micro_batch_rows``, ``samples_per_step``, ``oom_retries``,
    ``split_disabled_reason``, ``summary``, ``budget_bytes``; ``oom_errors`` (the out-of-memory
    errors caught on this rank under FSDP2 or FSDP1, ``type: message``, a peer's as
    ``PeerOutOfMemoryError``). The evaluation split's
    (``memguard_hf.eval.GuardedEval``): ``eval_micro_batches`` and ``split_evaluation`` (settable),
    ``eval_oom_retries``, ``eval_micro_batch_rows``.

    Raises:
        ConfigError: invalid arguments.
    """

    @with_guard_options
    def __init__(self, **options: Any):
        options = GuardOptions.from_kwargs(**option_kwargs(options))
        _compat.check_version()
        self.guard = Guard(options, log=logger, on_event=self.on_event_log)
        self.options = options
        self.trainer = None
        self._orig_training_step = None
        self._orig_compute_loss = None
        self._loss_scale = 1.0
        self._rows_this_step = 0
        self._rows_resolved = 0
        self._oom_in_forward = False
        self._orig_get_batch_samples = None
        self._window = None            # the batches of the current accumulation window (HF's get_batch_samples)
        self._window_pos = 0           # training_step calls made in it
        self._window_redos = 0
        self._states_ready = False
        self.oom_errors = []
        self._init_eval()

    # ------------------------------------------------------------------ attaching to the trainer
    @classmethod
    def attach(cls, trainer, **kwargs) -> "MemGuardCallback":
        """Create a callback, add it to ``trainer`` and bind it (no stack walk needed).

        Returns the callback.
        """
        cb = cls(**kwargs)
        trainer.add_callback(cb)
        cb.bind(trainer)
        return cb

    def bind(self, trainer) -> None:
        """Bind to ``trainer``: wrap its ``training_step`` / ``compute_loss`` / ``prediction_step``
        on the instance.

        Idempotent. Moves this callback to the front of the handler so that the memory figures
        it adds in ``on_log`` reach the printer and the reporting integrations.
        """
        if self.trainer is trainer:
            return
        self.trainer = trainer
        self._loss_rules = LossWeights(trainer, self.options.loss_weighting)
        _compat.move_callback_first(trainer, self)
        self._orig_training_step = trainer.training_step
        self._orig_compute_loss = trainer.compute_loss
        trainer.training_step = self._guarded_training_step
        trainer.compute_loss = self._weighted_compute_loss
        self._bind_eval(trainer)
        if callable(getattr(trainer, "get_batch_samples", None)):
            self._orig_get_batch_samples = trainer.get_batch_samples
            trainer.get_batch_samples = self._recording_get_batch_samples
        if "DEEPSPEED" in self._distributed_type():
            self.guard.split_disabled_reason = (
                "DeepSpeed counts micro-steps inside its engine; extra backward calls would break its "
                "gradient accumulation. Use memguard's preflight plan (per_device_train_batch_size / "
                "gradient_accumulation_steps) instead.")
            logger.warning("memguard: in-place micro-batching disabled under DeepSpeed: %s",
                           self.guard.split_disabled_reason)

    def _recording_get_batch_samples(self, epoch_iterator, num_batches, *args, **kwargs):
        """``Trainer.get_batch_samples``, keeping references to the window's batches (already in
        memory: the Trainer prefetches them) so a window can be redone without drawing from the
        dataloader again."""
        out = self._orig_get_batch_samples(epoch_iterator, num_batches, *args, **kwargs)
        try:
            self._window = list(out[0])
        except Exception:
            self._window = None
        self._window_pos = 0
        self._window_redos = 0
        return out

    def _distributed_type(self) -> str:
        return str(getattr(getattr(self.trainer, "accelerator", None), "distributed_type", ""))

    def _find_trainer(self):
        frame = inspect.currentframe()
        try:
            while frame is not None:
                obj = frame.f_locals.get("self")
                handler = getattr(obj, "callback_handler", None)
                if handler is not None and self in getattr(handler, "callbacks", ()) and hasattr(obj, "training_step"):
                    return obj
                frame = frame.f_back
        finally:
            del frame
        return None

    def _ensure_bound(self) -> bool:
        if self.trainer is None:
            trainer = self._find_trainer()
            if trainer is None:
                logger.warning("memguard: could not find the Trainer from the callback; use "
                               "MemGuardCallback.attach(trainer). Guard inactive.")
                return False
            self.bind(trainer)
        return True

    # ------------------------------------------------------------------ callback events
    def on_init_end(self, args, state, control, **kwargs):
        self._ensure_bound()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self._ensure_bound():
            return
        trainer, opts = self.trainer, self.options
        refusal = self._loss_rules.refusal()
        if refusal is not None and self.guard.split_disabled_reason is None:
            self.guard.split_disabled_reason = refusal
            logger.warning("memguard: in-place micro-batching disabled: %s", refusal)
        can_checkpoint = tt.checkpoint_target(trainer.model) is not None
        # a resumed run takes back what the guard decided before (memguard_hf.resume)
        restore_guard_state(self.guard, trainer, args, state)
        self.guard.start(rows=args.per_device_train_batch_size,
                         read_specs=lambda: read_specs(trainer, seq_length=opts.seq_length, device=opts.device),
                         enable_checkpointing=(lambda: tt.enable_activation_checkpointing(trainer.model))
                         if can_checkpoint else None,
                         plan_hint=": set per_device_train_batch_size and gradient_accumulation_steps "
                                   "to these numbers",
                         measure=measure_fn(tt.unwrap(trainer.model), lambda: probe_batch(trainer),
                                            step_context=trainer.compute_loss_context_manager))
        back = self.guard.restored
        if back is not None and back.eval_micro_batches is not None:
            self.eval_micro_batches = max(self.eval_micro_batches, back.eval_micro_batches)

    def on_save(self, args, state, control, **kwargs):
        # the checkpoint folder is written: the guard's state goes in beside it
        save_guard_state(self.guard, args, state, eval_micro_batches=self.eval_micro_batches)

    def on_step_begin(self, args, state, control, **kwargs):
        self._rows_this_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        # packed batches on an accelerator were counted on the device (no sync per micro-batch):
        # resolved here, once per optimizer step
        self.guard.samples_per_step.append(int(self._rows_this_step))
        fr = self.guard.micro_batch_rows
        for i in range(self._rows_resolved, len(fr)):
            if not isinstance(fr[i], int):
                fr[i] = int(fr[i])
        self._rows_resolved = len(fr)
        # the optimizer step is done: close its record now, so that on_log (next, in
        # _maybe_log_save_evaluate) adds this step's figures and not the step before's
        self.guard.end_step(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self.monitor is None:
            return
        figs = self.figures()
        logs.update(figs)
        # Trainer.log appends its own copy of ``logs`` to ``state.log_history`` before the callbacks
        # run: add the figures to that entry too, so trainer_state.json keeps them
        hist = getattr(state, "log_history", None)
        if hist and isinstance(hist[-1], dict) and hist[-1].get("step") == state.global_step:
            hist[-1].update(figs)

    def figures(self) -> dict:
        """The memory figures this callback adds to every log line (and to ``log_history``): the
        last optimizer step's (``memguard_core.observe.FIGURE_NAMES``: peak, current, budget in GiB,
        usage, micro-batches per batch; reserved GiB, ``num_alloc_retries``, ``num_ooms`` on CUDA),
        plus ``memguard_max_usage`` over the run so far. {} before training starts."""
        mon = self.monitor
        if mon is None:
            return {}
        # micro-batches: the k the step ran with (the current k before the first step's record)
        return {"memguard_micro_batches": int(mon.micro_batches), **self.guard.figures}

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_fsdp_hooks()
        self.guard.finish(state.global_step, eval_oom_retries=self.eval_oom_retries,
                          eval_micro_batches=self.eval_micro_batches)

    def on_event_log(self, event: MemoryEvent) -> None:  # pragma: no cover - override hook
        """Called with every ``MemoryEvent`` (possibly on the monitor's thread); override to forward
        events elsewhere. They are already in ``events``."""
