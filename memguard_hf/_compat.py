"""Every transformers-private name the HF adapter touches, in one place, with the versions it was
checked on (:data:`CHECKED`); :func:`check_version` warns once outside them. Each function says
what it falls back to when the name is gone.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

from memguard_core.torch_train import attn_implementation  # noqa: F401  (shared with Lightning)
from memguard_core.versions import warn_outside

logger = logging.getLogger("memguard.hf")

#: transformers versions (major.minor, inclusive) these names were checked on.
CHECKED = ("5.24", "5.24")
#: The private names (and private uses of public objects) below.
NAMES = ("Trainer._loss_shifts_labels",
         "PretrainedConfig._attn_implementation (memguard_core.torch_train.attn_implementation)",
         "reordering Trainer.callback_handler.callbacks",
         "Trainer._get_num_items_in_batch (replaced on the instance during an evaluation batch)",
         "Seq2SeqTrainer._gen_kwargs")


def check_version() -> bool:
    """Warn once when the installed transformers lies outside :data:`CHECKED`; True inside."""
    return warn_outside("transformers", CHECKED, NAMES, logger)


def loss_shifts_labels(trainer: Any) -> bool:
    """Whether the trainer's loss shifts labels by one (causal LM), from
    ``trainer._loss_shifts_labels`` (set from the model's loss type); True when absent, the causal
    LM case every ``*ForCausalLM`` has."""
    return bool(getattr(trainer, "_loss_shifts_labels", True))


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
    no ``_get_num_items_in_batch``.
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
        return counted["n"]

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
