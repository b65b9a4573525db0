"""Reading a live torch training run, for the torch adapters (``memguard_hf``,
``memguard_lightning``): the sequence length, the optimizer, activation checkpointing (reading and
turning it on) and the weights' dtype and device.

Also what a live torch module says for a ``TrainSpec`` (:func:`method_and_lora`) and turning
activation checkpointing on (:func:`enable_hf_checkpointing`). torch is imported only when a function
runs, so the adapters import this module cheaply.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Tuple

if TYPE_CHECKING:  # annotations only
    import torch

from memguard_core.estimator.specs import ModelSpec

logger = logging.getLogger("memguard.preflight")

def _torch():
    import torch

    return torch


#: The sequence length the estimate uses when nothing tells it (a warning says so).
FALLBACK_SEQ_LENGTH = 512


def unwrap(model: Any) -> Any:
    """The module inside DDP / DataParallel-style wrappers (``.module`` chains)."""
    while hasattr(model, "module") and isinstance(getattr(model, "module"), _torch().nn.Module):
        model = model.module
    return model


def peft_base(model: Any) -> Any:
    """The model inside PEFT's wrapper (``PeftModel.get_base_model``); ``model`` itself when it has
    no such method or the call fails (not a PEFT model after all)."""
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base):
        try:
            return get_base()
        except Exception:
            return model
    return model


def checkpoint_target(model: Any) -> Optional[Any]:
    """The module that turns activation checkpointing on: a transformers ``PreTrainedModel``
    (``gradient_checkpointing_enable``), found through wrappers and PEFT's ``get_base_model``;
    None when the model has none."""
    target = unwrap(model)
    # through PEFT's wrapper when the model inside has the method: the wrapper forwards
    # gradient_checkpointing_enable to it, but not the flag that says checkpointing is on
    # (``_flag`` reads the class, not __getattr__)
    base = peft_base(target)
    if hasattr(base, "gradient_checkpointing_enable"):
        target = base
    return target if hasattr(target, "gradient_checkpointing_enable") else None


def _flag(module: Any) -> Optional[bool]:
    # transformers 5 renamed the flag: read the new name first
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(module), attr) or attr in getattr(module, "__dict__", {}):
            return bool(getattr(module, attr, False))
    return None


def checkpointing_on(model: Any) -> bool:
    """Whether activation checkpointing is on, as the model (or the ``PreTrainedModel`` inside a PEFT
    wrapper) reports it."""
    for module in (unwrap(model), checkpoint_target(model)):
        if module is not None and _flag(module):
            return True
    return False


def enable_activation_checkpointing(model: Any) -> None:
    """Per-block activation checkpointing of the transformers model inside ``model``, in place
    (:func:`enable_hf_checkpointing`: non-reentrant, ``use_cache`` off).

    Raises:
        ValueError: the model has no ``gradient_checkpointing_enable`` (not a transformers model).
    """
    target = checkpoint_target(model)
    if target is None:
        raise ValueError("the model has no gradient_checkpointing_enable(): activation checkpointing cannot "
                         "be turned on in place")
    enable_hf_checkpointing(target)


def optimizer_name(optimizer: Any) -> str:
    """``TrainSpec.optimizer`` of an optimizer: a name (HF ``args.optim``: ``adamw_torch``, ``sgd``,
    ``adafactor``, ``adamw_bnb_8bit`` ...) or a torch optimizer (Lightning's ``trainer.optimizers[0]``,
    unwrapped from ``LightningOptimizer``). Adam/AdamW -> ``adamw`` (the same states), SGD ->
    ``sgd`` (HF's named ``sgd`` has no momentum) or ``sgd-momentum`` (an SGD object with momentum),
    ``*8bit`` -> ``adamw-8bit``, paged ones (HF ``paged_adamw_8bit`` / ``paged_adamw_32bit``,
    bitsandbytes ``PagedAdamW8bit`` / ``PagedAdamW`` / ``PagedAdamW32bit``) -> ``paged-adamw-8bit`` /
    ``paged-adamw-32bit``; anything else is estimated as ``adamw`` with a warning."""
    opt = getattr(optimizer, "optimizer", optimizer)
    if isinstance(opt, str):
        name, groups = str(getattr(opt, "value", opt)).lower(), ()
    else:
        name, groups = type(opt).__name__.lower(), getattr(opt, "param_groups", ())
    if "paged" in name and "adam" in name:
        return "paged-adamw-8bit" if "8bit" in name else "paged-adamw-32bit"
    if "8bit" in name:
        return "adamw-8bit"
    if "adafactor" in name:
        return "adafactor"
    if name == "sgd":
        return "sgd-momentum" if any(g.get("momentum", 0) for g in groups) else "sgd"
    if "adam" in name:
        return "adamw"
    logger.warning("memguard: optimizer %r is not modelled; estimating it as adamw", name)
    return "adamw"


#: transformers versions (major.minor) :func:`attn_implementation`'s private name was checked on.
ATTN_IMPLEMENTATION_CHECKED = ("5.24", "5.24")


def attn_implementation(model: Any) -> Optional[str]:
    """``config._attn_implementation`` (transformers-private: ``eager`` | ``sdpa`` |
    ``flash_attention_*``; checked on :data:`ATTN_IMPLEMENTATION_CHECKED`) of ``model`` or the
    transformers model inside it; None when absent (the estimate then assumes ``sdpa``). Here and
    not in one adapter's ``_compat``: Lightning modules wrap transformers models too."""
    for module in (checkpoint_target(model), unwrap(model)):
        name = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if name is not None:
            return name
    return None


def _first_parameter(model: Any) -> Any:
    """The first parameter of ``model`` (unwrapped: DDP, FSDP, PEFT), None without one."""
    return next(iter(unwrap(model).parameters()), None)


def weights_dtype_device(model: Any) -> Tuple[torch.dtype, str]:
    """The dtype and device type of the model's first parameter (fp32 / cpu without parameters)."""
    p = _first_parameter(model)
    return (p.dtype, p.device.type) if p is not None else (_torch().float32, "cpu")


def counter_device(device: str, weights_device: str) -> str:
    """The counter the estimate predicts: the ``device`` option, or for ``auto`` where the weights
    are (``cuda``, ``mps``; anything else is read as the CPU's)."""
    if device != "auto":
        return "cuda" if device.startswith("cuda") else device
    return weights_device if weights_device in ("cuda", "mps") else "cpu"


def _cuda_device_of(model: Any) -> Any:
    """The CUDA device ``model``'s first parameter is on (a ``torch.device``); None for none."""
    try:
        p = _first_parameter(model) if model is not None else None
    except Exception:
        return None
    return p.device if p is not None and p.device.type == "cuda" else None


def process_held_kwargs(device: str, kwargs: dict, model: Any = None, optimizers: Iterable[Any] = ()) -> dict:
    """``kwargs`` with what this process holds, read on the CPU counter: ``resident_file_bytes``
    (the mapped libraries' resident pages, part of VmHWM and varying with the page cache) and,
    given the live ``model``, ``runtime_held_bytes`` (:func:`runtime_held_bytes`); on the cuda
    counter, the current GPU's ``cublas_workspace_bytes`` (``memguard_torch.cublas``)."""
    if device == "cuda" and "cublas_workspace_bytes" not in kwargs:
        from .cublas import workspace_bytes

        kwargs = dict(kwargs, cublas_workspace_bytes=workspace_bytes(_cuda_device_of(model)))
    if device == "cpu" and "resident_file_bytes" not in kwargs:
        from memguard_core.stats import process_file_resident_bytes

        kwargs = dict(kwargs, resident_file_bytes=process_file_resident_bytes())
    if device == "cpu" and model is not None and "runtime_held_bytes" not in kwargs:
        kwargs = dict(kwargs, runtime_held_bytes=runtime_held_bytes(model, optimizers))
    return kwargs


def runtime_held_bytes(model: Any, optimizers: Iterable[Any] = ()) -> Optional[int]:
    """What this process holds apart from the training state's CPU tensors (bytes): its RSS less
    the resident bytes of every distinct storage among ``model``'s parameters, buffers and
    gradients and the optimizers' state (a resumed run loads its moments before training starts).
    The preflight counts this in place of the modelled runtime overhead (``TrainSpec
    .runtime_held_bytes``). None off Linux or when a storage cannot be read (logged at debug level,
    never raised): the estimate then keeps the modelled figure."""
    torch = _torch()
    try:
        seen: dict = {}

        def add(t: Any) -> None:
            t = getattr(t, "_local_tensor", t)   # a DTensor's shard (FSDP2)
            if not torch.is_tensor(t) or t.device.type != "cpu":
                return
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()

        inner = unwrap(model)
        for p in inner.parameters():
            add(p)
            if p.grad is not None:
                add(p.grad)
        for b in inner.buffers():
            add(b)
        for opt in optimizers or ():
            for state in getattr(opt, "state", {}).values():
                for v in (state.values() if isinstance(state, Mapping) else ()):
                    add(v)
        from memguard_core.stats import process_bytes_apart_from

        return process_bytes_apart_from(seen.items())
    except Exception:
        logger.debug("no runtime reading for the preflight", exc_info=True)
        return None


def row_length(row: Any) -> int:
    """Tokens of one dataset row: its ``input_ids`` (dict rows), first element (tuple rows) or the
    row itself (a tensor or a list of ids); 0 when unknown."""
    if isinstance(row, Mapping):
        ids = row.get("input_ids")
    elif isinstance(row, (tuple, list)) and row and not isinstance(row[0], (int, float)):
        ids = row[0]
    else:
        ids = row
    if _torch().is_tensor(ids):
        return int(ids.shape[-1]) if ids.dim() > 0 else 0
    return len(ids) if isinstance(ids, (list, tuple)) else 0


def batch_seq_length(batch: Any) -> int:
    """Dimension 1 of a batch's ``input_ids`` (dict batches) or first 2-D integer tensor; 0 if none."""
    if isinstance(batch, Mapping) and _torch().is_tensor(batch.get("input_ids")):
        t = batch["input_ids"]
        return int(t.shape[1]) if t.dim() >= 2 else 0
    leaves = batch if isinstance(batch, (tuple, list)) else [batch]
    for t in leaves:
        if _torch().is_tensor(t) and t.dim() >= 2 and not t.is_floating_point():
            return int(t.shape[1])
    return 0


def longest_row(dataset: Any, length_of: Callable[[Any], int], scan_rows: int = 2048) -> Tuple[Any, int]:
    """``(row, length)``: the first row of the largest ``length_of(row)`` among the first
    ``scan_rows`` rows of a map-style dataset (``__getitem__`` and ``__len__``); ``(None, 0)`` for
    none or for another kind of dataset. A row that raises ends the scan with the longest found so
    far (logged at debug), never an error. torch's CPU, Python's and numpy's random states are put
    back after the scan: a ``__getitem__`` that draws (random crops, masking, augmentations) must
    not shift the run's draws."""
    best, longest = None, 0
    if dataset is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return best, longest
    py_state = random.getstate()
    np_random = sys.modules.get("numpy.random")
    np_state = np_random.get_state() if np_random is not None else None
    try:
        with _torch().random.fork_rng(devices=[]):
            for i in range(min(len(dataset), scan_rows)):
                row = dataset[i]
                n = int(length_of(row))
                if best is None or n > longest:
                    best, longest = row, n
    except Exception:
        logger.debug("memguard: could not scan the dataset for lengths", exc_info=True)
    finally:
        random.setstate(py_state)
        if np_state is not None:
            np_random.set_state(np_state)
    return best, longest


def longest_in_rows(dataset: Any, length_of: Callable[[Any], int], scan_rows: int = 2048) -> int:
    """The largest ``length_of(row)`` among the first ``scan_rows`` rows of a map-style dataset;
    0 for none (:func:`longest_row`, whose scan it is)."""
    return longest_row(dataset, length_of, scan_rows)[1]


def infer_seq_length(given: Optional[int], settings: Iterable[Tuple[Any, Iterable[str]]], dataset: Any = None,
                     batch: Any = None, scan_rows: int = 2048) -> int:
    """Tokens per row for the estimate: ``given``; else the first positive integer setting among
    ``settings`` (``(object or mapping, names)`` pairs, e.g. HF ``args.max_length``, Lightning
    ``hparams.block_size``); else the longest of the first ``scan_rows`` rows of ``dataset``
    (:func:`row_length`) and of ``batch`` (:func:`batch_seq_length`). A dataloader is never
    iterated: an extra iterator would draw from the sampler's generator and change the data order.
    Falls back to :data:`FALLBACK_SEQ_LENGTH` with a warning."""
    if given:
        return int(given)
    for source, names in settings:
        for name in names:
            v = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    longest = longest_in_rows(dataset, row_length, scan_rows)
    if batch is not None:
        longest = max(longest, batch_seq_length(batch))
    if longest:
        return longest
    logger.warning("memguard: sequence length unknown; estimating with %d (pass seq_length=...)",
                   FALLBACK_SEQ_LENGTH)
    return FALLBACK_SEQ_LENGTH


# ------------------------------------------------------------------ DDP with manual gradient reduction


def find_ddp(model: Any) -> Optional[Any]:
    """The ``torch.nn.parallel.DistributedDataParallel`` wrapper at or inside ``model``
    (accelerate's prepared model is the DDP object itself), None when there is none."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:
        return None
    if model is None:
        return None
    if isinstance(model, DistributedDataParallel):
        return model
    for m in model.modules() if hasattr(model, "modules") else ():
        if isinstance(m, DistributedDataParallel):
            return m
    return None


def ddp_after_abort(ddp: Any) -> None:
    """After a forward aborted under DDP's ``no_sync``: DDP decides whether the next forward
    broadcasts the module buffers from its ``require_forward_param_sync``, which it sets only at the
    end of a forward (False after a ``no_sync`` one) and which starts True. A rank whose first forward
    failed would still broadcast at its next forward while the ranks that finished theirs would not:
    a collective only some ranks join. Every rank sets it as a finished ``no_sync`` forward leaves
    it (torch ``nn/parallel/distributed.py``, checked on 2.13). Never raises."""
    try:
        ddp.require_forward_param_sync = False
    except Exception:
        logger.debug("memguard: cannot reset DDP's forward sync flag", exc_info=True)


def average_ddp_gradients(ddp: Any, flag_group: Optional[Any] = None) -> None:
    """Average the gradients over the DDP ranks as DDP's reducer does in a synchronised backward
    (each gradient divided by the world size, then summed over the ranks), on DDP's process group.
    For a guard that ran every micro-batch under ``no_sync``: called once every rank's last
    micro-batch has succeeded, so no rank waits in a collective for one that is redoing its window.
    In place, one all-reduce per parameter, all in flight together: nothing is allocated, so no rank
    can run out of memory between agreeing and reducing. A parameter without a gradient on some
    rank (unused there) gets zeros first, so every rank reduces the same tensors. Which ones is
    agreed on ``flag_group``; when None, on memguard's gloo flag group
    (:func:`memguard_torch.distributed.flag_group`, created collectively at its first call, which
    every rank makes here at the same point): the mask is a CPU tensor, which an NCCL group refuses.

    Raises:
        what ``torch.distributed`` raises (a broken process group).
    """
    torch = _torch()
    import torch.distributed as dist

    group = getattr(ddp, "process_group", None)
    world = dist.get_world_size(group)
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    if flag_group is None:
        from .distributed import flag_group as gloo_flag_group
        flag_group = gloo_flag_group()
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=flag_group if flag_group is not None else group)
    works = []
    for p, h in zip(params, has.tolist()):
        if not h:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(world)
        works.append(dist.all_reduce(p.grad, group=group, async_op=True))
    for w in works:
        w.wait()


def method_and_lora(model: Any, model_spec: ModelSpec) -> tuple:
    """``(method, lora_kwargs)`` of a live torch module for a ``TrainSpec``: ``qlora`` when the block
    weights are 4-bit, ``lora`` when PEFT adapters are on it (a ``peft_config`` or ``lora_A``
    parameters), else ``full``; ``lora_kwargs`` holds ``lora_rank`` (found on the model, else 8),
    ``lora_targets`` (PEFT's ``target_modules``, else the names of the adapted modules) and, from a
    PEFT config, ``lora_dropout``.

    Reads ``model.named_parameters()`` only: no framework import.
    """
    names = [n for n, _ in model.named_parameters()]
    peft = hasattr(model, "peft_config") or any("lora_A" in n for n in names)
    method = "qlora" if model_spec.weight_bits < 8 else "lora" if peft else "full"
    if method == "full":
        return method, {}
    kwargs: dict = {"lora_rank": model_spec.lora_rank_found or 8}
    targets = None
    cfg = getattr(model, "peft_config", None)
    if isinstance(cfg, dict) and cfg:
        p = getattr(next(iter(cfg.values())), "lora_dropout", None)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0:
            kwargs["lora_dropout"] = float(p)
        t = getattr(next(iter(cfg.values())), "target_modules", None)
        if isinstance(t, str):
            targets = ("all-linear",) if t == "all-linear" else (t,)
        elif t:
            targets = tuple(sorted(t))
    if targets is None:
        targets = tuple(sorted({n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in names if ".lora_A" in n})) or None
    if targets:
        kwargs["lora_targets"] = targets
    return method, kwargs


def enable_hf_checkpointing(target: Any) -> None:
    """Per-block activation checkpointing of a transformers ``PreTrainedModel``, in place:
    non-reentrant (``use_reentrant=False``, so PEFT models need no ``enable_input_require_grads``),
    through ``activation_checkpointing_enable`` (transformers >= 5) or
    ``gradient_checkpointing_enable``; ``config.use_cache`` is turned off, as transformers requires
    with checkpointing. Imports nothing (the model's own methods do the work).

    Raises:
        AttributeError: ``target`` has neither method.
    """
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = getattr(target, "config", None)
    if cfg is not None and hasattr(cfg, "use_cache"):
        cfg.use_cache = False
