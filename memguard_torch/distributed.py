"""Rank agreement on the micro-batches per batch k, shared by the torch adapters.

Under data parallelism every rank must run the same number of forwards and backwards per
optimizer step (DDP's gradient all-reduce fires in each synchronised backward), so the split k is
agreed as the MAX over ranks before every micro-batch. The agreement runs on a gloo process group
of its own with a CPU tensor: an all-reduce on the NCCL default group would need a device tensor,
and reading it back (``.item()``) would synchronise the device at every micro-batch. The side
group is created once, collectively, at the first agreement (every rank reaches it at its first
training step), as ``torch.distributed.new_group`` requires
(https://pytorch.org/docs/stable/distributed.html#torch.distributed.new_group).

torch is imported inside the functions only.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

logger = logging.getLogger("memguard.distributed")

__all__ = ["agree_max", "flag_group", "all_reduce_max"]

_GROUPS: dict = {}


def _side_group() -> Optional[Any]:
    """The gloo group for the agreement (cached per default group); ``None`` means the default
    group itself is gloo and is used directly."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo")
    return _GROUPS[key]


def agree_max(k: int) -> int:
    """The largest ``k`` over all ranks (``k`` itself outside an initialised process group of more
    than one rank).

    Raises:
        whatever ``torch.distributed`` raises (a dead peer, a timeout): the adapters catch it, log
        it and keep the local k.
    """
    dist = sys.modules.get("torch.distributed")   # not imported: no process group (hot path: no import)
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return k
    import torch

    t = torch.tensor([int(k)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_side_group())
    return int(t.item())


_FLAG_GROUPS: dict = {}


def flag_group() -> Optional[Any]:
    """A gloo process group of its own for out-of-memory flags (``memguard_torch``'s sync points),
    apart from the training's collectives and from :func:`agree_max`'s group, so a flag all-reduce
    can never pair with a gradient or parameter collective of another rank. Created at the first
    call, which every rank must make at the same point (``torch.distributed.new_group`` is
    collective); None outside an initialised process group of more than one rank."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    key = id(dist.group.WORLD)
    if key not in _FLAG_GROUPS:
        _FLAG_GROUPS[key] = dist.new_group(backend="gloo")
    return _FLAG_GROUPS[key]


def all_reduce_max(values: list, group: Optional[Any] = None) -> list:
    """The element-wise MAX of the integer list ``values`` over the ranks of ``group`` (a CPU int64
    all-reduce; ``values`` itself outside a process group). A MIN rides along as the MAX of the
    negated value.

    Raises:
        whatever ``torch.distributed`` raises (a dead peer, a timeout).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return [int(v) for v in values]
    import torch

    t = torch.tensor([int(v) for v in values], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]
