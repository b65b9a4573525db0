"""Resuming an mlx_lm run after ``memguard run`` restarted it: from mlx_lm's numbered adapter save.

:func:`resume_adapter_file` reads ``MEMGUARD_RESUME_FROM``
(``<adapter_path>/NNNNNNN_adapters.safetensors``); :func:`memguard_mlx.train` then loads the
adapter weights, goes on after the last optimizer update at or before N, drops the finished
iterations' batches (:func:`skip_batches`, replaying numpy's draws) and sets the optimizer's
``step``. What is and is not restored (Adam's moments are not): docs/mlx.md, "Resume after a
restart".
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional, Tuple

from memguard_core.errors import ConfigError
from memguard_core.resume import RESUME_ENV, checkpoint_step, resume_from_env

logger = logging.getLogger("memguard.mlx")

__all__ = ["resume_adapter_file", "resume_run", "resume_point", "load_adapter", "set_optimizer_step", "skip_batches",
           "RESUME_ENV"]


def resume_adapter_file() -> Optional[str]:
    """The adapter file named in ``MEMGUARD_RESUME_FROM`` (set by ``memguard run`` on a restart),
    or None when the variable is unset or empty. A variable naming something that is not an
    existing ``.safetensors`` file is logged (``memguard.mlx``) and ignored: the run starts from
    the beginning. The rule is ``memguard_core.resume.resume_from_env`` with ``framework="mlx"``."""
    return resume_from_env("mlx", None, log=logger)


def resume_point(path: str, grad_accumulation_steps: int, field: str = RESUME_ENV) -> Tuple[int, int]:
    """``(start, updates)`` for a resume from ``path``: the iterations already done (training goes
    on at ``start + 1``) and the optimizer updates they made; ``start = updates *
    grad_accumulation_steps`` with ``updates = N // grad_accumulation_steps`` for mlx_lm's save of
    iteration N (``NNNNNNN_adapters.safetensors``).

    Raises:
        ConfigError: the file name carries no iteration (``adapters.safetensors``), naming ``field``.
    """
    n = checkpoint_step(path)
    if n is None or not str(path).endswith("_adapters.safetensors"):
        raise ConfigError(field, "mlx_lm's numbered save <adapter_path>/NNNNNNN_adapters.safetensors", path)
    updates = n // int(grad_accumulation_steps)
    return updates * int(grad_accumulation_steps), updates


def load_adapter(model: Any, path: str, field: str = RESUME_ENV) -> int:
    """Load the adapter weights in ``path`` into ``model`` (``load_weights(strict=False)``, as
    ``mlx_lm.lora`` resumes); returns the number of arrays loaded.

    Raises:
        ConfigError: the file holds no arrays, or arrays that are not trainable parameters of
            ``model`` (another model's adapters), naming ``field``.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = mx.load(str(path))
    trainable = dict(tree_flatten(model.trainable_parameters()))
    foreign = sorted(k for k in weights if k not in trainable)
    if not weights or foreign:
        raise ConfigError(field, "adapter weights saved from this model's trainable parameters",
                          f"{path} ({'no arrays' if not weights else 'not in the model: ' + ', '.join(foreign[:3])})")
    bad = [k for k, v in weights.items() if tuple(v.shape) != tuple(trainable[k].shape)]
    if bad:
        raise ConfigError(field, "adapter weights of this model's shapes", f"{path} ({', '.join(bad[:3])})")
    model.load_weights(list(weights.items()), strict=False)
    mx.eval(model.parameters())
    return len(weights)


def set_optimizer_step(optimizer: Any, updates: int) -> None:
    """Set an mlx optimizer's ``step`` to ``updates`` (what its schedules are evaluated at) and
    each scheduled hyper-parameter to its value after update ``updates`` (``schedule(updates -
    1)``: ``apply_gradients`` evaluates the schedule before it increments ``step``). Call before
    the first update; ``Optimizer.init`` keeps ``step``."""
    import mlx.core as mx

    from ._compat import optimizer_schedulers

    if updates <= 0:
        return
    optimizer.state["step"] = mx.array(updates, mx.uint64)
    for name, schedule in optimizer_schedulers(optimizer).items():
        optimizer.state[name] = schedule(mx.array(updates - 1, mx.uint64))


def skip_batches(iterate_batches: Callable, start: int, *, val_dataset: Any, args: Any,
                 world: Any) -> Callable:
    """``iterate_batches`` whose training iterator (``loop=True``) first draws and drops ``start``
    batches, replaying after each skipped iteration the numpy draw of the validation pass mlx_lm's
    ``train()`` made there (``it == 1`` or ``it % steps_per_eval == 0``, with a validation set and
    ``val_batches != 0``: ``evaluate`` starts an ``iterate_batches`` over the validation set, which
    draws one permutation when its first batch is taken). Validation calls (``loop`` false) pass
    through. ``start`` 0: ``iterate_batches`` itself."""
    if start <= 0:
        return iterate_batches

    def validation_draw() -> None:
        gen = iterate_batches(dataset=val_dataset, batch_size=args.batch_size,
                              max_seq_length=args.max_seq_length, comm_group=world)
        next(gen, None)

    def resumed(**kw):
        gen = iterate_batches(**kw)
        if kw.get("loop"):
            for it in range(1, start + 1):
                next(gen)
                if val_dataset and args.val_batches != 0 and (it == 1 or it % args.steps_per_eval == 0
                                                              or it == args.iters):
                    validation_draw()
        yield from gen

    return resumed


def resume_from_arg(resume_from: Any) -> Optional[str]:
    """``train``'s ``resume_from``: None reads ``MEMGUARD_RESUME_FROM`` (:func:`resume_adapter_file`),
    False never resumes, a path resumes from that file.

    Raises:
        ConfigError: a path that is not an existing file, or another type.
    """
    if resume_from is None:
        return resume_adapter_file()
    if resume_from is False:
        return None
    if isinstance(resume_from, (str, os.PathLike)) and os.path.isfile(resume_from):
        return os.fspath(resume_from)
    raise ConfigError("resume_from", "None (MEMGUARD_RESUME_FROM), False, or an existing adapter file", resume_from)


def resume_run(model: Any, optimizer: Any, resume_from: Any, grad_accumulation_steps: int) -> Tuple[Optional[str], int]:
    """Prepare a resumed run (``train``'s ``resume_from``, see :func:`resume_from_arg`): load the
    adapter weights into ``model``, set ``optimizer``'s step; returns ``(path, start)``, the file
    resumed from and the iterations already done (``(None, 0)``: not resuming).

    Raises:
        ConfigError: see :func:`resume_from_arg`, :func:`resume_point`, :func:`load_adapter` (the
            field named is ``resume_from``, or ``MEMGUARD_RESUME_FROM`` for the variable's file).
    """
    path = resume_from_arg(resume_from)
    if not path:
        return None, 0
    field = RESUME_ENV if resume_from is None else "resume_from"
    start, updates = resume_point(path, grad_accumulation_steps, field)
    load_adapter(model, path, field)
    set_optimizer_step(optimizer, updates)
    logger.warning("memguard: resuming from %s: %d iterations (%d optimizer updates) done, going on at "
                   "iteration %d; the optimizer's moments restart at zero (mlx_lm saves none)",
                   path, start, updates, start + 1)
    return path, start
