"""Resuming an mlx_lm run after ``memguard run`` restarted it: from mlx_lm's numbered adapter save.

``memguard run`` (``memguard_core.supervisor``) restarts a run the kernel or Metal killed and names
``<adapter_path>/NNNNNNN_adapters.safetensors`` (mlx_lm's save of iteration N, the largest N) in
``MEMGUARD_RESUME_FROM``. :func:`memguard_mlx.train` reads it (:func:`resume_adapter_file`) and
continues the run:

* the adapter weights are loaded (``model.load_weights(path, strict=False)``, as ``mlx_lm.lora
  --resume-adapter-file`` does); every key of the file must be a trainable parameter of the model;
* iterations go on at ``start + 1`` where ``start = (N // grad_accumulation_steps) *
  grad_accumulation_steps``: the weights saved at N are those of the last optimizer update at or
  before N (mlx_lm updates on iterations that are multiples of ``grad_accumulation_steps``), so a
  save inside an accumulation window redoes that window's first batches (their gradient was never
  applied) and no finished update is repeated;
* the first ``start`` training batches are drawn from ``iterate_batches`` and dropped, so iteration
  ``start + 1`` trains on the batch it would have had. mlx_lm's ``iterate_batches`` is deterministic
  given numpy's global generator (``mlx_lm.lora`` calls ``np.random.seed(args.seed)`` before
  ``train``): the training iterator draws one permutation per epoch and each validation pass (its
  own ``iterate_batches`` over the validation set) one more, in loop order, so the skip replays the
  validation passes of the skipped iterations' draws too (:func:`skip_batches`);
* the optimizer's ``step`` is set to the updates done (``start // grad_accumulation_steps``), so a
  learning-rate schedule (which mlx optimizers evaluate at ``step``) continues where it was, and
  the scheduled values are set as they were after that update (the reported learning rate).

What is not restored: mlx_lm saves no optimizer state, so Adam's / AdamW's moment estimates restart
at zero -- the first updates after a resume are those of a freshly started Adam at the saved weights
(with mlx's default ``bias_correction=False`` a first step of about ``(1 - beta1) / sqrt(1 - beta2)
= 3.2`` x the learning rate per coordinate for the default betas), and the run's later weights
differ from an uninterrupted run's. ``mx.random`` draws (LoRA dropout) after the resume differ from
the uninterrupted run's, ``trained_tokens`` in the reports count from the resume, and mlx_lm's
``it == 1`` validation pass is not repeated.
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
