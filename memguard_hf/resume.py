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

The guard's own state (micro-batches, evaluation micro-batches, budget, the preflight's changes)
goes into each ``checkpoint-N`` folder as ``memguard_state.json`` (:func:`save_guard_state`, at
``on_save``) and comes back when the run resumes (:func:`restore_guard_state`, at
``on_train_begin``); transformers' own callback-state restore (``ExportableState``) is not used: it
builds new callback instances, which would not be the one bound to the Trainer (docs/lifecycle.md,
"What a resume restores").
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Optional, Tuple

from memguard_core.guard_state import FILE_NAME, read_state, write_state
from memguard_core.resume import RESUME_ENV, resume_from_env

logger = logging.getLogger("memguard.hf")

__all__ = ["RESUME_ENV", "resume_checkpoint", "save_guard_state", "restore_guard_state", "checkpoint_folder"]

#: transformers.trainer_utils.PREFIX_CHECKPOINT_DIR: ``Trainer._save_checkpoint`` writes
#: ``<output_dir>/checkpoint-<global_step>``.
CHECKPOINT_PREFIX = "checkpoint"


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


def checkpoint_folder(args: Any, state: Any) -> str:
    """The folder ``Trainer._save_checkpoint`` has just written when ``on_save`` runs:
    ``<args.output_dir>/checkpoint-<state.global_step>`` (transformers ``Trainer._save_checkpoint``;
    a hyper-parameter search's trial folder is not covered)."""
    return os.path.join(str(args.output_dir), f"{CHECKPOINT_PREFIX}-{int(state.global_step)}")


def save_guard_state(guard: Any, args: Any, state: Any, *, eval_micro_batches: Optional[int] = None) -> Optional[str]:
    """At ``on_save``: write ``guard.export_state(...)`` into the checkpoint folder just saved, from
    the process that writes checkpoints (``args.should_save``). Returns the file written, or None
    (another process, no state before the start, no folder, a failed write: logged). Never raises."""
    try:
        if not getattr(args, "should_save", True):
            return None
        gs = guard.export_state(step=int(state.global_step), eval_micro_batches=eval_micro_batches, framework="hf")
        folder = checkpoint_folder(args, state)
        if gs is None or not os.path.isdir(folder):
            logger.debug("memguard: no guard state saved for step %s (%s)", state.global_step,
                         "not started" if gs is None else f"no folder {folder}")
            return None
        path = os.path.join(folder, FILE_NAME)
        return path if write_state(path, gs, logger) else None
    except Exception:
        logger.warning("memguard: could not save the guard state with the checkpoint", exc_info=True)
        return None


def _folder_being_resumed(trainer: Any) -> Optional[str]:
    """The ``resume_from_checkpoint`` folder ``Trainer.train`` / ``_inner_training_loop`` is
    running with, read from their frame on the call stack (``on_train_begin`` is called from
    ``_inner_training_loop``; ``train`` has already resolved ``True`` to a folder), or None."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            loc = frame.f_locals
            if loc.get("self") is trainer and isinstance(loc.get("resume_from_checkpoint"), (str, os.PathLike)):
                return os.fspath(loc["resume_from_checkpoint"])
            frame = frame.f_back
    finally:
        del frame
    return None


def resumed_folder(trainer: Any, args: Any, state: Any) -> Tuple[Optional[str], Optional[int]]:
    """``(folder, step)`` of the checkpoint this run resumes from, at ``on_train_begin``: with
    ``state.global_step > 0`` (the Trainer loaded a checkpoint's ``trainer_state.json``) the
    folder ``train(resume_from_checkpoint=...)`` names, else ``MEMGUARD_RESUME_FROM``, else
    ``<output_dir>/checkpoint-<global_step>``, and that step; without, the folder
    ``MEMGUARD_RESUME_FROM`` names (a script that did not pass it on, starting at step 0) and no
    step; ``(None, None)`` for a run that starts afresh."""
    step = int(getattr(state, "global_step", 0) or 0)
    env = resume_from_env("hf", None, log=logger)
    if step > 0:
        return (_folder_being_resumed(trainer) or env or checkpoint_folder(args, state)), step
    return env, None


def restore_guard_state(guard: Any, trainer: Any, args: Any, state: Any) -> bool:
    """At ``on_train_begin``, before ``guard.start``: hand the guard the state saved in the
    checkpoint this run resumes from (:func:`resumed_folder`); True when it took one. A missing,
    corrupt or foreign file is logged and ignored (``memguard_core.guard_state.read_state``).
    Never raises."""
    try:
        folder, step = resumed_folder(trainer, args, state)
        if folder is None:
            return False
        path = os.path.join(folder, FILE_NAME)
        gs = read_state(path, logger)
        return gs is not None and guard.restore_state(gs, path, step=step) is not None
    except Exception:
        logger.warning("memguard: could not read the guard state of the resumed checkpoint", exc_info=True)
        return False
