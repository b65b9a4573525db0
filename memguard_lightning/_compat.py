"""Every Lightning-private name the Lightning adapter touches, in one place, with the versions it was
checked on (:data:`CHECKED`; the DDP attributes: :data:`TORCH_CHECKED`); :func:`check_version` warns
once outside them. Each function says what it falls back to when the name is gone.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

from memguard_core.versions import warn_outside

logger = logging.getLogger("memguard.lightning")

#: lightning versions (major.minor, inclusive) these names were checked on.
CHECKED = ("2.6", "2.6")
#: The private names below.
NAMES = ("Trainer._logger_connector.should_update_logs", "LightningModule._current_fx_name",
         "Strategy._forward_redirection (patches LightningModule.forward)",
         "fit_loop.epoch_loop.automatic_optimization._skip_backward",
         "fit_loop._should_accumulate",
         "DDPStrategy._ddp_comm_hook", "DDPStrategy._ddp_comm_state", "DDPStrategy._model_averaging_period")
#: torch versions (major.minor) the ``DistributedDataParallel`` attributes below were checked on.
TORCH_CHECKED = ("2.13", "2.13")
#: The torch attributes the DDP window uses (read by DDP's forward, not underscored but undocumented).
TORCH_NAMES = ("DistributedDataParallel.require_backward_grad_sync",
               "DistributedDataParallel.require_forward_param_sync")


def check_version() -> bool:
    """Warn once when the installed lightning lies outside :data:`CHECKED` (torch outside
    :data:`TORCH_CHECKED`); True inside both."""
    ok = warn_outside("lightning", CHECKED, NAMES, logger)
    return warn_outside("torch", TORCH_CHECKED, TORCH_NAMES, logger) and ok


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


def window_ends(trainer: Any) -> Optional[bool]:
    """Whether Lightning steps the optimizer after this batch (``not fit_loop._should_accumulate()``:
    the last batch of an accumulation window, or the epoch's last batch); None when it cannot be
    read (memguard then leaves DDP's gradient all-reduce to DDP)."""
    try:
        return not bool(trainer.fit_loop._should_accumulate())
    except Exception:
        return None


def ddp_reduces_its_own_way(strategy: Any, ddp: Any) -> Optional[str]:
    """Why the DDP gradients must stay DDP's to reduce (None: plain averaging is what DDP does): a
    communication hook or model averaging set on Lightning's ``DDPStrategy`` (``_ddp_comm_hook``,
    ``_ddp_comm_state``, ``_model_averaging_period``), or DDP's ``static_graph`` (its first
    iteration's delayed all-reduce is queued by the synchronised forward). An attribute that is gone
    reads as unset."""
    if any(getattr(strategy, name, None) is not None
           for name in ("_ddp_comm_hook", "_ddp_comm_state", "_model_averaging_period")):
        return "a DDP communication hook or model averaging reduces the gradients"
    if getattr(ddp, "static_graph", False):
        return "DDP's static_graph"
    return None


def ddp_sync_off(ddp: Any) -> Optional[bool]:
    """Switch DDP's ``require_backward_grad_sync`` off (what ``no_sync`` sets) and return what it
    was. Called inside ``training_step``, which Lightning runs inside DDP's forward: DDP reads the
    flag in its ``_post_forward`` and, when it is on, prepares the reducer, whose hooks would then
    all-reduce in the backward of the returned loss (torch ``nn/parallel/distributed.py``, checked on
    :data:`TORCH_CHECKED`). None when the attribute is missing (nothing changed)."""
    try:
        was = bool(ddp.require_backward_grad_sync)
        ddp.require_backward_grad_sync = False
        return was
    except Exception:
        logger.debug("memguard: cannot switch DDP's gradient sync off", exc_info=True)
        return None


def ddp_sync_restore(ddp: Any, was: bool) -> None:
    """Put back what :func:`ddp_sync_off` returned. Never raises."""
    try:
        ddp.require_backward_grad_sync = was
    except Exception:
        logger.debug("memguard: cannot restore DDP's gradient sync flag", exc_info=True)


def ddp_buffers_at_next_forward(ddp: Any) -> None:
    """After memguard averaged a window's gradients: set ``require_forward_param_sync`` as a
    synchronised forward leaves it, so DDP broadcasts the module buffers at the next forward as it
    does after each optimizer step of an unguarded run (checked on :data:`TORCH_CHECKED`). Every
    rank calls it at the same point. Never raises."""
    try:
        ddp.require_forward_param_sync = True
    except Exception:
        logger.debug("memguard: cannot set DDP's forward sync flag", exc_info=True)


@contextlib.contextmanager
def logging_as(pl_module: Any, fx_name: str) -> Iterator[None]:
    """``self.log`` calls inside are filed as made from hook ``fx_name``: Lightning files logged
    values under the hook being run (``LightningModule._current_fx_name``, set by its
    ``_call_strategy_hook``; inside Lightning's backward it is ``backward``), so a
    ``training_step``'s values replayed from the wrapped ``backward`` are filed as the unguarded
    run files them. The previous name is put back on exit. Never raises."""
    was = getattr(pl_module, "_current_fx_name", None)
    try:
        pl_module._current_fx_name = fx_name
    except Exception:
        logger.debug("memguard: cannot set the module's current hook name", exc_info=True)
    try:
        yield
    finally:
        try:
            pl_module._current_fx_name = was
        except Exception:
            logger.debug("memguard: cannot restore the module's current hook name", exc_info=True)


_NO_ATTR = object()


@contextlib.contextmanager
def forward_patch_undone_on_error(pl_module: Any) -> Iterator[None]:
    """Around a call of the strategy's ``training_step``: if it raises, the module's ``forward`` is
    put back as it was. Lightning's forward redirection (``strategies/strategy.py``
    ``_ForwardRedirection.__call__``) sets ``pl_module.forward`` to a function that calls
    ``training_step`` and only that function puts the real ``forward`` back; an error in the
    wrapper's forward before it reaches the module (an FSDP1 root's unshard running out of memory,
    a peer's failure at the root's all-gather) leaves the patch, and the next redirection would keep
    it as the "original" (a later ``self(...)`` would run ``training_step``). Never raises itself."""
    was = pl_module.__dict__.get("forward", _NO_ATTR)
    try:
        yield
    except BaseException:
        try:
            if was is _NO_ATTR:
                pl_module.__dict__.pop("forward", None)
            else:
                pl_module.__dict__["forward"] = was
        except Exception:
            logger.debug("memguard: cannot put the module's forward back", exc_info=True)
        raise


def tensor_parallel_size(strategy: Any) -> Optional[int]:
    """The size of ``ModelParallelStrategy``'s ``tensor_parallel`` mesh dimension (its public
    ``device_mesh``); None when it cannot be read."""
    try:
        return int(strategy.device_mesh["tensor_parallel"].size())
    except Exception:
        return None


def forward_context(trainer: Any) -> Optional[Any]:
    """The context Lightning runs ``training_step`` in (its precision plugin's autocast:
    ``Precision.forward_context``), as a zero-argument callable; None where it cannot be read."""
    plugin = getattr(trainer, "precision_plugin", None)
    ctx = getattr(plugin, "forward_context", None)
    return ctx if callable(ctx) else None
