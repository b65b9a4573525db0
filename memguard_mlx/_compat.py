"""Every mlx_lm-private name the MLX adapter touches, in one place, with the versions it was checked
on (:data:`CHECKED`); :func:`check_version` warns once outside them. The code copied from mlx_lm's
``train()`` lives apart, in ``memguard_mlx._mlx_lm_loop`` (its header names the upstream file and
version, :data:`UPSTREAM_VERSION`).
"""

from __future__ import annotations

import logging
from typing import Any

from mlx_lm.tuner import trainer as _mlt

from memguard_core.versions import warn_outside

logger = logging.getLogger("memguard.mlx")

#: mlx-lm versions (major.minor, inclusive) these names were checked on.
CHECKED = ("0.32", "0.32")
#: The mlx-lm release ``memguard_mlx._mlx_lm_loop`` copies ``train()`` from.
UPSTREAM_VERSION = "0.32.2"
#: The private names below (and the copied loop).
NAMES = ("mlx_lm.tuner.trainer.TrainUI (and its _console)", "mlx_lm.tuner.trainer._clear_cache",
         "mlx.optimizers.Optimizer._schedulers (mlx 0.32)",
         f"the train() loop copied from mlx-lm {UPSTREAM_VERSION} (memguard_mlx._mlx_lm_loop)")

#: mlx_lm's console UI of ``train()`` (``mlx_lm.cli_ui.TrainUI``, as ``mlx_lm.tuner.trainer`` imports it).
TrainUI = _mlt.TrainUI
#: mlx_lm's own evaluation loop and activation checkpointing (public functions of the module).
evaluate = _mlt.evaluate
grad_checkpoint = _mlt.grad_checkpoint


def check_version() -> bool:
    """Warn once when the installed mlx-lm lies outside :data:`CHECKED`; True inside."""
    return warn_outside("mlx-lm", CHECKED, NAMES, logger)


def clear_cache(threshold: int) -> None:
    """mlx_lm's ``_clear_cache(threshold)``: ``mx.clear_cache()`` when the cache holds more than
    ``threshold`` bytes (``TrainingArgs.clear_cache_threshold``); the same rule, written here, when
    the private function is gone."""
    fn = getattr(_mlt, "_clear_cache", None)
    if fn is not None:
        fn(threshold)
        return
    import mlx.core as mx

    if mx.get_cache_memory() > threshold:
        mx.clear_cache()


def print_muted(ui: Any, text: str) -> None:
    """Print ``text`` muted on the ``TrainUI``'s console (``ui._console``), between its progress
    lines; through ``print`` when the console is gone."""
    console = getattr(ui, "_console", None)
    if console is not None:
        console.print(f"  [ui.muted]{text}[/ui.muted]")
    else:
        print(f"  {text}")


def optimizer_schedulers(optimizer: Any) -> dict:
    """``{name: schedule}`` of an mlx optimizer's scheduled hyper-parameters (the private
    ``Optimizer._schedulers`` of mlx 0.32, which ``apply_gradients`` evaluates at ``step`` before
    every update); {} when the attribute is gone (logged: a resumed run then reports the initial
    learning rate until its first update, which still uses the schedule at ``step``)."""
    scheds = getattr(optimizer, "_schedulers", None)
    if not isinstance(scheds, dict):
        logger.warning("memguard: the optimizer's schedules are not readable (mlx changed "
                       "Optimizer._schedulers); the reported learning rate is set at the first update")
        return {}
    return dict(scheds)
