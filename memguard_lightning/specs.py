"""The train-spec reader of the Lightning adapter: :func:`train_spec` maps the trainer, the
``LightningModule`` and the first batch to a ``TrainSpec`` (the preflight's input,
``memguard_lightning.preflight.read_specs``), with :func:`find_model` (the HF / PEFT model
inside the module), :func:`layout_of_strategy` (the data-parallel layout of ``trainer.strategy``)
and :func:`precision_settings` (Lightning's ``precision=`` strings). The dataloader is never
iterated. What each field is read from: docs/lightning.md, "What the preflight reads".
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch

from memguard_torch import train_reading as tt
from memguard_core.preflight import attn_impl_from
from memguard_torch.train_reading import method_and_lora
from memguard_core.deepspeed_config import zero_settings
from memguard_torch.sharding_settings import fsdp_plugin_settings
from memguard_core.estimator.specs import ModelSpec, TrainSpec

from .batch import batch_units

#: ``hparams`` names that give the sequence length.
SEQ_LENGTH_HPARAMS = ("max_length", "max_seq_length", "seq_length", "seq_len", "block_size")


def find_model(pl_module: torch.nn.Module) -> torch.nn.Module:
    """The model inside a ``LightningModule`` that the estimate describes (see module docstring)."""
    best, best_n = None, -1
    for m in pl_module.modules():
        if m is pl_module:
            continue
        if getattr(m, "config", None) is not None or callable(getattr(m, "get_base_model", None)):
            n = sum(p.numel() for p in m.parameters())
            if n > best_n:
                best, best_n = m, n
    return best if best is not None else pl_module


def precision_settings(precision: Any, weight_dtype) -> tuple:
    """``(dtype, mixed_precision)`` of a Lightning ``precision`` string and the weights' dtype."""
    p = str(precision)
    if "mixed" in p:
        return ("bf16" if "bf16" in p else "fp16"), weight_dtype == torch.float32
    if weight_dtype == torch.bfloat16 or p.startswith("bf16"):
        return "bf16", False
    if weight_dtype == torch.float16 or p.startswith("16"):
        return "fp16", False
    return "fp32", False


def layout_of_strategy(trainer, pl_module, world: int) -> Dict[str, Any]:
    """``TrainSpec`` layout keywords of a Lightning run on ``world`` processes, from its strategy:
    ``DeepSpeedStrategy.config`` (``memguard_core.deepspeed_config.zero_settings``);
    ``FSDPStrategy`` (FSDP1): ``sharding_strategy`` (``HYBRID_SHARD``: the sharding size of its
    ``device_mesh``, else the ``num_processes`` of one node), ``cpu_offload``; otherwise the model as the strategy wrapped it
    (``memguard_torch.specs.layout_of``: ``DistributedDataParallel``'s bucket settings,
    ``fully_shard``-ed modules). For one process, DeepSpeed's layout only, else ``none``.

    Raises:
        ConfigError: a DeepSpeed config or FSDP strategy that cannot be read (naming it).
    """
    strategy = getattr(trainer, "strategy", None)
    name = type(strategy).__name__
    if "DeepSpeed" in name and getattr(strategy, "config", None) is not None:
        return zero_settings(strategy.config)
    if world <= 1:
        return {"sharding": "none"}
    if name.startswith("FSDP") and getattr(strategy, "sharding_strategy", None) is not None:
        out = fsdp_plugin_settings(SimpleNamespace(fsdp_version=1, sharding_strategy=strategy.sharding_strategy,
                                                   cpu_offload=getattr(strategy, "cpu_offload", None)), world)
        if out["sharding"] == "fsdp-hybrid":
            group = _hybrid_shard_size(strategy)
            if isinstance(group, int) and 1 <= group <= world and world % group == 0:
                out["shard_group_size"] = group
        return out
    from memguard_torch.specs import layout_of

    return layout_of(getattr(strategy, "model", None) or pl_module, None, world)


def _hybrid_shard_size(strategy) -> Any:
    """Ranks per shard group of ``FSDPStrategy(sharding_strategy="HYBRID_SHARD")``: the sharding size
    of its ``device_mesh`` (the tuple ``(replication, sharding)`` or a ``DeviceMesh``'s last
    dimension), else the devices of one node (FSDP1 shards within a node by default)."""
    mesh = (getattr(strategy, "kwargs", None) or {}).get("device_mesh")
    try:
        if isinstance(mesh, tuple) and mesh:
            return int(mesh[-1])
        if mesh is not None:
            return int(mesh.shape[-1])
    except Exception:
        pass
    return getattr(strategy, "num_processes", None)


def train_spec(trainer, pl_module, batch: Any, model_spec: ModelSpec, *,
               seq_length: Optional[int] = None, device: str = "auto") -> TrainSpec:
    """The ``TrainSpec`` of a Lightning run from the trainer, the module and its first batch.

    Raises:
        ConfigError: a setting the ``TrainSpec`` rejects (naming its field).
    """
    model = find_model(pl_module)
    weight_dtype, weights_device = tt.weights_dtype_device(model)
    method, kwargs = method_and_lora(model, model_spec)
    dtype, mixed = precision_settings(getattr(trainer, "precision", "32-true"), weight_dtype)
    target = tt.checkpoint_target(model)
    attn_impl = attn_impl_from(tt.attn_implementation(model))
    device = tt.counter_device(device, weights_device)
    rows = batch_units(batch)
    dl_bs = getattr(getattr(trainer, "train_dataloader", None), "batch_size", None)
    if isinstance(dl_bs, int) and dl_bs > rows:
        rows = dl_bs
    opts = getattr(trainer, "optimizers", None) or []
    world = max(1, int(trainer.world_size))
    dataset = getattr(getattr(trainer, "train_dataloader", None), "dataset", None)
    seq = tt.infer_seq_length(seq_length, [(getattr(pl_module, "hparams", None) or {}, SEQ_LENGTH_HPARAMS)],
                              dataset, batch)
    return TrainSpec(batch_size=max(1, rows), seq_length=seq, grad_accum=max(1, int(trainer.accumulate_grad_batches)),
                     method=method, optimizer=tt.optimizer_name(opts[0]) if opts else "adamw", dtype=dtype,
                     mixed_precision=mixed, grad_checkpoint=target is not None and tt.checkpointing_on(target),
                     attn_impl=attn_impl, framework="lightning", device=device,
                     world_size=world, **layout_of_strategy(trainer, pl_module, world),
                     **tt.process_held_kwargs(device, kwargs, pl_module, opts))
