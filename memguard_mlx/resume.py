"""Resuming an mlx_lm run after ``memguard run`` restarted it: from mlx_lm's numbered adapter save.

:func:`resume_adapter_file` reads ``MEMGUARD_RESUME_FROM``
(``<adapter_path>/NNNNNNN_adapters.safetensors``); :func:`memguard_mlx.train` then loads the
adapter weights, goes on after the last optimizer update at or before N, drops the finished
iterations' batches (:func:`skip_batches`, replaying numpy's draws) and sets the optimizer's
``step``. What is and is not restored (Adam's moments are not): docs/mlx.md, "Resume after a
restart".

The guard's own state (micro-batches, validation micro-batches, budget, the preflight's changes)
goes into each numbered save's own safetensors metadata (:func:`guard_state_metadata`: the same
files as mlx_lm's, whose loaders ignore it) and comes back with the adapter file
(:func:`restore_guard_state`): docs/lifecycle.md, "What a resume restores".
"""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Any, Callable, Dict, Optional, Tuple

from memguard_core.errors import ConfigError
from memguard_core.guard_state import METADATA_KEY, parse_state_json
from memguard_core.resume import RESUME_ENV, checkpoint_step, resume_from_env

logger = logging.getLogger("memguard.mlx")
# a LoRA adapter's header names a few hundred arrays: kilobytes; a larger length is not a header
_MAX_HEADER_BYTES = 64 << 20

__all__ = ["resume_adapter_file", "resume_run", "resume_point", "load_adapter", "set_optimizer_step", "skip_batches",
           "guard_state_metadata", "restore_guard_state", "safetensors_metadata", "RESUME_ENV"]


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



def guard_state_metadata(guard: Any, it: int, eval_micro_batches: Optional[int]) -> Optional[Dict[str, str]]:
    """The string metadata mlx_lm's numbered save of iteration ``it`` carries:
    ``{METADATA_KEY: <guard.export_state(...) as JSON>}`` (``guard``: the
    ``memguard_core.guard.Guard``), None before the start or on a failure (logged). Never raises."""
    try:
        gs = guard.export_state(step=int(it), eval_micro_batches=eval_micro_batches, framework="mlx")
        return None if gs is None else {METADATA_KEY: json.dumps(gs.to_dict(), sort_keys=True, allow_nan=False)}
    except Exception:
        logger.warning("memguard: could not put the guard state in the adapter save", exc_info=True)
        return None


def safetensors_metadata(path: str) -> Dict[str, Any]:
    """The ``__metadata__`` of a safetensors file's header, read without loading its arrays (the
    format: an 8-byte little-endian header length, then the header's JSON; huggingface/safetensors
    README, "Format"); {} without one.

    Raises:
        OSError: the file cannot be read. ValueError: it is not a safetensors file.
    """
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES:
            raise ValueError(f"a header of {n} bytes")
        header = json.loads(fh.read(n).decode("utf-8"))
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def restore_guard_state(guard: Any, adapter_file: str) -> bool:
    """Before the guard's start of a run resumed from ``adapter_file``: hand ``guard`` (the
    ``memguard_core.guard.Guard``) the state saved in the file's metadata; True when it took one. A
    file without it (saved by mlx_lm itself) is said at INFO; an unreadable, corrupt or foreign state
    is logged and ignored. Never raises."""
    try:
        text = safetensors_metadata(adapter_file).get(METADATA_KEY)
        if text is None:
            logger.info("memguard: no guard state in %s (saved without memguard); the preflight decides", adapter_file)
            return False
        gs = parse_state_json(text, adapter_file, logger)
        return gs is not None and guard.restore_state(gs, adapter_file, step=checkpoint_step(adapter_file)) is not None
    except Exception as exc:
        logger.warning("memguard: the guard state in %s is not used (%s: %s); the preflight decides again",
                       adapter_file, type(exc).__name__, exc)
        return False
