"""Every torch-private name (and private use of a public object) the plain-loop adapter touches, in
one place, with the torch versions it was checked on (:data:`CHECKED`); :func:`check_version` warns
once outside them. Each function says what it falls back to when the name is gone.

FSDP2 (``torch.distributed.fsdp.fully_shard``) is public since torch 2.6;
``FSDPModule.reset_iter_state`` (the recovery after an exception aborted a forward or backward) is
public in 2.13. What memguard still reads privately is listed in :data:`NAMES`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional

from .train_reading import ddp_after_abort, find_ddp  # noqa: F401  (used through _compat)
from memguard_core.versions import warn_outside

logger = logging.getLogger("memguard.torch")

#: torch versions (major.minor, inclusive) these names were checked on.
CHECKED = ("2.13", "2.13")
#: The private names below.
NAMES = ("FSDPModule._get_fsdp_state()._fsdp_param_groups[].fsdp_params[].unsharded_param / "
         "unsharded_accumulated_grad",
         "FSDPParamGroup._all_gather_comm / _reduce_scatter_comm (the comms set_custom_* replaces)",
         "FSDPState._is_root",
         "FSDPParamGroup.post_forward_mesh_info / offload_policy / mesh_info.shard_mesh_size (the layout "
         "fully_shard was given: reshard_after_forward, offload_policy, the shard mesh dimension)",
         "DistributedDataParallel.bucket_bytes_cap / gradient_as_bucket_view (set in __init__, undocumented)",
         "DistributedDataParallel.require_forward_param_sync (undocumented)",
         "torch.autograd.Variable._execution_engine.queue_callback",
         "FullyShardedDataParallel._sync_gradients (FSDP1: the flag its no_sync context clears)",
         "FSDP1 FlatParamHandle._all_gather_flat_param (called by unshard() after the allocation)",
         "FSDP1 state._comm_hook / _comm_hook_state / _gradient_predivide_factor / "
         "_gradient_postdivide_factor / process_group / sharding_strategy / _is_root",
         "FSDP1 torch.distributed.fsdp._runtime_utils._post_backward_final_callback, "
         "FlatParamHandle._free_unsharded_flat_param / uses_sharded_strategy and the "
         "FlatParameter's .grad / _saved_grad_shard / _post_backward_called")


def check_version() -> bool:
    """Warn once when the installed torch lies outside :data:`CHECKED`; True inside."""
    return warn_outside("torch", CHECKED, NAMES, logger)


def fsdp_module_type() -> Optional[type]:
    """``torch.distributed.fsdp.FSDPModule`` (the class every ``fully_shard``-ed module becomes an
    instance of); None on a torch without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except Exception:
        return None


def fsdp_modules(model: Any) -> List[Any]:
    """The ``fully_shard``-ed modules of ``model`` (itself included), in ``modules()`` order (the
    root first when the root is sharded); [] without FSDP2."""
    cls = fsdp_module_type()
    if cls is None or model is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def fsdp1_modules(model: Any) -> List[Any]:
    """The FSDP1 ``FullyShardedDataParallel`` modules of ``model`` (itself included; public
    ``FullyShardedDataParallel.fsdp_modules``); [] without them."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        return list(FullyShardedDataParallel.fsdp_modules(model)) if model is not None else []
    except Exception:
        return []


@contextlib.contextmanager
def fsdp1_sync_on(model: Any) -> Iterator[int]:
    """Inside: every FSDP1 (``FullyShardedDataParallel``) module of ``model`` reduce-scatters its
    gradients in the backward, also inside FSDP1's ``no_sync`` (which clears ``_sync_gradients`` on
    every FSDP module and would keep unsharded gradients until the window's last backward; torch
    ``distributed/fsdp/fully_sharded_data_parallel.py``, checked on :data:`CHECKED`). The flags are
    put back on exit (``no_sync``'s own exit asserts they are still cleared). Yields the number of
    FSDP1 modules set; 0 without FSDP1 or where the flag is gone (nothing changed)."""
    saved = []
    for m in fsdp1_modules(model):
        if not hasattr(m, "_sync_gradients"):
            logger.debug("memguard: FSDP1 module without _sync_gradients; its sync left as it is")
            continue
        saved.append((m, m._sync_gradients))
        m._sync_gradients = True
    try:
        yield len(saved)
    finally:
        for m, was in saved:
            m._sync_gradients = was


class _Fsdp1Reduce:
    """The state of memguard's FSDP1 communication hook: the process group and FSDP1's own pre- /
    post-division factors, so the hook reduces exactly as FSDP1's default path does
    (``_runtime_utils._reduce_grad`` / ``_reduce_grad_no_shard``: divide, collective, divide)."""

    def __init__(self, root: Any, before):
        self.group = root.process_group
        self.pre = float(getattr(root, "_gradient_predivide_factor", 1.0))
        self.post = float(getattr(root, "_gradient_postdivide_factor", 1.0))
        self.before = before


def _fsdp1_hook(cs: "_Fsdp1Reduce", grad: Any, output: Any = None) -> None:
    """FSDP1's gradient reduction with ``cs.before(kind)`` right before the collective: the
    buffers are allocated by then (``_get_reduce_scatter_tensors`` ran). ``output`` None: the
    ``NO_SHARD`` all-reduce (FSDP1's hook signature 1), else the reduce-scatter (signature 2)."""
    import torch.distributed as dist

    cs.before("reduce-scatter" if output is not None else "all-reduce")
    if cs.pre > 1:
        grad.div_(cs.pre)
    if output is None:
        dist.all_reduce(grad, group=cs.group)
        target = grad
    else:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(output, grad, group=cs.group)
        target = output
    if cs.post > 1:
        target.div_(cs.post)


def sync_fsdp1_comms(model: Any, before) -> Optional[tuple]:
    """Put ``before(kind)`` right before each collective of an FSDP1 model's forward and backward,
    after its buffers are allocated: each handle's all-gather (an instance attribute over
    ``FlatParamHandle._all_gather_flat_param``, which ``unshard()`` calls after allocating the
    unsharded flat parameter) and each gradient reduction (a communication hook, FSDP1's public
    ``register_comm_hook``, doing what FSDP1's default path does). Returns what
    :func:`restore_fsdp1_comms` needs, or None (nothing changed) without FSDP1 modules, under a
    hybrid strategy (FSDP1 refuses comm hooks there), or when a communication hook is already
    registered (the user's). Never raises."""
    mods = fsdp1_modules(model)
    if not mods:
        return None
    try:
        root = mods[0]
        if not root.check_is_root():
            return None
        from torch.distributed.fsdp._init_utils import HYBRID_SHARDING_STRATEGIES

        if any(m.sharding_strategy in HYBRID_SHARDING_STRATEGIES or m._comm_hook is not None
               or m.process_group is not root.process_group for m in mods):
            return None   # the hook reduces over the root's group with its factors
        root.register_comm_hook(_Fsdp1Reduce(root, before), _fsdp1_hook)
    except Exception:
        logger.debug("memguard: cannot register the FSDP1 communication hook", exc_info=True)
        return None
    handles = []
    for m in mods:
        h = getattr(m, "_handle", None)
        if h is None or "_all_gather_flat_param" in vars(h):
            continue
        orig = h._all_gather_flat_param

        def all_gather(padded_unsharded_flat_param, _orig=orig):
            before("all-gather")
            return _orig(padded_unsharded_flat_param)

        h._all_gather_flat_param = all_gather
        handles.append(h)
    return mods, handles


def restore_fsdp1_comms(token: tuple) -> None:
    """Undo :func:`sync_fsdp1_comms`. Never raises."""
    mods, handles = token
    for h in handles:
        h.__dict__.pop("_all_gather_flat_param", None)
    for m in mods:
        try:
            m._comm_hook = None
            m._comm_hook_state = None
        except Exception:
            logger.debug("memguard: cannot take the FSDP1 communication hook off", exc_info=True)


#: Why batches are not split under FSDP1 parameter offload (each adapter adds the plan to apply).
FSDP1_OFFLOAD_NO_SPLIT = ("FSDP1 with parameter offload (CPUOffload(offload_params=True)) keeps one offloaded "
                          "gradient per step, which micro-batches that each reduce-scatter would overwrite")


def fsdp1_offloads_params(model: Any) -> bool:
    """Whether an FSDP1 module of ``model`` offloads its parameters (``CPUOffload(offload_params=
    True)``): FSDP1 then cannot sum the gradients of several synchronised backwards (its offloaded
    ``_cpu_grad`` is overwritten by each reduce-scatter; torch's ``FullyShardedDataParallel``
    docstring lists gradient accumulation under CPU offload as unsupported)."""
    return any(getattr(getattr(m, "cpu_offload", None), "offload_params", False) for m in fsdp1_modules(model))


def reset_fsdp1_after_abort(model: Any) -> bool:
    """After an exception aborted an FSDP1 forward or backward (a peer stopped mid-way too): each
    flat parameter's gradient put back to the sharded sum of the chunks that completed (FSDP1's
    pre-backward moved it to ``_saved_grad_shard``; an unsharded ``.grad`` the aborted backward
    computed but did not reduce-scatter is dropped), then FSDP1's own end-of-backward cleanup
    (``_post_backward_final_callback`` on the root: reshards every handle still unsharded, removes
    the aborted iteration's post-backward hook state, resets the training states, the prefetch
    flags and the execution-order tracker, and lets the next backward queue its callback again),
    the unsharded storage an unshard allocated before its all-gather freed, and
    (``use_orig_params``) the original parameters and their gradient views put back in the
    modules. A chunk whose reduce-scatter ran on some rank has added to the sums: the caller then
    zeroes them and redoes the window. Returns False without FSDP1 modules or when the cleanup
    failed (logged). Never raises."""
    mods = fsdp1_modules(model)
    if not mods:
        return False
    try:
        from torch.distributed.fsdp._runtime_utils import _post_backward_final_callback

        kept = {}
        for m in mods:
            h = getattr(m, "_handle", None)
            if h is None:
                continue
            fp = h.flat_param
            shard = None
            if hasattr(fp, "_saved_grad_shard"):
                shard = fp._saved_grad_shard
                delattr(fp, "_saved_grad_shard")
            elif fp.grad is not None and fp.grad.size() == fp._local_shard.size():
                shard = fp.grad
            # an unsharded .grad is this chunk's, never reduced: dropped
            fp.grad = None          # put back once the handle uses its shard again (sizes must match)
            fp._post_backward_called = False
            kept[id(h)] = shard
        root = next((m for m in mods if getattr(m, "_is_root", False)), mods[0])
        # with the sync flag on, as in the chunk: the callback then waits for the post-backward
        # stream (an accelerator's in-flight reduce-scatter) before the window is touched
        with fsdp1_sync_on(model):
            _post_backward_final_callback(root, root)
        for m in mods:
            h = getattr(m, "_handle", None)
            if h is None:
                continue
            if h.uses_sharded_strategy:
                # an unshard stopped between its allocation and its all-gather leaves the unsharded
                # storage allocated while the handle still uses its shard: the next unshard would
                # take it for gathered and skip the all-gather its peers run (needs_unshard())
                h._free_unsharded_flat_param()
            h.flat_param.grad = kept.get(id(h))
            if getattr(h, "_use_orig_params", False):
                # a forward aborted inside a unit left that unit's original parameters replaced by
                # plain tensor views (FSDP1's ``_use_unsharded_views(as_params=False)`` in the
                # forward; its post-forward reshard would have put the parameters back). The final
                # callback's reshard does that for sharded handles, but skips a NO_SHARD handle (its
                # data is its local shard already: ``_catch_all_reshard``'s early return), which is
                # every handle in one process: put the parameters back for every handle
                h._use_sharded_views()
                h._use_sharded_grad_views()
        return True
    except Exception:
        logger.error("memguard: FSDP1's state could not be reset after the aborted step", exc_info=True)
        return False


def fsdp_root(model: Any) -> Optional[Any]:
    """The root FSDP module (the one ``reset_iter_state`` must be called on): the first FSDP module
    whose state says ``_is_root`` (set at FSDP's lazy init, the first forward), else the first in
    ``modules()`` order; None without FSDP2 modules."""
    mods = fsdp_modules(model)
    for m in mods:
        try:
            if m._get_fsdp_state()._is_root:
                return m
        except Exception:
            break
    return mods[0] if mods else None


def fsdp_has_params(module: Any) -> bool:
    """Whether an FSDP2 module manages parameters of its own (``FSDPState._fsdp_param_groups``
    non-empty). One without (a root whose submodules were all sharded apart, as accelerate's
    ``fsdp2_prepare_model`` does with ``transformer_layer_cls_to_wrap``) issues no collective of its
    own. True when the name is gone (the caller then treats it as one that does)."""
    try:
        return len(module._get_fsdp_state()._fsdp_param_groups) > 0
    except Exception:
        return True


def _fsdp_params(module: Any) -> Iterator[Any]:
    try:
        state = module._get_fsdp_state()
        for group in state._fsdp_param_groups:
            yield from group.fsdp_params
    except Exception:
        logger.debug("memguard: cannot read FSDP parameters", exc_info=True)


def reset_fsdp_after_abort(model: Any) -> bool:
    """After an exception aborted a forward or backward of an FSDP2 model: FSDP's own recovery
    (``FSDPModule.reset_iter_state`` on the root: waits on in-flight collectives, reshards, clears
    the iteration trackers, lets the next backward queue its final callback again), then the
    unsharded gradients the aborted backward computed but did not reduce-scatter are dropped
    (``FSDPParam.unsharded_param.grad``, ``unsharded_accumulated_grad``: FSDP's next post-backward
    would otherwise reduce them together with the redone chunk's). Returns True when FSDP had a
    ``reset_iter_state``; False without FSDP modules or on a torch without it (the run then may not
    recover: logged). Never raises."""
    root = fsdp_root(model)
    if root is None:
        return False
    ok = False
    try:
        reset = getattr(root, "reset_iter_state", None)
        if callable(reset):
            reset()
            ok = True
        else:
            logger.error("memguard: this torch's FSDP has no reset_iter_state; FSDP's state after the "
                         "aborted step may be inconsistent")
    except Exception:
        logger.warning("memguard: FSDP reset_iter_state failed", exc_info=True)
    for m in fsdp_modules(model):
        for p in _fsdp_params(m):
            try:
                up = getattr(p, "_unsharded_param", None)
                if up is not None:
                    up.grad = None
                if getattr(p, "unsharded_accumulated_grad", None) is not None:
                    p.unsharded_accumulated_grad = None
            except Exception:
                logger.debug("memguard: cannot drop an unsharded gradient", exc_info=True)
    return ok


def queue_backward_callback(fn) -> bool:
    """Queue ``fn`` to run when the running backward ends, before the callbacks queued after it
    (``Variable._execution_engine.queue_callback``, what FSDP2 uses for its root post-backward).
    Call only from inside a backward. False when the name is gone (no callback queued)."""
    try:
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(fn)
        return True
    except Exception:
        logger.debug("memguard: cannot queue a backward callback", exc_info=True)
        return False


class _SyncedComm:
    """An FSDP2 ``AllGather`` / ``ReduceScatter`` comm that calls ``before(kind)`` after FSDP has
    allocated the collective's buffers (``allocate``, the step that can run out of memory) and
    right before the collective itself; everything else is the comm FSDP had."""

    def __init__(self, inner: Any, before, kind: str):
        self.inner, self.before, self.kind = inner, before, kind

    def allocate(self, *args, **kwargs):
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.before(self.kind)
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def sync_fsdp_comms(module: Any, before) -> Optional[tuple]:
    """Put ``before(kind)`` (``kind``: ``all-gather`` / ``reduce-scatter``) right before each of an
    FSDP2 module's collectives, after their buffers are allocated: ``FSDPModule.set_custom_all_gather``
    / ``set_custom_reduce_scatter`` (public) with comms wrapping the ones FSDP had (read from the
    private ``FSDPParamGroup._all_gather_comm`` / ``_reduce_scatter_comm``). Returns the original
    comms for :func:`restore_fsdp_comms`, or None when the module cannot take them (no parameters,
    several parameter groups, or the names are gone): the caller then hooks the module instead."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) != 1:
            return None
        ag, rs = groups[0]._all_gather_comm, groups[0]._reduce_scatter_comm
        module.set_custom_all_gather(_SyncedComm(ag, before, "all-gather"))
        module.set_custom_reduce_scatter(_SyncedComm(rs, before, "reduce-scatter"))
        return ag, rs
    except Exception:
        logger.debug("memguard: cannot wrap the FSDP comms of %s", type(module).__name__, exc_info=True)
        return None


def restore_fsdp_comms(module: Any, comms: tuple) -> None:
    """Give an FSDP2 module back the comms :func:`sync_fsdp_comms` replaced. Never raises."""
    try:
        module.set_custom_all_gather(comms[0])
        module.set_custom_reduce_scatter(comms[1])
    except Exception:
        logger.debug("memguard: cannot restore the FSDP comms", exc_info=True)


def ddp_layout(ddp: Any) -> dict:
    """``TrainSpec`` keywords of a live ``DistributedDataParallel``: ``sharding="ddp"``, its
    ``bucket_cap_mb`` (from ``bucket_bytes_cap``, bytes) and ``gradient_as_bucket_view``; only
    ``sharding`` when the attributes are gone."""
    out: dict = {"sharding": "ddp"}
    try:
        cap = int(ddp.bucket_bytes_cap)
        if cap > 0:
            out["bucket_cap_mb"] = cap / (1 << 20)
        if isinstance(ddp.gradient_as_bucket_view, bool):
            out["gradient_as_bucket_view"] = ddp.gradient_as_bucket_view
    except Exception:
        logger.debug("memguard: cannot read DDP's bucket settings", exc_info=True)
    return out


def fsdp2_layout(model: Any, world_size: int) -> dict:
    """``TrainSpec`` keywords of a ``fully_shard``-ed model, read from its parameter groups before
    the first forward: ``fsdp-grad-op`` when a non-root unit keeps its parameters unsharded after
    forward (``reshard_after_forward=False``: no ``post_forward_mesh_info``; the root's is cleared
    at FSDP's lazy init when left to its default, ``FSDPState._auto_reshard_after_forward``, so it
    does not count), ``fsdp-hybrid`` with
    ``shard_group_size`` when the shard mesh dimension is smaller than ``world_size`` (HSDP),
    else ``fsdp-full``; ``offload="params"`` under ``CPUOffloadPolicy``. ``{}`` without FSDP2
    modules; ``fsdp-full`` alone when the private names are gone."""
    mods = fsdp_modules(model)
    if not mods:
        return {}
    out: dict = {"sharding": "fsdp-full", "fsdp_version": 2}
    try:
        groups = []
        for i, m in enumerate(mods):
            for g in m._get_fsdp_state()._fsdp_param_groups:
                groups.append((i, g))
        if any(i > 0 and g.post_forward_mesh_info is None for i, g in groups):
            out["sharding"] = "fsdp-grad-op"
        shard = min((int(g.mesh_info.shard_mesh_size) for _, g in groups), default=world_size)
        if shard == 1 and world_size > 1:
            out["sharding"] = "fsdp-no-shard"  # a replicate-only mesh: every rank holds everything
        elif 1 < shard < world_size and world_size % shard == 0:
            out.update(sharding="fsdp-hybrid", shard_group_size=shard)
        if any(type(g.offload_policy).__name__ == "CPUOffloadPolicy" for _, g in groups):
            out["offload"] = "params"
    except Exception:
        logger.debug("memguard: cannot read fully_shard's settings; assuming full shard", exc_info=True)
    return out


def fsdp1_layout(model: Any, world_size: int) -> dict:
    """``TrainSpec`` keywords of an FSDP1 (``FullyShardedDataParallel``) model: ``sharding`` from the
    root's public ``sharding_strategy`` (``memguard_torch.sharding_settings.fsdp1_sharding``),
    ``fsdp_version`` 1, ``offload="params"`` under ``CPUOffload(offload_params=True)``, and for a
    hybrid strategy ``shard_group_size`` = the size of the root's (intra-node) ``process_group``.
    ``{}`` without FSDP1 modules; ``fsdp-full`` when the strategy cannot be read."""
    mods = fsdp1_modules(model)
    if not mods:
        return {}
    out: dict = {"sharding": "fsdp-full", "fsdp_version": 1}
    try:
        from .sharding_settings import fsdp1_sharding

        root = mods[0]
        out["sharding"] = fsdp1_sharding(root.sharding_strategy)
        if out["sharding"] == "fsdp-hybrid":
            out["shard_group_size"] = int(root.process_group.size())
        if getattr(getattr(root, "cpu_offload", None), "offload_params", False):
            out["offload"] = "params"
    except Exception:
        logger.debug("memguard: cannot read FSDP1's settings; assuming full shard", exc_info=True)
    return out
