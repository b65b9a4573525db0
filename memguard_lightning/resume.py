"""Resume support for the ``memguard run`` supervisor (Lightning).

After the kernel kills a run for memory, ``memguard run`` starts the script again with
``MEMGUARD_RESUME_FROM`` naming the latest ModelCheckpoint ``.ckpt`` (``last.ckpt`` by
Lightning's own ``ckpt_path="last"`` rule, else the file with the largest ``step=N``; see
:mod:`memguard_core.resume`). A callback cannot choose it: only ``fit``'s ``ckpt_path`` argument
reaches ``Trainer._run``, which restores the model and callback states
(``_restore_modules_and_callbacks``) and then the optimizer, scheduler and loop states with
``global_step`` and the epoch's batch progress (``restore_training_state``) before the fit loop
starts. So the script passes it::

    from memguard_lightning import MemGuardCallback, resume_checkpoint
    trainer = L.Trainer(callbacks=[MemGuardCallback(), ModelCheckpoint(every_n_train_steps=1, save_last=True)])
    trainer.fit(model, datamodule, ckpt_path=resume_checkpoint())

On a first run ``resume_checkpoint()`` returns None (``fit`` starts at step 0); after a kill the
restored loops go on after the checkpoint's step without repeating a finished optimizer step.

The guard's own state (micro-batches, evaluation micro-batches, budget, the preflight's changes)
is the callback's ``state_dict``, which Lightning keeps in the ``.ckpt`` under the callback's
``state_key`` and hands back to ``load_state_dict`` on a resume (:func:`guard_state_dict`,
:func:`restore_guard_state`; docs/lifecycle.md, "What a resume restores").
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from memguard_core.resume import RESUME_ENV, resume_from_env

logger = logging.getLogger("memguard.lightning")

__all__ = ["RESUME_ENV", "resume_checkpoint", "guard_state_dict", "restore_guard_state"]


def resume_checkpoint(default: Optional[str] = None) -> Optional[str]:
    """The ``.ckpt`` file named in ``MEMGUARD_RESUME_FROM``, else ``default``.

    Args:
        default: returned when the variable is unset or empty, e.g. ``"last"`` (Lightning's own
            resolution) or a user's ``--ckpt_path``.

    Returns:
        A ``.ckpt`` file path for ``trainer.fit(ckpt_path=...)``, or ``default``. A variable naming
        something that is not an existing ``.ckpt`` file (a stale path, an HF ``checkpoint-N``
        folder) is logged (``memguard.lightning``) and ignored: the run starts as it would
        without it. The rule is :func:`memguard_core.resume.resume_from_env` with
        ``framework="lightning"``.
    """
    return resume_from_env("lightning", default, log=logger)


def guard_state_dict(guard: Any, trainer: Any, eval_micro_batches: Optional[int]) -> dict:
    """The callback's ``state_dict``: ``guard.export_state(...)`` as a JSON-safe dict at
    ``trainer.global_step`` ({} before the guard started, or when it fails: logged). Never raises."""
    try:
        step = getattr(trainer, "global_step", None)
        gs = guard.export_state(step=None if step is None else int(step), eval_micro_batches=eval_micro_batches,
                                framework="lightning")
        return gs.to_dict() if gs is not None else {}
    except Exception:
        logger.warning("memguard: could not save the guard state in the checkpoint", exc_info=True)
        return {}


def restore_guard_state(guard: Any, state: Any, ckpt_path: Any) -> bool:
    """The callback's ``load_state_dict``: hand ``guard`` the saved state (from ``ckpt_path``, for
    the log line), taken back at its next start. True when usable; {} (a checkpoint saved before
    the guard started) is passed over, anything else unusable is logged. Never raises."""
    try:
        source = str(ckpt_path) if ckpt_path else "the Lightning checkpoint"
        return guard.restore_state(state, source) is not None
    except Exception:
        logger.warning("memguard: could not take back the guard state of the checkpoint", exc_info=True)
        return False
