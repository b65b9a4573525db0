"""Every transformers-private name the HF adapter touches, in one place, with the versions it was
checked on (:data:`CHECKED`); :func:`check_version` warns once outside them. Each function says
what it falls back to when the name is gone.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

from memguard_torch.train_reading import attn_implementation  # noqa: F401  (shared with Lightning)
from memguard_torch.train_reading import peft_base
from memguard_core.versions import warn_outside

logger = logging.getLogger("memguard.hf")

#: transformers versions (major.minor, inclusive) these names were checked on.
CHECKED = ("5.24", "5.24")
#: The private names (and private uses of public objects) below.
NAMES = ("Trainer._loss_shifts_labels",
         "Trainer.loss_is_scaled_for_ga / model_accepts_loss_kwargs / compute_loss_func",
         "TRL's DPOTrainer.loss_types and RewardTrainer's batch layout (chosen rows, then rejected rows)",
         "PretrainedConfig._attn_implementation (memguard_torch.train_reading.attn_implementation)",
         "reordering Trainer.callback_handler.callbacks",
         "Trainer._get_num_items_in_batch (replaced on the instance during an evaluation batch)",
         "Seq2SeqTrainer._gen_kwargs")


def check_version() -> bool:
    """Warn once when the installed transformers lies outside :data:`CHECKED`; True inside."""
    return warn_outside("transformers", CHECKED, NAMES, logger)


def loss_shifts_labels(trainer: Any) -> bool:
    """Whether the trainer's loss shifts labels by one (causal LM), from
    ``trainer._loss_shifts_labels`` (transformers >= 5: the model's loss type is the causal-LM
    loss and the model is no encoder-decoder); where absent, whether the (PEFT-unwrapped) model is a
    ``*ForCausalLM`` and no encoder-decoder."""
    flag = getattr(trainer, "_loss_shifts_labels", None)
    if flag is not None:
        return bool(flag)
    model = getattr(trainer, "model", None)
    base = peft_base(model)
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return False
    return type(base).__name__.endswith("ForCausalLM")


def trainer_says_loss_is_normalised(trainer: Any) -> bool:
    """The Trainer's own belief that ``compute_loss`` divided by ``num_items_in_batch`` (its
    ``loss_is_scaled_for_ga`` where set, else ``model_accepts_loss_kwargs`` or a
    ``compute_loss_func``), for a count that memguard could not observe (a Python number)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is not None:
        return bool(scaled)
    return bool(getattr(trainer, "model_accepts_loss_kwargs", False)
                or getattr(trainer, "compute_loss_func", None) is not None)


def compiled(trainer: Any) -> bool:
    """The run compiles its model (``TrainingArguments.torch_compile``, or a ``torch.compile``d
    module with ``_orig_mod``)."""
    if getattr(getattr(trainer, "args", None), "torch_compile", False):
        return True
    return hasattr(getattr(trainer, "model", None), "_orig_mod")


def _trl_class(trainer: Any, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def trl_pair_trainer(trainer: Any) -> Optional[str]:
    """``"dpo"`` / ``"reward"`` for TRL's ``DPOTrainer`` / ``RewardTrainer`` (and subclasses), whose
    batches stack the chosen rows, then the rejected rows of the same pairs (their collators:
    ``torch.cat((chosen, rejected))``; the loss ``chunk(2)``s them back); else None."""
    if _trl_class(trainer, "DPOTrainer"):
        return "dpo"
    if _trl_class(trainer, "RewardTrainer"):
        return "reward"
    return None


#: TRL DPO loss types that are a mean over pairs of a per-pair term (trl/trainer/dpo_trainer.py,
#: ``_compute_loss``: ``per_sequence_loss.mean()``); the others couple the batch's pairs
#: (``aot`` / ``aot_unpaired`` sort over the batch, ``bco_pair`` keeps a running mean of rewards it
#: updates per call, ``sft`` is a mean over the batch's chosen tokens)
DPO_PER_PAIR_LOSSES = frozenset({"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "sppo_hard",
                                 "apo_zero", "apo_down", "discopop", "sigmoid_norm"})


def trl_unsplittable_loss(trainer: Any) -> Optional[str]:
    """Why a TRL trainer's loss cannot be cut into micro-batches with the same gradient, or None:
    DPO loss types outside :data:`DPO_PER_PAIR_LOSSES`, a MoE router loss added by DPO (a mean over
    the batch's tokens routed, not over pairs)."""
    if trl_pair_trainer(trainer) != "dpo":
        return None
    types = getattr(trainer, "loss_types", None) or [getattr(getattr(trainer, "args", None), "loss_type", "sigmoid")]
    types = [types] if isinstance(types, str) else list(types)
    coupled = [t for t in types if t not in DPO_PER_PAIR_LOSSES]
    if coupled:
        return (f"TRL DPO loss type(s) {coupled} couple the pairs of a batch (not a mean of per-pair terms), so "
                f"micro-batches would change the gradient; use memguard's preflight plan "
                f"(per_device_train_batch_size / gradient_accumulation_steps) instead")
    if getattr(trainer, "aux_loss_enabled", False):
        return ("TRL DPO with the MoE router loss (a mean over the batch's routed tokens, not over pairs): "
                "micro-batches would change the gradient; use memguard's preflight plan instead")
    return None


def router_loss_in_loss(trainer: Any) -> Optional[str]:
    """Why a mixture-of-experts router (load-balancing) loss makes a split change the gradient, or
    None: the model adds it to its loss (``config.output_router_logits``: Mixtral, Qwen-MoE, ...,
    ``router_aux_loss_coef x load_balancing_loss_func(...)`` inside the forward), or TRL's SFT trainer
    adds it (``aux_loss_enabled``, ``weighted_aux_loss / steps``). It is a mean over the forward's
    routed tokens added whole to every forward, so k micro-batches would count it about k times."""
    model = getattr(trainer, "model", None)
    base = peft_base(model)
    on = bool(getattr(getattr(base, "config", None), "output_router_logits", False))
    if on or (_trl_class(trainer, "SFTTrainer") and getattr(trainer, "aux_loss_enabled", False)):
        return ("the model's mixture-of-experts router loss (output_router_logits) is a mean over each forward's "
                "tokens added whole to every micro-batch, so micro-batches would count it k times; use memguard's "
                "preflight plan (per_device_train_batch_size / gradient_accumulation_steps) instead")
    return None


def custom_loss_source(trainer: Any) -> Optional[str]:
    """What computes the loss when it is not the Trainer's or the model's own: ``"compute_loss_func"``,
    ``"<Class>.compute_loss"`` for an override memguard has no rule for; None for transformers'
    ``Trainer.compute_loss`` and TRL's SFT / DPO / reward trainers (rules in
    ``memguard_hf.loss_weights``)."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "compute_loss_func"
    for cls in type(trainer).__mro__:
        if "compute_loss" in vars(cls):
            mod = cls.__module__
            if mod.startswith("transformers.") or (mod.startswith("trl.") and cls.__name__ in (
                    "SFTTrainer", "DPOTrainer", "RewardTrainer")):
                return None
            return f"{cls.__name__}.compute_loss"
    return None


def move_callback_first(trainer: Any, callback: Any) -> None:
    """Put ``callback`` first in ``trainer.callback_handler.callbacks``, so the memory figures it
    adds to the logs in ``on_log`` reach the printer and the reporting integrations called after
    it. Leaves the order alone when the handler has no such list."""
    callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
    if isinstance(callbacks, list) and callback in callbacks:
        callbacks.remove(callback)
        callbacks.insert(0, callback)


def counts_items(trainer: Any) -> bool:
    """Whether the trainer has ``_get_num_items_in_batch``, which :func:`count_items_once` replaces."""
    return callable(getattr(trainer, "_get_num_items_in_batch", None))


@contextlib.contextmanager
def count_items_once(trainer: Any, batch: Any) -> Iterator[Optional[dict]]:
    """While one evaluation batch runs in chunks: ``trainer._get_num_items_in_batch`` (which
    ``Trainer.prediction_step`` calls at each call, and which all-gathers the count over the ranks
    with ``average_tokens_across_devices``) counts the whole ``batch`` at its first call and returns
    that count at every later one, so each chunk's loss is normalised by the batch's count and the
    gather runs once per batch, as unsplit, however many chunks and retries there are.

    Yields a dict that holds the count under ``"n"`` once it was taken (absent when
    ``prediction_step`` never asked for it); None, leaving the trainer alone, when the trainer has
    no ``_get_num_items_in_batch``. A callable the caller puts under ``"wrap"`` is applied to the
    count each time it is handed out (``memguard_hf.loss_weights.watch_items``).
    """
    if not counts_items(trainer):
        yield None
        return
    orig = trainer._get_num_items_in_batch
    own = "_get_num_items_in_batch" in vars(trainer)
    counted: dict = {}

    def once(batch_samples, device, *args, **kwargs):
        if "n" not in counted:
            # set only after the count (and its gather) went through: a chunk that failed before
            # it leaves the next attempt to take it
            counted["n"] = orig([batch], device, *args, **kwargs)
        wrap = counted.get("wrap")
        return wrap(counted["n"]) if wrap is not None else counted["n"]

    trainer._get_num_items_in_batch = once
    try:
        yield counted
    finally:
        if own:
            trainer._get_num_items_in_batch = orig
        else:
            del trainer._get_num_items_in_batch


def generation_kwargs(trainer: Any) -> dict:
    """The ``generate`` kwargs ``Seq2SeqTrainer.evaluate`` / ``predict`` stored for its
    ``prediction_step`` (``trainer._gen_kwargs``); {} when absent."""
    kw = getattr(trainer, "_gen_kwargs", None)
    return kw if isinstance(kw, dict) else {}


def training_columns(trainer: Any, dataset: Any) -> Any:
    """``dataset`` with the columns the model's forward does not take removed, as the ``Trainer``
    does before batching (its private ``_remove_unused_columns``; a datasets ``Dataset`` only); the
    dataset itself where that cannot be done."""
    fn = getattr(trainer, "_remove_unused_columns", None)
    if fn is None or not getattr(trainer.args, "remove_unused_columns", False) or not hasattr(dataset, "column_names"):
        return dataset
    try:
        return fn(dataset, description="training")
    except Exception:
        return dataset
