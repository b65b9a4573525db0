"""The ``TrainSpec`` of a plain PyTorch / accelerate loop (:func:`train_spec`), read from the live
model, optimizer and first batch:

* model: the module given (through DDP / accelerate wrappers, ``memguard_torch.train_reading.unwrap``),
  its shapes from its HF ``config`` or its ``nn.Embedding`` and block ``ModuleList``
  (``memguard_torch.module_spec.model_spec_from_module``); under FSDP2 the parameters are ``DTensor``s whose
  shapes are the full (unsharded) ones;
* micro-batch = rows (packed: sequences) of the first batch; accumulation = ``grad_accum`` given,
  else the accelerator's ``gradient_accumulation_steps``, else 1; ``world_size`` =
  ``torch.distributed``'s; the layout (:func:`layout_of`) from the live model -- a
  ``DistributedDataParallel`` wrapper (``ddp``, its bucket size and ``gradient_as_bucket_view``) or
  ``fully_shard``-ed modules (``fsdp-full`` / ``fsdp-grad-op`` / ``fsdp-hybrid`` /
  ``fsdp-no-shard``, CPU offload) -- else from the accelerator's plugins (DeepSpeed ZeRO, FSDP1:
  ``memguard_torch.sharding_settings.accelerate_settings``), else ``none``;
* sequence length = ``seq_length`` given, else the first batch's dimension 1 (the loop's data
  loader is never iterated);
* optimizer from the optimizer object (``memguard_torch.train_reading.optimizer_name``);
* precision: the weights' dtype; ``mixed_precision`` from the accelerator (``fp16`` / ``bf16``
  autocast over fp32 weights);
* activation checkpointing and the attention implementation from the HF model when there is one.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from memguard_core.estimator.specs import ModelSpec, TrainSpec
from memguard_core.preflight import attn_impl_from

from . import _compat
from . import train_reading as tt
from .batch import batch_units
from .sharding_settings import accelerate_settings
from .train_reading import method_and_lora


def world_size() -> int:
    """``torch.distributed``'s world size (1 outside an initialised process group)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def layout_of(model: Any, accelerator: Any = None, world: Optional[int] = None) -> Dict[str, Any]:
    """``TrainSpec`` layout keywords (``sharding``, ``offload``, ``shard_group_size``,
    ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``fsdp_version``, ``zero_buckets``) of a live
    model run by ``world`` processes (default: ``torch.distributed``'s): what its wrappers were
    given (``_compat.ddp_layout`` / ``_compat.fsdp2_layout`` / ``_compat.fsdp1_layout``), else what
    ``accelerator``'s state says (``memguard_torch.sharding_settings.accelerate_settings``: DeepSpeed), else
    ``{"sharding": "none"}``; for one process, DeepSpeed's layout only (its fp32 partitions and
    buckets exist with one rank too), else ``none``.

    Raises:
        ConfigError: the accelerator holds a DeepSpeed / FSDP setting that cannot be read.
    """
    world = world_size() if world is None else world
    if world <= 1:
        return accelerate_settings(accelerator, world) or {"sharding": "none"}
    out = _compat.fsdp2_layout(model, world) or _compat.fsdp1_layout(model, world)
    if not out:
        ddp = _compat.find_ddp(model)
        out = _compat.ddp_layout(ddp) if ddp is not None else {}
    if not out:
        out = accelerate_settings(accelerator, world)
    return out or {"sharding": "none"}


def train_spec(model: Any, optimizer: Any, batch: Any, model_spec: ModelSpec, *,
               seq_length: Optional[int] = None, grad_accum: Optional[int] = None, accelerator: Any = None,
               device: str = "auto") -> TrainSpec:
    """The ``TrainSpec`` of a plain loop (see the module doc for the mapping).

    Raises:
        ConfigError: a setting the ``TrainSpec`` rejects (naming its field).
    """
    inner = tt.unwrap(model)
    weight_dtype, weights_device = tt.weights_dtype_device(inner)
    method, kwargs = method_and_lora(inner, model_spec)
    mixed = str(getattr(accelerator, "mixed_precision", "no") or "no")
    import torch

    if mixed in ("fp16", "bf16") and weight_dtype == torch.float32:
        dtype, mixed_precision = mixed, True
    else:
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(weight_dtype, "fp32")
        mixed_precision = False
    accum = grad_accum or int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
    target = tt.checkpoint_target(inner)
    device = tt.counter_device(device, weights_device)
    world = world_size()
    layout = layout_of(model, accelerator, world)
    seq = tt.infer_seq_length(seq_length, [], None, batch)
    return TrainSpec(batch_size=max(1, batch_units(batch)), seq_length=seq, grad_accum=max(1, int(accum)),
                     method=method, optimizer=tt.optimizer_name(optimizer) if optimizer is not None else "adamw",
                     dtype=dtype, mixed_precision=mixed_precision,
                     grad_checkpoint=target is not None and tt.checkpointing_on(target),
                     attn_impl=attn_impl_from(tt.attn_implementation(inner)), framework="torch",
                     device=device, world_size=world, **layout,
                     **tt.process_held_kwargs(device, kwargs, inner, [optimizer]))
