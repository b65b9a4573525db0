"""How each micro-batch's loss is weighted under the HF ``Trainer``, so that the micro-batches of a
batch add up to the gradient and the logged loss of the unsplit batch (docs/lifecycle.md, "Loss
weights of the HF Trainer").

A micro-batch's loss is either already divided by the batch's own normaliser (the Trainer's
``num_items_in_batch``: causal LMs, label smoothing, TRL's SFT loss) and needs weight 1, or a mean
over the micro-batch (encoder heads, seq2seq, most custom losses) and needs the micro-batch's share
of what the mean runs over: valid label tokens, or rows. Which one is not a property the Trainer
knows (it reads the forward's signature, and many models take ``**kwargs`` and ignore the count),
so it is observed: the count goes into each micro-batch's ``compute_loss`` as an
:class:`ItemsProbe` that records whether the loss computed with its value.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch

from . import _compat

__all__ = ["ItemsProbe", "watch_items", "LossWeights"]

logger = logging.getLogger("memguard.hf")

# torch functions that carry the count along without computing with it: their tensor results stay
# probes; metadata reads neither use nor carry it
_CARRY = frozenset({"to", "cpu", "cuda", "detach", "clone", "contiguous", "as_tensor", "tensor", "type",
                    "long", "float", "double", "int", "view", "reshape", "expand", "unsqueeze", "squeeze",
                    "__deepcopy__", "requires_grad_"})
_METADATA = frozenset({"__get__", "dim", "size", "numel", "is_floating_point", "__repr__", "__format__", "__str__",
                       "element_size", "__len__", "__hash__", "is_complex", "get_device", "stride", "data_ptr",
                       "__reduce_ex__", "storage_offset", "is_contiguous", "__setstate__"})


class ItemsProbe(torch.Tensor):
    """The Trainer's ``num_items_in_batch`` (a 0-dim or ``(n_gpu,)`` tensor) as it enters one
    micro-batch's ``compute_loss``: any torch computation with it (a division, ``item()``, a
    comparison) sets ``used``; moves and copies (``to``, ``detach``, ``as_tensor``) stay probes.
    Results of a computation are plain tensors, so nothing downstream (the loss, its graph) is a probe.
    """

    used: list

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probes = [a for a in list(args) + list(kwargs.values()) if isinstance(a, ItemsProbe)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _METADATA:
            return out
        if name in _CARRY and probes:
            if isinstance(out, torch.Tensor) and not isinstance(out, ItemsProbe):
                with torch._C.DisableTorchFunctionSubclass():
                    out = out.as_subclass(ItemsProbe)
                out.used = probes[0].used
            return out
        for p in probes:
            p.used[0] = True
        return out


def watch_items(num_items_in_batch: Any) -> Tuple[Any, Optional[list]]:
    """``(value to pass on, flag)``: for a tensor count, an :class:`ItemsProbe` of it and its
    one-element ``used`` list (read after the micro-batch's ``compute_loss``); for anything else
    (None, a Python number) the value itself and None (not observable)."""
    if not isinstance(num_items_in_batch, torch.Tensor) or isinstance(num_items_in_batch, ItemsProbe):
        return num_items_in_batch, None
    with torch._C.DisableTorchFunctionSubclass():
        probe = num_items_in_batch.as_subclass(ItemsProbe)
    probe.used = [False]
    return probe, probe.used


class LossWeights:
    """The HF run's loss-weighting rules: which share a micro-batch that is a mean over itself is
    weighted by, whether labels are shifted, the paired layout of TRL's preference trainers, the
    losses a split cannot reproduce, and the notices said once when the rule is an assumption.

    Args:
        trainer: the bound ``transformers.Trainer`` (or subclass).
        loss_weighting: the guard option: ``auto`` (share of valid label tokens when the batch has
            labels, of rows otherwise; said once where that is an assumption), ``tokens`` or ``rows``.
    """

    def __init__(self, trainer: Any, loss_weighting: str = "auto"):
        self.trainer = trainer
        self.option = loss_weighting
        self._said = False

    # ------------------------------------------------------------------ the batch layout
    @property
    def paired(self) -> bool:
        """The batch stacks the pairs of a preference trainer: rows ``[chosen_0..P-1, rejected_0..P-1]``
        (TRL's ``DPOTrainer`` and ``RewardTrainer``); a micro-batch takes whole pairs."""
        return _compat.trl_pair_trainer(self.trainer) is not None

    def weighting(self, inputs: Any) -> str:
        """``tokens`` or ``rows``: the share a micro-batch's mean loss is weighted by."""
        if self.option in ("tokens", "rows"):
            return self.option
        if self.paired or not torch.is_tensor(_labels_of(inputs)):
            return "rows"
        return "tokens"

    def shift(self, inputs: Any) -> bool:
        """Whether the loss shifts the labels by one (a causal LM's): the Trainer's own rule
        (``_loss_shifts_labels``, from the model's loss type; never for encoder-decoders) where it
        has one, else a ``*ForCausalLM`` model; never for labels of another shape than the input ids."""
        labels, ids = _labels_of(inputs), inputs.get("input_ids") if hasattr(inputs, "get") else None
        if not (torch.is_tensor(labels) and torch.is_tensor(ids) and labels.shape == ids.shape):
            return False
        return _compat.loss_shifts_labels(self.trainer)

    # ------------------------------------------------------------------ refusals and notices
    def refusal(self) -> Optional[str]:
        """Why this run's loss cannot be split into micro-batches with the same gradient (checked at
        train start; None: it can)."""
        return _compat.trl_unsplittable_loss(self.trainer) or _compat.router_loss_in_loss(self.trainer)

    def weight(self, share: float, used: Optional[list], num_items_in_batch: Any, inputs: Any) -> float:
        """The factor for one micro-batch's loss: 1.0 where the loss computed with the count
        (already normalised over the whole batch), else ``share`` (the micro-batch's part of the
        batch's rows or valid label tokens); a count that could not be observed (a Python number)
        is taken the Trainer's way (``loss_is_scaled_for_ga``)."""
        if used is not None:
            if used[0]:
                return 1.0
        elif num_items_in_batch is not None and _compat.trainer_says_loss_is_normalised(self.trainer):
            return 1.0
        self._notice(inputs)
        return share

    def _notice(self, inputs: Any) -> None:
        """Say once, at the first micro-batch weighted by its share, what that share assumes when
        the loss is not one of the Trainer's own (a ``compute_loss`` override memguard does not
        know, a ``compute_loss_func``, a model loss without labels in the batch)."""
        if self._said or self.option != "auto":
            return
        self._said = True
        kind = self.weighting(inputs)
        what = "valid label tokens" if kind == "tokens" else "rows"
        source = _compat.custom_loss_source(self.trainer)
        if source is None and torch.is_tensor(_labels_of(inputs)):
            logger.info("memguard: each micro-batch's loss is weighted by its share of the batch's %s (the loss is "
                        "a mean over them and does not use num_items_in_batch)", what)
            return
        source = source or "the model's own loss (no labels in the batch)"
        other = "rows" if kind == "tokens" else "tokens"
        logger.warning("memguard: %s does not use num_items_in_batch; each micro-batch's loss is taken as a mean "
                       "over its %s and weighted by its share of the batch's %s. If the loss is a mean over %s, "
                       "set loss_weighting=%r; if it is neither, a split changes the gradient "
                       "(docs/lifecycle.md, \"Loss weights of the HF Trainer\")", source, what, what, other, other)


def _labels_of(inputs: Any) -> Any:
    if not hasattr(inputs, "get"):
        return None
    shifted = inputs.get("shift_labels")
    return shifted if torch.is_tensor(shifted) else inputs.get("labels")
