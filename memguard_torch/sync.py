"""The out-of-memory sync points of a sharded run: how every rank learns, at the same collective
point, that one rank ran out of memory, so no rank waits forever in a collective the failed rank
never joins. :class:`OomSync` is the protocol (one MAX all-reduce of three integers per sync point,
on a gloo group of its own); :class:`FsdpSyncHooks` (FSDP2: inside FSDP's all-gathers and
reduce-scatters, module hooks as a fallback) and :class:`Fsdp1SyncHooks` (FSDP1) place the sync
points; a rank that learns of a peer's failure raises :class:`PeerOutOfMemoryError`. The protocol
and where the points sit: docs/torch_loop.md, "One rank runs out of memory".
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional, Tuple

import torch

from .distributed import all_reduce_max

from . import _compat

logger = logging.getLogger("memguard.torch")

__all__ = ["PeerOutOfMemoryError", "OomSync", "FsdpSyncHooks", "Fsdp1SyncHooks"]


class PeerOutOfMemoryError(RuntimeError):
    """Raised on a rank at a sync point when another rank ran out of memory in the same micro-batch:
    this rank stops before its next collective and redoes the micro-batch (or window) with the
    others. Its message says "out of memory", so OOM checks treat it as one."""

    def __init__(self, where: str = ""):
        super().__init__(f"out of memory on another rank (noticed {where or 'at a sync point'})")


class OomSync:
    """The sync points of one run (see the module doc).

    Args:
        group: the gloo group of the flags (``memguard_torch.distributed.flag_group``); None
            outside a process group (then every call answers locally).

    Attributes:
        inside: True while a micro-batch runs (sync points outside one do nothing, so evaluation
            forwards and the optimizer step issue no flag all-reduce).
        grads_added: a sync point after a backward compute passed on this rank in this
            micro-batch (the reduce-scatter that follows adds to the sharded gradients).
        points: sync points passed, for tests and the log.
    """

    def __init__(self, group: Optional[Any]):
        self.group = group
        self.inside = False
        self.grads_added = False
        self.points = 0

    def point(self, where: str) -> None:
        """A sync point inside a micro-batch.

        Raises:
            PeerOutOfMemoryError: another rank failed in this micro-batch.
        """
        if not self.inside or self.group is None:
            return
        self.points += 1
        if all_reduce_max([0, 0, 1], self.group)[0] > 0:
            raise PeerOutOfMemoryError(where)

    def end(self, flag: int) -> Tuple[int, int]:
        """The end of a micro-batch on this rank with ``flag`` (0 done, 1 stopped without adding a
        gradient, 2 stopped after adding some): waits, answering the sync points of ranks still
        inside, until every rank is at the end. Returns ``(max_flag, min_flag)`` over the ranks."""
        self.inside = False
        if self.group is None:
            return flag, flag
        while True:
            top, neg_low, inside = all_reduce_max([flag, -flag, 0], self.group)
            if inside == 0:
                return top, -neg_low


class _SyncBackward(torch.autograd.Function):
    """Identity in the forward; a sync point in the backward, before the gradient flows on to the
    node that produced the inputs (an FSDP pre-backward hook, or an FSDP post-backward)."""

    @staticmethod
    def forward(ctx, hooks, where, *tensors):
        ctx.hooks, ctx.where = hooks, where
        out = tuple(t.view_as(t) for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.hooks.backward_point(ctx.where)
        return (None, None) + grads


def _map_tensors(obj: Any, fn) -> Any:
    """``obj`` with ``fn`` applied to every tensor that requires grad, through tuples, lists and
    mappings (HF ``ModelOutput`` keeps its class: items are set on a shallow copy)."""
    if torch.is_tensor(obj):
        return fn(obj) if obj.requires_grad else obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, list):
        return [_map_tensors(v, fn) for v in obj]
    if hasattr(obj, "items") and hasattr(obj, "__setitem__"):
        import copy

        out = copy.copy(obj)
        for key, value in list(obj.items()):
            new = _map_tensors(value, fn)
            if new is not value:
                out[key] = new
        return out
    return obj


def _collect(obj: Any, found: List[torch.Tensor]) -> None:
    if torch.is_tensor(obj):
        if obj.requires_grad:
            found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _collect(v, found)
    elif hasattr(obj, "items"):
        for v in obj.values():
            _collect(v, found)


def _wrap(obj: Any, hooks: "FsdpSyncHooks", where: str) -> Any:
    """``obj`` with its grad-requiring tensors passed through one :class:`_SyncBackward` (one sync
    point for all of them: its backward runs once)."""
    found: List[torch.Tensor] = []
    _collect(obj, found)
    if not found or not torch.is_grad_enabled():
        return obj
    out = _SyncBackward.apply(hooks, where, *found)
    out = out if isinstance(out, tuple) else (out,)
    replaced = {id(t): o for t, o in zip(found, out)}
    return _map_tensors(obj, lambda t: replaced.get(id(t), t))


class FsdpSyncHooks:
    """Sync points on every FSDP2 module of a model (see the module doc for where and why).

    Args:
        model: the model (the root ``fully_shard``-ed module, or a module holding FSDP modules).
        sync: the run's :class:`OomSync`.

    Raises nothing at install; :meth:`remove` takes the hooks off and gives FSDP its comms back.
    """

    def __init__(self, model: Any, sync: OomSync):
        self.sync = sync
        self.handles: List[Any] = []
        self.comms: List[Tuple[Any, tuple]] = []
        self.hooked: List[str] = []
        self._callback_queued = False
        for m in _compat.fsdp_modules(model):
            name = type(m).__name__
            if not _compat.fsdp_has_params(m):
                # no parameters of its own, so no all-gather or reduce-scatter of its own: the
                # collectives it triggers (its children's, the root post-backward's) are theirs
                continue
            comms = _compat.sync_fsdp_comms(m, self._before_collective)
            if comms is not None:
                self.comms.append((m, comms))
                continue
            # a module whose comms cannot be wrapped: sync points around it instead (they sit
            # before the allocation of the collective's buffers, which then is not covered)
            self.hooked.append(name)
            # before FSDP's pre-forward (registered with prepend=True at fully_shard): its all-gather
            self.handles.append(m.register_forward_pre_hook(self._pre_forward(name), prepend=True))
            # after FSDP's pre-forward, which wrapped the inputs for its post-backward: a sync point
            # between this module's backward compute and its reduce-scatter
            self.handles.append(m.register_forward_pre_hook(self._wrap_inputs(name), with_kwargs=True))
            # after FSDP's post-forward, which hooked the outputs for its pre-backward all-gather
            self.handles.append(m.register_forward_hook(self._wrap_outputs(name)))
        if self.hooked:
            logger.info("memguard: FSDP modules synced by module hooks (comms not wrappable): %s",
                        ", ".join(sorted(set(self.hooked))))

    def remove(self) -> None:
        """Take every hook off and give FSDP its comms back."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for m, comms in self.comms:
            _compat.restore_fsdp_comms(m, comms)
        self.comms = []

    def new_chunk(self) -> None:
        """A chunk begins: a backward that an error aborted never ran its end-of-backward callback,
        so the next backward must queue its own."""
        self._callback_queued = False

    def _before_collective(self, kind: str) -> None:
        # FSDP allocated this collective's buffers already: a rank that ran out of memory doing so
        # never gets here, and its peers meet it at this point
        self.sync.point(f"before an FSDP {kind}")
        if kind == "reduce-scatter" and self.sync.inside:
            self.sync.grads_added = True

    def _pre_forward(self, name: str):
        def hook(module, args):
            self.sync.point(f"before the forward all-gather of {name}")
            return None
        return hook

    def _wrap_inputs(self, name: str):
        def hook(module, args, kwargs):
            if not self.sync.inside:
                return None
            return _wrap(args, self, f"after the backward of {name}"), _wrap(kwargs, self, f"after the backward of {name}")
        return hook

    def _wrap_outputs(self, name: str):
        def hook(module, args, output):
            if not self.sync.inside:
                return None
            return _wrap(output, self, f"before the backward of {name}")
        return hook

    def backward_point(self, where: str) -> None:
        """A sync point inside the backward; the first of a backward also queues the end-of-backward
        sync point, which then runs before FSDP's root post-backward callback (queued later, by
        FSDP's first pre-backward hook)."""
        if not self.sync.inside:
            return
        if not self._callback_queued:
            self._callback_queued = _compat.queue_backward_callback(self._end_of_backward)
        self.sync.point(where)
        if where.startswith("after"):
            self.sync.grads_added = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.sync.point("before FSDP's root post-backward")
        self.sync.grads_added = True


class Fsdp1SyncHooks:
    """Sync points in an FSDP1 (``FullyShardedDataParallel``) model's collectives: each handle's
    all-gather, after FSDP1 allocated the unsharded flat parameter, and each gradient reduction,
    after its buffers were allocated, through a communication hook doing what FSDP1's default path
    does (``memguard_torch._compat.sync_fsdp1_comms``). These are FSDP1's collectives in a forward
    and backward (hybrid strategies, which all-reduce across nodes too, are not hooked; with
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` its first iteration also all-gathers an order check, which
    has no sync point).

    Args:
        model: the model holding the FSDP1 modules (the root one first).
        sync: the run's :class:`OomSync`.

    Attributes:
        installed: False when the sync points could not be placed (a hybrid strategy, a
            communication hook the user registered): the run then has none under FSDP1.
    """

    def __init__(self, model: Any, sync: OomSync):
        self.sync = sync
        self._token = _compat.sync_fsdp1_comms(model, self._before_collective)
        self.installed = self._token is not None

    def new_chunk(self) -> None:
        """A chunk begins (nothing to reset under FSDP1: its end-of-backward callback is reset
        by ``memguard_torch.ranks.fsdp_after_abort`` after a failure)."""

    def remove(self) -> None:
        """Give FSDP1 its all-gathers and default reduction back."""
        if self._token is not None:
            _compat.restore_fsdp1_comms(self._token)
            self._token = None

    def _before_collective(self, kind: str) -> None:
        if kind == "all-reduce" and self.sync.inside:
            # NO_SHARD: autograd has already added this chunk's local gradient into the window's
            # .grad in place, so even a stop here leaves the sum changed
            self.sync.grads_added = True
        self.sync.point(f"before an FSDP1 {kind}")
        if kind == "reduce-scatter" and self.sync.inside:
            self.sync.grads_added = True
