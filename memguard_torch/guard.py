"""The memory guard of a plain PyTorch or accelerate training loop: ``TorchGuard``.

::

    guard = TorchGuard(model, optimizer, budget_gib=20)
    for batch in loader:
        for chunk, weight in guard.chunks(batch):    # k micro-batches, k agreed by all ranks
            with guard.micro_step():                 # an OOM in here is caught and redone
                loss = model(**chunk).loss * weight  # accelerator.backward(loss) works the same
                loss.backward()
        optimizer.step(); optimizer.zero_grad()
        guard.step_end()
    summary = guard.finish()

The lifecycle (preflight, budget, monitor, OOM re-split, window redo, run summary, event log) is
``memguard_core.guard.Guard``'s (docs/lifecycle.md); this adapter gives it the loop's batches and
runs the chunks; what it decides about the run (whether the split can run, the sync points, the
gradient watch, the splitter) is in ``memguard_torch.guard_setup``. The design, what is guaranteed
under DDP / FSDP2 / DeepSpeed and the limits are in docs/torch_loop.md.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from memguard_core.errors import ConfigError
from memguard_core.guard import Guard, GuardAttributes
from memguard_core.microbatch import free_after_oom, without_frames as _without_frames
from memguard_core.options import GuardOptions, option_kwargs, with_guard_options

from . import _compat
from . import train_reading as tt
from .batch import LoopBatch as _Batch, batch_units
from .guard_setup import GradientWatch, check_loop_args, chunk_context, install_sync, loop_splitter, why_no_split
from .oom import is_oom_error
from .optim_state import prepare_optimizer
from .preflight import read_specs
from .preflight_probe import measure_fn
from .specs import world_size
from .ranks import RankAgreement
from .sync import OomSync, PeerOutOfMemoryError

logger = logging.getLogger("memguard.torch")

__all__ = ["TorchGuard", "is_oom_error"]

class TorchGuard(RankAgreement, GuardAttributes):
    """Memory guard for a plain PyTorch or accelerate training loop (see the module doc).

    Args:
        model: the model the loop trains (bare, DDP-wrapped, FSDP2 ``fully_shard``-ed, or accelerate's
            prepared model); None: no preflight, no in-place sync points, chunks still cut.
        optimizer: its optimizer (plain or accelerate's ``AcceleratedOptimizer``); Adam / AdamW
            states are allocated before the first forward (docs/lifecycle.md, "optimizer step").
        accelerator: an ``accelerate.Accelerator``, when the loop uses one: its mixed precision and
            ``gradient_accumulation_steps`` go to the preflight, its ``sync_gradients`` tells
            :meth:`step_end` whether the optimizer really stepped.
        grad_accum: batches per optimizer step when the loop accumulates itself (preflight only).
        label_key: where a batch's labels are: a dict key (default ``labels``) or an index into a
            tuple batch (default: the last element).
        shift_labels: the loss shifts labels by one (causal LM) for the token weights; None = auto
            (a dict batch with ``input_ids`` and ``labels`` of one shape and a HF ``*ForCausalLM``).
        oom_sync: under ``torch.distributed`` with more than one rank, put sync points in each
            micro-batch so an out-of-memory error on one rank is redone by all (default True there;
            docs/torch_loop.md). False: no flag all-reduces; an OOM on one rank is then raised there
            (``micro_step`` does not catch it) and ends the run.
        **options: the guard options (``memguard_core.options.GuardOptions.from_kwargs``: budget,
            micro_batches, monitor, preflight, log_dir, ...).

    Attributes: ``guard`` (the ``Guard``), ``optimizer_steps``, ``oom_errors`` (the out-of-memory
    errors caught on this rank, ``type: message``, a peer's as ``PeerOutOfMemoryError``); the guard's state under the shared
    names (``monitor``, ``preflight``, ``events``, ``micro_batch_rows``, ``samples_per_step``,
    ``oom_retries``, ``split_disabled_reason``, ``summary``, ``budget_bytes``).

    Raises:
        ConfigError: invalid arguments (naming the field).
    """

    @with_guard_options
    def __init__(self, model: Any = None, optimizer: Any = None, *, accelerator: Any = None,
                 grad_accum: Optional[int] = None, label_key: Any = None, shift_labels: Optional[bool] = None,
                 oom_sync: Optional[bool] = None, **options: Any):
        own = ("model", "optimizer", "accelerator", "grad_accum", "label_key", "shift_labels", "oom_sync")
        if "eval_micro_batches" in options:
            # the loop's evaluation is the user's code: nothing here would read the option, and
            # taking it silently would promise a split that never happens
            raise ConfigError("eval_micro_batches", "not set for TorchGuard (split an evaluation batch "
                              "with guard.chunks(batch))", options["eval_micro_batches"])
        opts = GuardOptions.from_kwargs(**option_kwargs(options, own=own))
        check_loop_args(model, optimizer, grad_accum, label_key, shift_labels, oom_sync)
        _compat.check_version()
        self.options = opts
        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.grad_accum, self.label_key, self.shift_labels = grad_accum, label_key, shift_labels
        self.oom_sync = oom_sync
        self.guard = Guard(opts, log=logger)
        self.optimizer_steps = 0
        self.sync = OomSync(None)
        self._started = False
        self._window: List[Any] = []      # the batches since the last optimizer step (a redo reruns them)
        self._rows_this_step = 0
        self._in_chunk = False
        self._can_recover = True
        self._failure: Optional[BaseException] = None
        self.oom_errors: List[str] = []
        self._grads = GradientWatch()
        self._fsdp_hooks: Optional[Any] = None          # FsdpSyncHooks, or Fsdp1SyncHooks
        self._fsdp1 = False             # set at the first chunks(): the model may be wrapped after __init__
        self._fsdp1_unsynced = False
        self._ddp = _compat.find_ddp(model)
        self._manual_reduce = False

    # ------------------------------------------------------------------ start
    def _start(self, batch: Any) -> None:
        self._started = True
        model, opts = self.model, self.options
        self._fsdp1 = bool(_compat.fsdp1_modules(model))
        self.guard.split_disabled_reason = why_no_split(model, self.accelerator)
        if self.guard.split_disabled_reason is not None:
            logger.warning("memguard: in-place micro-batching is off: %s", self.guard.split_disabled_reason)
        if world_size() > 1 and self.oom_sync is not False:
            # collective: every rank's first chunks() call
            self.sync, self._fsdp_hooks, self._fsdp1_unsynced = install_sync(model)
        self._manual_reduce = self._ddp is not None and self.sync.group is not None
        # with more than one rank and no sync points, a redo on one rank alone would leave the
        # others in a collective: the error is raised instead (the run ends, as without memguard)
        self._can_recover = world_size() <= 1 or (self.sync.group is not None and not self._fsdp1_unsynced)
        can_checkpoint = model is not None and tt.checkpoint_target(model) is not None
        self.guard.start(
            rows=batch_units(batch),
            read_specs=(lambda: read_specs(model, self.optimizer, batch, seq_length=opts.seq_length,
                                           grad_accum=self.grad_accum, accelerator=self.accelerator,
                                           device=opts.device)) if model is not None else None,
            enable_checkpointing=(lambda: tt.enable_activation_checkpointing(model)) if can_checkpoint else None,
            plan_hint=": set the data loader's batch size and the accumulation steps to these numbers",
            measure=measure_fn(tt.unwrap(model), batch, step_context=getattr(self.accelerator, "autocast", None))
            if model is not None else None)
        if model is not None:
            self._grads.watch(model)
        self._prepare_optimizer()

    def _prepare_optimizer(self) -> None:
        """Allocate the optimizer's lazy states before the first forward and make an OOM inside its
        step name itself (``memguard_torch.optim_state.prepare_optimizer``). Never raises."""
        if self.optimizer is not None:
            prepare_optimizer(self.optimizer, self.guard, lambda: self._last_rows, is_oom_error)

    _last_rows = 1

    # ------------------------------------------------------------------ the loop's calls
    def chunks(self, batch: Any) -> Iterator[Tuple[Any, float]]:
        """Yield ``(chunk, weight)`` for one batch: ``k`` micro-batches (``k`` from the guard, the
        MAX over ranks), each a batch of the same structure with a contiguous part of the rows
        (packed batches: of the sequences), and its loss weight. The weights sum to 1; with a mean
        loss, ``sum(loss_of(chunk) * weight)`` is the batch's loss and the summed gradients the
        batch's (``loss_weighting``: ``tokens`` = share of valid labels, for token-mean losses;
        ``rows`` = share of rows). With k = 1 the batch itself comes back with weight 1.0.

        Run each chunk's forward and backward inside :meth:`micro_step`: after an out-of-memory
        error there the iteration goes on with smaller chunks (a forward OOM: the rows not yet
        processed; a backward OOM: the gradients are zeroed and the batches since the last
        optimizer step are yielded again at a doubled k). Under DDP every chunk runs under
        ``no_sync`` and the gradients are averaged over the ranks once the batch's last chunk has
        succeeded on every rank (the ambient ``no_sync`` / ``accelerator.accumulate`` is honoured);
        under FSDP2 and FSDP1 every chunk reduce-scatters (docs/torch_loop.md).

        Raises:
            WindowOOMError: the window failed at one row per forward, or too often (every rank).
            the error itself: a non-OOM error inside the chunk, or an OOM outside ``micro_step``.
        """
        if not self._started:
            self._start(batch)
        g = self.guard
        self._last_rows = batch_units(batch)
        if g.monitor is None or g.split_disabled_reason is not None:
            if g.monitor is not None:
                g.monitor.step_sample(self.optimizer_steps)
            g.micro_batch_rows.append(self._last_rows)
            self._rows_this_step += self._last_rows
            yield batch, 1.0
            return
        k = g.micro_batches_for_step(self.optimizer_steps)
        self._window.append(batch)
        reduce_after = self._manual_reduce and bool(getattr(self._ddp, "require_backward_grad_sync", True))
        redos = 0
        while True:
            todo = self._window if redos else [batch]
            failure = None
            for i, b in enumerate(todo):
                failure = yield from self._run_batch(b, max(k, g.monitor.micro_batches), final=i == len(todo) - 1)
                if failure is not None:
                    break
            if failure is None:
                break
            k = self._redo_window(failure, k, redos)
            redos += 1
        if reduce_after:
            self._reduce_ddp_gradients()

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[None]:
        """Run one chunk's forward and backward inside it: an out-of-memory error (or a peer rank's,
        :class:`PeerOutOfMemoryError`) is caught, its frames dropped, and handled by
        :meth:`chunks` when the loop asks for the next chunk. Other errors, and errors outside a
        chunk, pass through."""
        try:
            yield
        except Exception as exc:
            if not (self._in_chunk and self._can_recover and is_oom_error(exc)):
                raise
            # the snapshot first, while the failed chunk's tensors are still referenced
            self.guard.snapshot_oom(self.optimizer_steps, peer=isinstance(exc, PeerOutOfMemoryError))
            self._failure = _without_frames(exc)
            self.oom_errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")

    def run(self, batch: Any, fn: Callable[[Any, float], Any]) -> None:
        """``for chunk, weight in chunks(batch): with micro_step(): fn(chunk, weight)``. ``fn`` runs
        one chunk's forward and backward (``(fn(chunk) * weight).backward()``); its locals, the
        failed chunk's graph among them, are gone when an OOM leaves it, so the redo runs on freed
        memory (docs/torch_loop.md, "Loop form or run()")."""
        for chunk, weight in self.chunks(batch):
            with self.micro_step():
                fn(chunk, weight)

    def step_end(self, stepped: Optional[bool] = None) -> None:
        """After the optimizer step: the window is closed (a later redo never reruns its batches).
        ``stepped``: whether the optimizer really stepped; None: ``accelerator.sync_gradients``
        with an accelerator, else True. A batch that did not step stays in the window."""
        if stepped is None:
            stepped = bool(getattr(self.accelerator, "sync_gradients", True)) if self.accelerator is not None else True
        if not stepped:
            return
        self.guard.samples_per_step.append(self._rows_this_step)
        self._rows_this_step = 0
        self.optimizer_steps += 1
        self._window = []
        # the step's peak and record now (figures read next are this step's), and the CPU heap trim
        self.guard.end_step(self.optimizer_steps)

    def finish(self, **extra: Any) -> Optional[Dict[str, Any]]:
        """End the run: the run summary (``Guard.finish``: ``micro_batches``, ``max_usage``,
        ``measured_peak_bytes``, ``oom_retries``, ...) and the calibration record; the hooks come
        off. Never raises."""
        self._remove_hooks()
        return self.guard.finish(self.optimizer_steps, **extra)

    def close(self) -> None:
        """Stop the monitor and take the hooks off without a summary (the loop is leaving early)."""
        self._remove_hooks()
        self.guard.stop()

    def _remove_hooks(self) -> None:
        self._grads.remove()
        if self._fsdp_hooks is not None:
            self._fsdp_hooks.remove()
            self._fsdp_hooks = None

    # ------------------------------------------------------------------ one batch
    def _run_batch(self, batch: Any, k: int, final: bool):
        """Yield the chunks of one batch at ``k``; re-cut the rows not yet processed after an OOM that
        added no gradient on any rank. Returns None when the batch is done, else the error (this
        rank's, or a ``PeerOutOfMemoryError``) that needs the window redone."""
        try:
            flat = _Batch(batch, self.label_key)
            sp = loop_splitter(flat, self.options.loss_weighting, self.shift_labels, self.model)
        except ValueError:
            top, _low, exc = yield from self._one_chunk(batch, 1.0, self._last_rows, final)
            return None if top == 0 else (exc or PeerOutOfMemoryError("at the end of the micro-batch"))
        start = 0
        while start < sp.units:
            ranges = self._agreed_ranges(sp, k, start)
            for u0, u1 in ranges:
                c = sp.chunk(u0, u1)
                inputs = flat.batch if (u0 == 0 and u1 == sp.units) else flat.rebuild(c.inputs)
                top, low, exc = yield from self._one_chunk(inputs, c.weight if len(ranges) > 1 or start else 1.0,
                                                           c.rows, final and u1 == sp.units)
                c = inputs = None
                if top == 0:
                    start = u1
                    continue
                self._after_abort()
                units_left = sp.units - start
                exc = exc or PeerOutOfMemoryError("at the end of the micro-batch")
                if low >= 1 and top == 1 and k < units_left:
                    # no rank added a gradient in this chunk: every rank re-cuts the same rows
                    k = self.guard.agreed(self.guard.after_oom(exc, k, units_left, self.optimizer_steps,
                                                               free=free_after_oom))
                    exc = None
                    break
                return exc
        return None

    def _one_chunk(self, inputs: Any, weight: float, rows: int, last: bool):
        """Yield one chunk; returns ``(max_flag, min_flag, error)`` over the ranks (flags: 0 done,
        1 stopped before adding a gradient, 2 after)."""
        self.guard.micro_batch_rows.append(rows)
        self._failure = None
        self._grads.reset()
        self.sync.grads_added = False
        ctx = chunk_context(self.model, self._fsdp1, self._ddp, not last or self._manual_reduce)
        self._in_chunk = True
        self.sync.inside = self.sync.group is not None
        if self._fsdp_hooks is not None:
            self._fsdp_hooks.new_chunk()
        try:
            with ctx:
                yield inputs, weight
        finally:
            self._in_chunk = False
            self.sync.inside = False
        exc, self._failure = self._failure, None
        flag = 0 if exc is None else (2 if (self._grads.added or self.sync.grads_added) else 1)
        top, low = self.sync.end(flag)
        if top == 0:
            self._rows_this_step += rows
        return top, low, exc

    # ------------------------------------------------------------------ after a failure
    def _redo_window(self, failure: BaseException, k: int, redos: int) -> int:
        """Zero the window's gradients and return the k to redo it with (``Guard.after_window_oom``;
        every rank passes an error, its own or a peer's, so all raise ``WindowOOMError`` alike)."""
        phase = "backward" if (self._grads.added or self.sync.grads_added) else "forward"
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            try:
                self.optimizer.zero_grad(set_to_none=True)
            except Exception:
                logger.debug("memguard: optimizer.zero_grad failed", exc_info=True)
        self._rows_this_step = 0
        return self.guard.after_window_oom(failure, k, self._last_rows, self.optimizer_steps,
                                           redos=redos, phase=phase)
