"""Lightning integration: ``L.Trainer(callbacks=[MemGuardCallback()])``.

What it does (the HF adapter's features, the Lightning way):

* **Preflight** before the first forward (``on_train_batch_start`` of the first batch, the first
  moment the micro-batch and sequence length are known without iterating the dataloader, which
  would change the sampler's random order): ``ModelSpec`` from the ``LightningModule``'s model
  (PEFT / 4-bit aware), ``TrainSpec`` from the trainer (``memguard_lightning.preflight``), estimate,
  plan against the budget; activation checkpointing (HF models) and the micro-batch split are
  applied in place, the rest is reported with the exact change (or ``fail_fast`` raises).
* **Virtual micro-batches** (in-place split into k row-chunks) in automatic optimization, see
  "Design" below. ``trainer.accumulate_grad_batches``, the dataloader, ``num_training_batches``,
  the LR schedulers and ``global_step`` are never touched.
* **Runtime guard**: a ``MemoryMonitor`` samples at every batch (cheap counters) and in a
  background thread, cleans caches and doubles k under pressure.
* **OOM catch and retry**: an out-of-memory error (Lightning's own ``is_oom_error``: CUDA OOM,
  cuDNN's not-supported snafu, the CPU allocator's "can't allocate memory") raised in a chunk's
  *forward* frees memory, doubles k and redoes only the rows not yet processed (earlier chunks'
  gradients are already weighted for the whole batch). An OOM in a backward has already added part
  of a gradient and is re-raised; so is one in the final chunk's backward, which Lightning runs.
* **Ranks agree**: the k of each batch is all-reduced (MAX) at the start of ``training_step``, so
  every rank cuts alike. (After an OOM retry one rank may use a larger k for the rest of that
  batch; under DDP the non-final chunks run no collective, and the next batch agrees again.)
* Memory figures go to Lightning's loggers (``pl_module.log_dict`` on the batches Lightning writes,
  ``log_every_n_steps``: ``memguard/split``,
  ``memguard/usage``, ``memguard/peak_gib``, ``memguard/events``; the preflight's figures via
  ``logger.log_hyperparams``) and to Python logging (``memguard.lightning``).

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

Not split (a warning says so and what to do instead; preflight and the monitor still run):

* **manual optimization** (``automatic_optimization = False``): the user owns the backward. Use
  ``for chunk, weight in guard.chunks(batch): self.manual_backward(self.loss(chunk) * weight)``
  in ``training_step``: the chunks follow the guard's (rank-agreed) k.
* **DeepSpeed** (``strategy.handles_gradient_accumulation``): the engine counts micro-steps; extra
  backward calls would break its accumulation. Apply the plan instead: dataloader batch size / k,
  ``accumulate_grad_batches`` x k (the exact numbers are logged).
* **FSDP**: the chunks would run inside the root FSDP forward before its backward hooks exist;
  not validated here. Same alternative as DeepSpeed.

Environment: ``MEMGUARD_SPLIT=<k>`` sets the starting split factor.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.memory import is_oom_error

from memguard_core.distributed import agree_max
from memguard_core.errors import ConfigError, DoesNotFitError
from memguard_core.microbatch import split_after_oom
from memguard_core.monitor import MemoryEvent, MemoryMonitor, Thresholds
from memguard_core.preflight import Preflight

from .batch import LabelKey, LightningBatchSplitter, batch_units
from .preflight import find_model, run_preflight

logger = logging.getLogger("memguard.lightning")

from memguard_core.options import APPLY_CHOICES as _APPLY_CHOICES  # noqa: E402
from memguard_core.options import GuardOptions  # noqa: E402
from memguard_core.report import finish_guarded_run  # noqa: E402


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


class MemGuardCallback(Callback):
    """Memory guard for ``lightning.pytorch.Trainer``.

    Args:
        budget_bytes: memory the training process may use (bytes). Default: (process RSS or device
            memory in use + available) x ``safety_ratio`` at the first batch, container-aware.
        safety_ratio: fraction of the memory available that the budget takes (default 0.8).
        thresholds: ``memguard_core.monitor.Thresholds`` (warning / critical / emergency).
        seq_length: tokens per row for the preflight (default: see ``memguard_lightning.preflight``).
        apply: what preflight may change in place: ``grad_checkpoint``, ``micro_batch``.
        fail_fast: raise ``DoesNotFitError`` before the first step when the plan needs a change that
            cannot be applied in place (sequence length, LoRA rank / layers) or nothing fits.
        loss_weighting: ``auto`` | ``tokens`` | ``rows`` (see the module docstring).
        label_key: where the labels are in the batch: a key of a dict batch or an index into a
            tuple batch (default: ``labels``, or the last element of a tuple).
        shift_labels: the loss shifts labels by one (causal LM); ``None`` = auto.
        split: starting split factor k (>= 1); also ``MEMGUARD_SPLIT`` in the environment.
        monitor_interval_s: background sampling period in seconds (0 disables the thread).
        device: which memory to probe (``auto`` | ``cpu`` | ``cuda``).
        preflight: run the preflight before the first step (default True).

    Raises:
        ConfigError: invalid arguments.
    """

    def __init__(self, *, budget_bytes: Optional[int] = None, safety_ratio: float = 0.8,
                 thresholds: Optional[Thresholds] = None, seq_length: Optional[int] = None,
                 apply: Sequence[str] = _APPLY_CHOICES, fail_fast: bool = False,
                 loss_weighting: str = "auto", label_key: LabelKey = None,
                 shift_labels: Optional[bool] = None, split: Optional[int] = None,
                 monitor_interval_s: float = 0.5, device: str = "auto", preflight: bool = True):
        opts = GuardOptions.from_kwargs(
            budget_bytes=budget_bytes, safety_ratio=safety_ratio, thresholds=thresholds, seq_length=seq_length,
            apply=apply, fail_fast=fail_fast, loss_weighting=loss_weighting, split=split,
            monitor_interval_s=monitor_interval_s, device=device, preflight=preflight)
        if label_key is not None and (isinstance(label_key, bool) or not isinstance(label_key, (str, int))):
            raise ConfigError("label_key", "a dict key (str), a tuple index (int) or None", label_key)
        if shift_labels is not None and not isinstance(shift_labels, bool):
            raise ConfigError("shift_labels", "True, False or None (auto)", shift_labels)
        opts.set_on(self)  # budget_bytes, ..., initial_split, do_preflight
        self.label_key = label_key
        self.shift_labels = shift_labels

        self.trainer = None
        self.pl_module = None
        self.monitor: Optional[MemoryMonitor] = None
        self.preflight: Optional[Preflight] = None
        self.events: List[Dict[str, Any]] = []
        self.forward_rows: List[int] = []  # rows (packed: sequences) of every forward that ran
        self.samples_per_step: List[int] = []  # rows processed per optimizer step
        self.oom_retries = 0
        self.summary: Optional[Dict[str, Any]] = None
        self.split_disabled_reason: Optional[str] = None
        self.start_time: Optional[float] = None
        self._orig_training_step = None
        self._orig_zero_grad = None
        self._rows_this_step = 0
        self._phase = "forward"
        self._zero_armed_for: Optional[int] = None
        self._chunk_grads_for: Optional[int] = None
        self._started = False
        self._events_logged = 0
        self._zero_early_enabled = True  # tests switch it off to show it is needed

    # ------------------------------------------------------------------ setup / teardown
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        self.trainer, self.pl_module = trainer, pl_module
        self._started = False  # a new fit: preflight and monitor again at its first batch
        reason = self._why_no_split(trainer, pl_module)
        if reason is not None:
            self.split_disabled_reason = reason
            logger.warning("memguard: in-place micro-batching is off: %s", reason)
            return
        if self._orig_training_step is None:
            self._orig_training_step = pl_module.training_step
            self._orig_zero_grad = pl_module.optimizer_zero_grad
            cb = self

            def training_step(batch, *args, **kwargs):
                return cb._guarded_training_step(batch, *args, **kwargs)

            def optimizer_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs):
                return cb._guarded_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs)

            # functools: Lightning reads the signature of the original through __wrapped__
            pl_module.training_step = functools.update_wrapper(training_step, self._orig_training_step)
            pl_module.optimizer_zero_grad = functools.update_wrapper(optimizer_zero_grad, self._orig_zero_grad)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        if self.monitor is not None:
            self.monitor.stop()
        if self._orig_training_step is not None:
            for name in ("training_step", "optimizer_zero_grad"):
                pl_module.__dict__.pop(name, None)  # back to the class's methods
            self._orig_training_step = self._orig_zero_grad = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.monitor is not None:
            self.monitor.stop()

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
        if "FSDP" in name:
            return ("FSDP: chunks would run inside the root FSDP forward, before its backward hooks exist "
                    "(not validated). Apply memguard's plan instead: dataloader batch_size / k and "
                    "accumulate_grad_batches x k (logged by the preflight)")
        return None

    # ------------------------------------------------------------------ start (first batch)
    def _start(self, trainer, pl_module, batch) -> None:
        self._started = True
        self.start_time = time.time()
        split, budget = self.initial_split, self.budget_bytes
        if self.do_preflight:
            try:
                self.preflight = run_preflight(trainer, pl_module, batch, budget_bytes=budget,
                                               safety_ratio=self.safety_ratio, seq_length=self.seq_length,
                                               apply=self.apply, device=self.device,
                                               plan_fraction=self.thresholds.warning)
            except DoesNotFitError:
                if self.fail_fast:
                    raise
                logger.error("memguard preflight: nothing fits the budget; training continues with the "
                             "largest split, the runtime guard watching", exc_info=True)
                split = max(split, batch_units(batch))
            except ConfigError as exc:
                if self.fail_fast:
                    raise
                logger.warning("memguard preflight skipped: %s; the runtime guard still runs", exc)
            except Exception:
                logger.warning("memguard preflight failed; the runtime guard still runs", exc_info=True)
        pf = self.preflight
        if pf is not None:
            budget = pf.budget_bytes
            split = max(split, pf.split_factor)
            for line in pf.report_lines():
                logger.info("%s", line)
            if pf.split_factor > 1 and self.split_disabled_reason is not None:
                ts = pf.plan.train_spec
                logger.warning("memguard: the plan needs micro-batch %d x accumulation %d, which cannot be "
                               "applied in place here (%s): set the dataloader's batch_size=%d and "
                               "Trainer(accumulate_grad_batches=%d)", ts.batch_size, ts.grad_accum,
                               self.split_disabled_reason.split(":")[0], ts.batch_size, ts.grad_accum)
            self._log_preflight(trainer, pf)
            if pf.not_applied and self.fail_fast:
                raise DoesNotFitError(pf.shortfall_bytes, pf.budget_bytes, pf.best_peak_bytes,
                                      [c.reason for c in pf.not_applied])
        if budget is None:
            from memguard_core.preflight import default_budget
            budget = default_budget(self.device, self.safety_ratio)
        rows = max(1, batch_units(batch))
        k = min(split, rows)
        self.monitor = MemoryMonitor(budget, device=self.device, safety_ratio=self.safety_ratio,
                                     thresholds=self.thresholds, interval_s=self.monitor_interval_s,
                                     split=k, max_split=rows, on_event=self._on_event)
        if k > 1:
            logger.info("memguard: micro-batch split k=%d (micro-batch %d rows -> %d-row chunks; effective "
                        "batch unchanged)", k, rows, -(-rows // k))
        self.monitor.prime()
        self.monitor.start()

    def _log_preflight(self, trainer, pf: Preflight) -> None:
        params = {"memguard/budget_bytes": int(pf.budget_bytes),
                  "memguard/estimated_peak_bytes": int(pf.estimate.peak_bytes),
                  "memguard/planned_peak_bytes": int(pf.best_peak_bytes),
                  "memguard/planned_split": int(pf.split_factor),
                  "memguard/changes": "; ".join(c.reason for c in pf.applied + pf.not_applied) or "none"}
        for lg in getattr(trainer, "loggers", None) or []:
            try:
                lg.log_hyperparams(params)
            except Exception:
                logger.debug("memguard: logger %s refused the preflight figures", type(lg).__name__, exc_info=True)

    def _on_event(self, event: MemoryEvent) -> None:
        self.events.append(event.to_dict())  # may run on the monitor's thread: only appends here

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._started:
            self._start(trainer, pl_module, batch)
        if self._orig_training_step is None and self.monitor is not None:
            # not splitting (manual optimization, DeepSpeed, FSDP): still sample memory and count
            # rows per optimizer step
            self.monitor.step_sample(trainer.global_step)
            self._rows_this_step += batch_units(batch)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.samples_per_step.append(self._rows_this_step)
        self._rows_this_step = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._zero_armed_for is not None:
            self._zero_armed_for = None
            self._disable_split("Lightning did not zero the gradients after training_step on a batch where "
                                "its rule says it would; the gradients of the earlier batches of this "
                                "accumulation window were cleared too early")
        self._chunk_grads_for = None
        mon = self.monitor
        if mon is None or not self._should_log(trainer):
            return
        metrics = {"memguard/split": float(mon.split), "memguard/usage": float(round(mon.max_usage, 4)),
                   "memguard/peak_gib": float(round(mon.max_step_peak_bytes / 2**30, 4)),
                   "memguard/events": float(len(self.events))}
        try:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False,
                               logger=bool(getattr(trainer, "loggers", None)),
                               batch_size=max(1, batch_units(batch)))
        except Exception:
            logger.debug("memguard: could not log to Lightning", exc_info=True)

    def _should_log(self, trainer) -> bool:
        """Log the memory figures only on the batches whose metrics Lightning writes to its loggers
        (its ``log_every_n_steps`` rule; a value logged on another batch would not be written):
        ``log_dict`` costs about 1 ms of Lightning bookkeeping per call here, 4 % of a 30 ms step.
        Events go to Python logging when they happen."""
        if not getattr(trainer, "loggers", None):
            return False          # prog_bar=False: nothing would show these figures
        try:
            return bool(trainer._logger_connector.should_update_logs)  # Lightning's own rule
        except Exception:
            return True

    def on_train_end(self, trainer, pl_module) -> None:
        if self.monitor is not None:
            self.summary = finish_guarded_run(self, trainer.global_step, logger,
                                              split_disabled=self.split_disabled_reason)

    # ------------------------------------------------------------------ manual optimization helper
    def chunks(self, batch: Any) -> Iterator[Tuple[Any, float]]:
        """Yield ``(chunk_batch, loss_weight)`` for the guard's current k (rank-agreed), for
        training steps that do their own backward (manual optimization)::

            for chunk, w in guard.chunks(batch):
                self.manual_backward(self.compute_loss(chunk) * w)

        The weights sum to 1 (see ``loss_weighting``); with k = 1 the batch itself comes back with
        weight 1.0. Rows of each chunk are recorded in ``forward_rows``.
        """
        mon = self.monitor
        k = mon.split if mon is not None else self.initial_split
        k = self._agreed_split(k)
        if k <= 1:
            self.forward_rows.append(batch_units(batch))
            yield batch, 1.0
            return
        sp = self._splitter(batch)
        for u0, u1 in sp.ranges(k):
            chunk, w, units = sp.chunk(u0, u1)
            self.forward_rows.append(units)
            yield chunk, w

    # ------------------------------------------------------------------ the guarded step
    def _disable_split(self, why: str) -> None:
        logger.error("memguard: %s. In-place micro-batching is switched off for the rest of the run.", why)
        self.split_disabled_reason = why

    def _agreed_split(self, k: int) -> int:
        """The MAX of k over ranks, on a gloo side group (no device sync under NCCL)."""
        try:
            return agree_max(k)
        except Exception:
            logger.warning("memguard: split all-reduce failed; using the local k", exc_info=True)
            return k

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
        weighting = self.loss_weighting
        sp = LightningBatchSplitter(batch, weighting="rows" if weighting == "rows" else "tokens",
                                    shift_labels=self._shift(batch), label_key=self.label_key)
        if weighting == "auto" and not sp.flat.labels_found:
            sp.core = type(sp.core)(sp.core.inputs, weighting="rows")
        return sp

    def _zero_grad_coming(self, batch_idx: int) -> bool:
        """Lightning's rule (``_AutomaticOptimization._make_zero_grad_fn``)."""
        trainer = self.trainer
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        if getattr(loop, "_skip_backward", False):
            return False
        return batch_idx % trainer.accumulate_grad_batches == 0

    def _guarded_zero_grad(self, epoch, batch_idx, optimizer, *args, **kwargs):
        if self._zero_armed_for is not None and self._zero_armed_for == batch_idx:
            self._zero_armed_for = None  # memguard zeroed before this batch's first chunk
            return None
        if self._chunk_grads_for is not None and self._chunk_grads_for == batch_idx:
            self._disable_split("Lightning zeroed the gradients after training_step where its rule says "
                                "it would not; this batch's non-final chunks lost their gradients")
        return self._orig_zero_grad(epoch, batch_idx, optimizer, *args, **kwargs)

    def _guarded_training_step(self, batch, *args, **kwargs):
        trainer = self.trainer
        mon = self.monitor
        orig = self._orig_training_step
        if mon is None or trainer is None or not trainer.training:
            return orig(batch, *args, **kwargs)
        mon.step_sample(trainer.global_step)
        if self.split_disabled_reason is not None:
            self._count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        k = self._agreed_split(mon.split)
        if k > mon.split:
            mon.request_split(k, "another rank asked for it", trainer.global_step)
        batch_idx = self._batch_idx(args, kwargs)
        if k <= 1:
            units = batch_units(batch)
            self.forward_rows.append(units)  # every forward tried, a failed one included
            try:
                out = orig(batch, *args, **kwargs)
                self._rows_this_step += units
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
        self.forward_rows.append(units)
        self._rows_this_step += units

    def _split_step(self, batch, args, kwargs, k: int, batch_idx: int):
        trainer, pl_module = self.trainer, self.pl_module
        orig = self._orig_training_step
        try:
            sp = self._splitter(batch)
        except ValueError:
            self._count(batch_units(batch))
            return orig(batch, *args, **kwargs)
        accum = max(1, int(trainer.accumulate_grad_batches))
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        if self._zero_early_enabled and self._zero_grad_coming(batch_idx):
            # Lightning would zero after this training_step, wiping the chunks' gradients: zero now
            self._orig_zero_grad(trainer.current_epoch, batch_idx, optimizer)
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
                        self.forward_rows.append(units)
                        out = orig(chunk, *args, **kwargs)
                        loss = _loss_of(out)
                        if last:
                            recorder.end_chunk(w, commit=True)
                            self._rows_this_step += units
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
                        self._rows_this_step += units
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
        k_new = split_after_oom(self.monitor, exc, k, units_left, self.trainer.global_step, logger)
        self.oom_retries += 1
        return k_new
