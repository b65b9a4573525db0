"""Every transformers-private name the HF adapter touches, in one place, with the versions it was
checked on (:data:`CHECKED`); :func:`check_version` warns once outside them. Each function says
what it falls back to when the name is gone.
"""

from __future__ import annotations

import logging
from typing import Any

from memguard_core.torch_train import attn_implementation  # noqa: F401  (shared with Lightning)
from memguard_core.versions import warn_outside

logger = logging.getLogger("memguard.hf")

#: transformers versions (major.minor, inclusive) these names were checked on.
CHECKED = ("5.24", "5.24")
#: The private names (and private uses of public objects) below.
NAMES = ("Trainer._loss_shifts_labels",
         "PretrainedConfig._attn_implementation (memguard_core.torch_train.attn_implementation)",
         "reordering Trainer.callback_handler.callbacks")


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
