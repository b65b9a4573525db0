"""The evaluation split of the Lightning adapter: ``validation_step`` / ``test_step`` /
``predict_step`` wrappers (:class:`GuardedEval`, installed on the module instance by
``memguard_lightning.callback.MemGuardCallback``) that cut each batch into k_eval row-chunks,
put the results back together as the unsplit step returns them (:func:`combine`), and redo a
batch at twice k_eval after an out-of-memory error, never changing the training k.
:func:`eval_split_reason` says where the split is off. docs/lightning.md, "Evaluation split".
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Dict, List, Optional

import torch

from memguard_core.microbatch import free_after_oom, without_frames as _without_frames

from memguard_torch.oom import is_oom_error

from .batch import batch_units
from .logs import LogRecorder

logger = logging.getLogger("memguard.lightning")

#: The evaluation steps split (LightningModule method names).
EVAL_STEPS = ("validation_step", "test_step", "predict_step")


def combine(outputs: List[Any], weights: List[float]) -> Any:
    """The unsplit step's output from the chunks' ``outputs`` (see the module doc).

    Args:
        outputs: what the step returned for each chunk, in row order.
        weights: the chunks' loss weights (summing to 1).

    Raises:
        RuntimeError: tensors with a batch dimension whose other dimensions differ between chunks
            (``torch.cat``'s error).
    """
    first = outputs[0]
    if first is None:
        return None
    if torch.is_tensor(first):
        if first.dim() == 0:
            total = None
            for v, w in zip(outputs, weights):
                term = v * w
                total = term if total is None else total + term
            return total
        return torch.cat(list(outputs), dim=0)
    if isinstance(first, bool):
        return outputs[-1]
    if isinstance(first, (int, float)):
        return sum(float(v) * w for v, w in zip(outputs, weights))
    if isinstance(first, dict):
        return type(first)((key, combine([o[key] for o in outputs], weights)) for key in first)
    if isinstance(first, (tuple, list)):
        items = [combine([o[i] for o in outputs], weights) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
            return type(first)(*items)
        return type(first)(items)
    return outputs[-1]


class GuardedEval:
    """The evaluation split of one Lightning module (see the module doc).

    Args:
        step: the fit's ``GuardedStep`` (its ``splitter``: loss weighting, label key, shifted labels).
        micro_batches: k_eval at the start (>= 1); doubled on each evaluation out-of-memory error.

    Attributes:
        micro_batches: the current k_eval.
        rows: rows of each evaluation forward tried (a failed one included).
        oom_retries: evaluation batches redone after an out-of-memory error.
    """

    def __init__(self, step, micro_batches: int = 1):
        self.step = step
        self.micro_batches = int(micro_batches)
        self.rows: List[int] = []
        self.oom_retries = 0
        self.origs: Dict[str, Any] = {}
        self._oom_in_loop = False

    def end_loop(self) -> None:
        """After a validation / test / predict loop: when a batch of it ran out of memory, hand
        the heap back once more (``free_after_oom``: the redone chunks' freed activations stay
        mapped otherwise, and training resumes under the same limit). Never raises."""
        if self._oom_in_loop:
            self._oom_in_loop = False
            try:
                free_after_oom()
            except Exception:
                logger.debug("memguard: free after the evaluation failed", exc_info=True)

    def install(self, pl_module) -> None:
        """Wrap the evaluation steps the module overrides, on the instance (``functools`` keeps the
        original's signature and code visible to Lightning's ``is_overridden``)."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        for name in EVAL_STEPS:
            if name in self.origs or not is_overridden(name, pl_module):
                continue
            orig = getattr(pl_module, name)
            self.origs[name] = orig

            def wrapped(batch, *args, _name=name, **kwargs):
                return self.run(_name, batch, args, kwargs)

            setattr(pl_module, name, functools.update_wrapper(wrapped, orig))

    def uninstall(self, pl_module) -> None:
        """Back to the class's methods."""
        for name in self.origs:
            pl_module.__dict__.pop(name, None)
        self.origs = {}

    def run(self, name: str, batch, args, kwargs):
        """One evaluation batch in k_eval micro-batches, redone at a doubled k_eval after an
        out-of-memory error; re-raises one at one row per forward."""
        units = batch_units(batch)
        while True:
            failure = None
            try:
                return self._run_once(name, batch, args, kwargs, min(self.micro_batches, max(units, 1)))
            except Exception as exc:
                if not is_oom_error(exc):
                    raise
                # the CUDA snapshot (cuda_snapshots) while the failed chunk's tensors are referenced
                self.step.guard.snapshot_oom(self.step.trainer.global_step)
                failure = _without_frames(exc)
            self.step.guard.oom_handled()   # the next failure dumps its own
            k = min(self.micro_batches, max(units, 1))
            if k >= units:
                logger.error("memguard: out of memory in %s at one row per forward: %s", name, failure)
                raise failure
            free_after_oom()
            self.micro_batches = min(2 * k, units)
            self.oom_retries += 1
            self._oom_in_loop = True
            logger.warning("memguard: out of memory in %s (%s); redoing the batch in %d micro-batches "
                           "(the training split is unchanged)", name, type(failure).__name__, self.micro_batches)

    def _run_once(self, name: str, batch, args, kwargs, k: int):
        orig = self.origs[name]
        sp = None
        if k > 1:
            try:
                sp = self.step.splitter(batch)
            except ValueError:
                sp = None
        if sp is None:
            self.rows.append(batch_units(batch))
            return orig(batch, *args, **kwargs)
        pl_module = self.step.pl_module
        recorder = LogRecorder(pl_module.log)
        pl_module.log = recorder
        outputs, weights = [], []
        try:
            for u0, u1 in sp.ranges(k):
                chunk, w, units = sp.chunk(u0, u1)
                self.rows.append(units)
                outputs.append(orig(chunk, *args, **kwargs))
                weights.append(w)
                recorder.end_chunk(w, commit=True)
        finally:
            pl_module.__dict__.pop("log", None)
        out = combine(outputs, weights)
        recorder.flush()
        return out


def eval_split_reason(trainer) -> Optional[str]:
    """Why evaluation batches are not split under this strategy (None: they are)."""
    name = type(trainer.strategy).__name__
    if getattr(trainer.strategy, "handles_gradient_accumulation", False) or "DeepSpeed" in name:
        return "DeepSpeed runs the module inside its engine (not validated)"
    if "FSDP" in name:
        # every evaluation forward all-gathers; an evaluation OOM retried on one rank would leave the
        # others waiting, and the split has no OOM sync points
        return "FSDPStrategy: every evaluation forward runs FSDP collectives (not validated)"
    if int(getattr(trainer, "world_size", 1) or 1) > 1 and "ModelParallel" in name:
        # FSDP2 / tensor parallel: every forward runs collectives, so a rank retrying a batch at a
        # finer cut alone would leave the others waiting
        return "ModelParallelStrategy with several ranks: every evaluation forward runs collectives"
    return None
