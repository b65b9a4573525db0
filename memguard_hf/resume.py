"""Resume support for the ``memguard run`` supervisor.

A callback cannot choose where ``Trainer.train`` resumes from: ``train(resume_from_checkpoint=...)``
loads the weights, optimizer, scheduler, RNG states and ``trainer_state.json`` *before* the first
callback event (transformers ``Trainer.train`` -> ``_load_from_checkpoint``, then
``TrainerState.load_from_json``; ``on_train_begin`` comes later, inside the inner loop). So the
training script passes the checkpoint::

    from memguard_hf import MemGuardCallback, resume_checkpoint
    trainer.add_callback(MemGuardCallback())
    trainer.train(resume_from_checkpoint=resume_checkpoint())

On a first run ``resume_checkpoint()`` returns None and the run starts from step 0; after an
out-of-memory kill the supervisor restarts the script with ``MEMGUARD_RESUME_FROM`` set to the
latest ``checkpoint-N`` of the output dir, and the Trainer goes on after step N without
repeating a finished optimizer step (it skips the batches already consumed in the epoch).
"""

from __future__ import annotations

import logging
from typing import Optional

from memguard_core.resume import RESUME_ENV, resume_from_env

logger = logging.getLogger("memguard.hf")

__all__ = ["RESUME_ENV", "resume_checkpoint"]


def resume_checkpoint(default: Optional[str] = None) -> Optional[str]:
    """The checkpoint directory named in ``MEMGUARD_RESUME_FROM``, else ``default``.

    Args:
        default: returned when the variable is unset or empty (e.g. a user's own
            ``--resume_from_checkpoint`` value).

    Returns:
        A directory path, or ``default``. A variable naming something that is not a directory
        is logged (``memguard.hf``) and ignored: the run starts as it would without it.
        The rule is :func:`memguard_core.resume.resume_from_env` with ``framework="hf"``.
    """
    return resume_from_env("hf", default, log=logger)
