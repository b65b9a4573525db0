"""The ``TrainSpec`` of a HF ``Trainer`` run (:func:`train_spec`), read from its model and
``TrainingArguments``. The mapping:

* micro-batch = ``per_device_train_batch_size``; accumulation = ``gradient_accumulation_steps``;
  ``world_size`` = ``args.world_size``;
* the data-parallel layout (:func:`layout_of_trainer`) from the ``Trainer``'s accelerator, which
  ``TrainingArguments`` configured (``deepspeed`` -> ZeRO stage, offload and bucket sizes; ``fsdp`` /
  ``fsdp_config`` -> FSDP version, ``reshard_after_forward`` or FSDP1 strategy, ``cpu_offload``;
  otherwise, with more than one process, DDP with ``ddp_bucket_cap_mb``): the settings as given,
  which hold for every wrapper the ``Trainer`` may build (DDP, FSDP1 / FSDP2, a DeepSpeed engine);
* sequence length = given, else ``args.max_length`` / ``max_seq_length`` (TRL ``SFTConfig``), else
  the longest ``input_ids`` among the first 2048 training rows; an image classifier's (ViT, DeiT)
  = its patch tokens (``ModelSpec.patch_tokens``, the image side read from ``pixel_values``);
* an encoder-decoder's target length (``TrainSpec.target_length``; its source is the sequence
  length above) = given, else the longest ``decoder_input_ids`` / ``labels`` among those rows
  (``rows.longest_target``), else ``args.generation_max_length`` (``Seq2SeqTrainingArguments``);
  none of them: the source length;
* method = ``qlora`` for 4-bit weights, ``lora`` for a PEFT model, else ``full``;
* optimizer from ``args.optim`` (``memguard_torch.train_reading.optimizer_name``; ``paged_adamw_8bit`` /
  ``paged_adamw_32bit`` -> the paged optimizers, whose large states the CUDA counters leave out);
* ``bnb_version`` = the installed bitsandbytes for 4-bit weights (whether its 4-bit matmul keeps
  its input: ``memguard_core.estimator.bnb.bnb_4bit_keeps_input``);
* dtype / mixed precision from the weights' dtype and ``args.bf16`` / ``args.fp16``;
* attention implementation from the model's config (``_compat.attn_implementation``).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch

from memguard_core.deepspeed_config import zero_settings
from memguard_core.estimator.specs import ModelSpec, TrainSpec
from memguard_core.preflight import attn_impl_from
from memguard_core.versions import installed_version
from memguard_torch import train_reading as tt
from memguard_torch.sharding_settings import accelerate_settings, ddp_handler_settings, fsdp_plugin_settings
from memguard_torch.train_reading import method_and_lora

from . import _compat
from .rows import longest_target

#: ``TrainingArguments`` / TRL ``SFTConfig`` fields that give the sequence length.
SEQ_LENGTH_ARGS = ("max_length", "max_seq_length")


def layout_of_trainer(trainer: Any, world: int) -> Dict[str, Any]:
    """``TrainSpec`` layout keywords of a ``Trainer`` run by ``world`` processes: from
    ``trainer.accelerator`` (``memguard_torch.sharding_settings.accelerate_settings``), else, for a
    trainer without one, from ``TrainingArguments`` (``hf_deepspeed_config`` / ``deepspeed``,
    ``fsdp_plugin_args``, ``ddp_bucket_cap_mb``); ``{"sharding": "none"}`` for one process without
    DeepSpeed (which counts at any world size).

    Raises:
        ConfigError: a DeepSpeed or FSDP setting that cannot be read (naming it).
    """
    acc = getattr(trainer, "accelerator", None)
    if acc is not None:
        return accelerate_settings(acc, world) or {"sharding": "none"}
    args = trainer.args
    ds = getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or getattr(args, "deepspeed", None)
    if ds:
        return zero_settings(ds)
    if world <= 1:
        return {"sharding": "none"}
    fsdp = getattr(args, "fsdp_plugin_args", None)
    if getattr(args, "fsdp", None) and isinstance(fsdp, dict):
        # as the plugin the Trainer builds from them decides (it cannot be built here without a
        # GPU-like device): accelerate 1.15 FullyShardedDataParallelPlugin.__post_init__ fills an FSDP1
        # sharding_strategy from FSDP_SHARDING_STRATEGY (default FULL_SHARD), and
        # Accelerator.prepare_model prefers it to the reshard_after_forward HF passes
        fields = dict(fsdp)
        if str(fields.get("fsdp_version", 1)) == "1" and fields.get("sharding_strategy") is None:
            fields["sharding_strategy"] = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD")
        return fsdp_plugin_settings(SimpleNamespace(**fields), world)
    return ddp_handler_settings(SimpleNamespace(bucket_cap_mb=getattr(args, "ddp_bucket_cap_mb", None)))


def target_length(trainer: Any, model_spec: ModelSpec, given: Optional[int] = None) -> Optional[int]:
    """An encoder-decoder run's target tokens per row (see the module doc); ``None`` for any other
    model, or when nothing says it (the estimate then takes the source length)."""
    if not model_spec.is_encoder_decoder:
        return None
    if given:
        return int(given)
    found = longest_target(getattr(trainer, "train_dataset", None))
    if found:
        return found
    g = getattr(trainer.args, "generation_max_length", None)
    return int(g) if isinstance(g, int) and not isinstance(g, bool) and g > 0 else None


def train_spec(trainer: Any, model_spec: ModelSpec, *, seq_length: Optional[int] = None,
               device: str = "auto", target: Optional[int] = None) -> TrainSpec:
    """The ``TrainSpec`` of a ``Trainer`` run (see the module doc for the mapping); ``target``: an
    encoder-decoder's target tokens per row when the caller knows them (a batch's labels).

    Raises:
        ConfigError: a setting the ``TrainSpec`` rejects (naming its field).
    """
    args = trainer.args
    model = tt.unwrap(trainer.model)
    weight_dtype, weights_device = tt.weights_dtype_device(model)
    method, kwargs = method_and_lora(model, model_spec)
    if weight_dtype == torch.float32:
        dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        mixed = bool(args.bf16 or args.fp16)
    else:
        dtype = "fp16" if weight_dtype == torch.float16 else "bf16"
        mixed = False
    gc_on = bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)
                 or tt.checkpointing_on(model))
    device = tt.counter_device(device, weights_device)
    # an image classifier's rows are its patch tokens (live_model_spec read the image side)
    seq = model_spec.patch_tokens or tt.infer_seq_length(seq_length, [(args, SEQ_LENGTH_ARGS)],
                                                          getattr(trainer, "train_dataset", None))
    world = max(1, int(getattr(args, "world_size", 1)))
    return TrainSpec(batch_size=args.per_device_train_batch_size, seq_length=seq,
                     target_length=target_length(trainer, model_spec, target),
                     grad_accum=args.gradient_accumulation_steps, method=method,
                     optimizer=tt.optimizer_name(args.optim), dtype=dtype, mixed_precision=mixed,
                     grad_checkpoint=gc_on, attn_impl=attn_impl_from(_compat.attn_implementation(model)),
                     framework="hf", device=device, world_size=world, **layout_of_trainer(trainer, world),
                     bnb_version=installed_version("bitsandbytes") if method == "qlora" else None,
                     **tt.process_held_kwargs(device, kwargs, model, [getattr(trainer, "optimizer", None)]))
