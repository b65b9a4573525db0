"""Every Lightning-private name the Lightning adapter touches, in one place, with the versions it was
checked on (:data:`CHECKED`); :func:`check_version` warns once outside them. Each function says
what it falls back to when the name is gone.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from memguard_core.versions import warn_outside

logger = logging.getLogger("memguard.lightning")

#: lightning versions (major.minor, inclusive) these names were checked on.
CHECKED = ("2.6", "2.6")
#: The private names below.
NAMES = ("Trainer._logger_connector.should_update_logs",
         "fit_loop.epoch_loop.automatic_optimization._skip_backward")


def check_version() -> bool:
    """Warn once when the installed lightning lies outside :data:`CHECKED`; True inside."""
    return warn_outside("lightning", CHECKED, NAMES, logger)


def should_update_logs(trainer: Any) -> bool:
    """Lightning's own rule for whether this batch's logged values reach the loggers
    (``log_every_n_steps``), from ``trainer._logger_connector.should_update_logs``; True when it
    cannot be read (the figures are then logged at every batch)."""
    try:
        return bool(trainer._logger_connector.should_update_logs)
    except Exception:
        return True


def skip_backward(trainer: Any) -> Optional[bool]:
    """Whether Lightning's automatic optimization skips the backward (and so the zero_grad) of this
    batch (``fit_loop.epoch_loop.automatic_optimization._skip_backward``, set under
    ``Fabric.no_backward_sync``-style flows); None when the attribute is gone."""
    loop = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None), "automatic_optimization", None)
    value = getattr(loop, "_skip_backward", None)
    return None if value is None else bool(value)
