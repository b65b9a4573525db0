"""What ``TorchGuard`` decides about the run it guards, kept out of the guard's class: whether the
in-place split can run at all, the OOM sync points under several ranks, the gradient watch that
tells a forward OOM from a backward one, and the splitter of a loop batch (docs/torch_loop.md).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, List, Optional, Tuple

import torch

from memguard_core.errors import ConfigError

from . import _compat
from . import train_reading as tt
from .batch import LoopBatch
from .distributed import flag_group
from .microbatch import BatchSplitter
from .sync import Fsdp1SyncHooks, FsdpSyncHooks, OomSync

logger = logging.getLogger("memguard.torch")

__all__ = ["check_loop_args", "why_no_split", "install_sync", "GradientWatch", "loop_splitter", "chunk_context"]


def check_loop_args(model: Any, optimizer: Any, grad_accum: Any, label_key: Any, shift_labels: Any,
                    oom_sync: Any) -> None:
    """Check ``TorchGuard``'s own arguments.

    Raises:
        ConfigError: naming the first bad one.
    """
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigError("model", "a torch.nn.Module, or None", model)
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        raise ConfigError("optimizer", "a torch optimizer (with a step method), or None", optimizer)
    if grad_accum is not None and (isinstance(grad_accum, bool) or not isinstance(grad_accum, int)
                                   or grad_accum < 1):
        raise ConfigError("grad_accum", "an integer >= 1, or None", grad_accum)
    if label_key is not None and (isinstance(label_key, bool) or not isinstance(label_key, (str, int))):
        raise ConfigError("label_key", "a dict key (str), a tuple index (int) or None", label_key)
    for name, flag in (("shift_labels", shift_labels), ("oom_sync", oom_sync)):
        if flag is not None and not isinstance(flag, bool):
            raise ConfigError(name, "True, False or None (auto)", flag)


def why_no_split(model: Any, accelerator: Any) -> Optional[str]:
    """Why the in-place micro-batch split cannot run on this model / accelerator (DeepSpeed, an
    FSDP accelerator given a model without FSDP modules, FSDP1 parameter offload), else None."""
    name = type(model).__name__ if model is not None else ""
    accel = str(getattr(accelerator, "distributed_type", "") or "")
    if "DeepSpeed" in name or "DEEPSPEED" in accel:
        return ("DeepSpeed counts micro-steps inside its engine (accelerator.backward steps the engine on "
                "an accumulation boundary; ZeRO keeps the window's gradients in its own buffers, which "
                "an OOM redo cannot zero). Apply memguard's plan instead: train_micro_batch_size_per_gpu "
                "/ k and gradient_accumulation_steps x k (docs/torch_loop.md)")
    if accel == "DistributedType.FSDP" and not (_compat.fsdp_modules(model) or _compat.fsdp1_modules(model)):
        return ("the accelerator runs FSDP but the model given to TorchGuard holds no FSDP module (pass "
                "the model accelerator.prepare returned)")
    if _compat.fsdp1_offloads_params(model):
        return f"{_compat.FSDP1_OFFLOAD_NO_SPLIT}; apply memguard's plan as batch size / k and accumulation x k"
    return None


def install_sync(model: Any) -> Tuple[OomSync, Optional[Any], bool]:
    """The OOM sync points of a run on several ranks: ``(sync, fsdp_hooks, fsdp1_unsynced)``. The
    flag group is made here, collectively (every rank's first ``chunks()`` call); FSDP2 and FSDP1
    models get their hooks in FSDP's comms (``memguard_torch.sync``); an FSDP1 model where they
    cannot be placed (a hybrid sharding strategy, a communication hook of its own) gets none and
    ``fsdp1_unsynced`` True (an OOM is then raised, not redone)."""
    sync = OomSync(flag_group())
    if model is not None and _compat.fsdp_modules(model):
        return sync, FsdpSyncHooks(model, sync), False
    if model is not None and _compat.fsdp1_modules(model):
        hooks = Fsdp1SyncHooks(model, sync)
        if hooks.installed:
            return sync, hooks, False
        logger.warning("memguard: FSDP1 without OOM sync points (a hybrid sharding strategy or a "
                       "communication hook of its own): an out-of-memory error is raised, not redone")
        return sync, None, True
    return sync, None, False


class GradientWatch:
    """A post-accumulate-grad hook on every trainable (non-FSDP) parameter: tells an OOM that struck
    before any gradient was added (the rows not yet processed are redone) from one after (the
    window is redone).

    Attributes:
        added: a gradient was added since the last :meth:`reset` (True for good when the hooks
            cannot be placed: every OOM then redoes the whole window).
    """

    def __init__(self) -> None:
        self.added = False
        self._handles: List[Any] = []

    def watch(self, model: Any) -> None:
        """Hook ``model``'s trainable parameters. Never raises."""

        def added(_param):
            self.added = True

        try:
            for p in tt.unwrap(model).parameters():
                if p.requires_grad and type(p).__name__ != "DTensor":
                    self._handles.append(p.register_post_accumulate_grad_hook(added))
        except Exception:
            logger.warning("memguard: cannot watch the gradients; every OOM redoes the whole window",
                           exc_info=True)
            self.added = True

    def reset(self) -> None:
        self.added = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def loop_splitter(flat: LoopBatch, weighting: str, shift_labels: Optional[bool], model: Any) -> BatchSplitter:
    """The ``BatchSplitter`` of a loop batch: weights by ``weighting`` (``auto``: token shares when
    the batch has labels, else row shares); ``shift_labels`` None: shifted for a dict batch with
    ``input_ids`` and labels of one shape and a HF ``*ForCausalLM`` model.

    Raises:
        ValueError: a batch it cannot cut.
    """
    shift = shift_labels if shift_labels is not None else _causal_lm_batch(flat, model)
    sp = BatchSplitter(flat.mapping, weighting="rows" if weighting == "rows" else "tokens",
                       shift_labels=shift, label_key=flat.label_name)
    if weighting == "auto" and not sp.has_labels:
        sp = BatchSplitter(flat.mapping, weighting="rows", shift_labels=False, label_key=flat.label_name)
    return sp


def _causal_lm_batch(flat: LoopBatch, model: Any) -> bool:
    if flat.kind != "map":
        return False
    ids, labels = flat.mapping.get("input_ids"), flat.mapping.get(flat.label_name)
    if not (torch.is_tensor(ids) and torch.is_tensor(labels) and ids.shape == labels.shape):
        return False
    return type(tt.unwrap(model)).__name__.endswith("ForCausalLM") if model is not None else False


def chunk_context(model: Any, fsdp1: bool, ddp: Any, no_sync: bool):
    """The context one chunk's forward and backward run in: under FSDP1 every chunk reduce-scatters,
    also inside an ambient ``no_sync`` (``accelerator.accumulate``), which would keep FSDP1's
    unsharded gradients until the window's last backward; under DDP ``no_sync`` when ``no_sync``
    (not the window's last chunk, or memguard averages the gradients itself); else nothing."""
    if fsdp1:
        return _compat.fsdp1_sync_on(model)
    if ddp is not None and no_sync:
        return ddp.no_sync()
    return contextlib.nullcontext()
