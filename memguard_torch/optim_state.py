"""Optimizer states allocated before the first step, so an optimizer step never allocates them.

Why: ``torch.optim.Adam`` / ``AdamW`` create ``exp_avg`` / ``exp_avg_sq`` (2 x the trainable
parameters, more with ``amsgrad``) lazily, inside the first ``optimizer.step()``. That allocation
comes after the whole accumulation window's forwards and backwards, when the window's gradients are
complete, and no re-split can make it smaller: the gradients, the parameters and the states are the
same at any k. An out-of-memory error there is also not safely redoable in general: a step that
fails half-way may already have updated some states or parameters in place.

memguard's answer (docs/lifecycle.md, "optimizer step"): allocate the states up front, before the
first forward, exactly as the optimizer's lazy initialisation would (zeros of the parameter's shape,
dtype, device and memory format, a ``step`` of 0 where the optimizer keeps it), so the memory the
step would have taken is already held when the first window runs. A shortfall then shows up as an
out-of-memory error in a forward or a backward, which the guard survives by redoing the window with
more micro-batches. The first step's result is unchanged: the optimizer finds the states it would
have created and uses them.

torch is imported inside the functions only.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

logger = logging.getLogger("memguard.optim")

__all__ = ["preallocate_optimizer_state", "unwrap_optimizer", "prepare_optimizer"]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside wrappers (accelerate's ``AcceleratedOptimizer``,
    Lightning's ``LightningOptimizer``): follows ``.optimizer`` / ``._optimizer`` a few levels."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _adam_state(p: Any, group: dict) -> dict:
    """What ``torch.optim.Adam._init_group`` creates for ``p`` (torch 2.x)."""
    import torch

    # Adam's _get_scalar_dtype: float64 only under a float64 default dtype and not fused; fused /
    # capturable keep the step on the parameter's device, the others on the CPU
    fused = bool(group.get("fused"))
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32
    on_device = fused or bool(group.get("capturable"))
    step = torch.zeros((), dtype=dtype, device=p.device if on_device else "cpu")
    state = {"step": step,
             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def preallocate_optimizer_state(optimizer: Any) -> int:
    """Create the lazily-allocated states of every trainable parameter that has none yet, as the
    optimizer's first step would. Supported: ``torch.optim.Adam`` and its subclasses (``AdamW``),
    dense parameters. Other optimizers are left to allocate lazily (logged at debug). A parameter
    that already has state (a resumed run) is left alone.

    Args:
        optimizer: a ``torch.optim.Optimizer`` or a wrapper of one (see :func:`unwrap_optimizer`).

    Returns:
        bytes allocated (0 when nothing was, or on failure).

    Never raises: an allocation failure removes the states it created (the optimizer then creates
    them lazily, as without memguard) and is logged as a warning.
    """
    created = []
    try:
        import torch

        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, torch.optim.Adam):
            logger.debug("memguard: optimizer %s keeps its lazy states", type(opt).__name__)
            return 0
        total = 0
        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad or p.is_sparse or len(opt.state.get(p, {})) != 0:
                    continue
                opt.state[p] = _adam_state(p, group)
                created.append(p)
                total += sum(t.numel() * t.element_size() for t in opt.state[p].values() if t.dim() > 0)
        if total:
            logger.info("memguard: optimizer states allocated before the first step (%.2f GiB), so the "
                        "step cannot run out of memory creating them", total / 2**30)
        return total
    except Exception as exc:
        try:
            opt = unwrap_optimizer(optimizer)
            for p in created:
                opt.state.pop(p, None)
        except Exception:
            pass
        logger.warning("memguard: could not allocate the optimizer states up front (%s); the optimizer "
                       "creates them at its first step", exc)
        return 0


def prepare_optimizer(optimizer: Any, guard: Any, rows: Callable[[], int],
                      is_oom: Callable[[BaseException], bool]) -> None:
    """Before the first forward: allocate ``optimizer``'s lazy states
    (:func:`preallocate_optimizer_state`) and wrap its ``step`` on the instance so an out-of-memory
    error inside the update itself raises ``guard.optimizer_step_oom(...)`` (``WindowOOMError``,
    phase "optimizer step", with the plan) instead of the allocator's bare error. An error raised
    by a ``closure`` passed to ``step`` (Lightning runs the training step and backward in one) is
    not the update's and passes through unchanged. Wrapped once (``step._memguard_step``). Never
    raises: a failure is logged and the optimizer keeps its lazy states.

    Args:
        optimizer: a torch optimizer (or a wrapper of one: accelerate's, Lightning's).
        guard: the run's ``memguard_core.guard.Guard``.
        rows: returns the rows of the batch the step ends (for the error's plan).
        is_oom: the adapter's test for an out-of-memory error.
    """
    try:
        preallocate_optimizer_state(optimizer)
        orig_step = optimizer.step
        if getattr(orig_step, "_memguard_step", False):
            return

        # functools.wraps keeps the LR scheduler's marker on the step (it warns otherwise)
        @functools.wraps(orig_step)
        def step(*args: Any, **kwargs: Any) -> Any:
            closure_failed = [False]
            closure = kwargs.get("closure", args[0] if args else None)
            if callable(closure):
                def watched() -> Any:
                    try:
                        return closure()
                    except BaseException:
                        closure_failed[0] = True
                        raise
                if "closure" in kwargs:
                    kwargs["closure"] = watched
                else:
                    args = (watched,) + tuple(args[1:])
            try:
                return orig_step(*args, **kwargs)
            except Exception as exc:
                if closure_failed[0] or not is_oom(exc):
                    raise
                mon = guard.monitor
                raise guard.optimizer_step_oom(exc, mon.micro_batches if mon is not None else 1, rows()) from exc

        step._memguard_step = True
        optimizer.step = step
    except Exception:
        logger.warning("memguard: could not prepare the optimizer; it allocates its states lazily",
                       exc_info=True)
