"""What the HF adapter's preflight reads from a ``Trainer``: ``read_specs`` maps its model and
``TrainingArguments`` to a ``ModelSpec`` / ``TrainSpec``; ``memguard_core.guard.Guard`` estimates,
plans and applies (see docs/lifecycle.md).

The mapping:

* micro-batch = ``per_device_train_batch_size``; accumulation = ``gradient_accumulation_steps``;
  ``world_size`` = ``args.world_size``;
* sequence length = given, else ``args.max_length`` / ``max_seq_length`` (TRL ``SFTConfig``), else
  the longest ``input_ids`` among the first 2048 training rows;
* method = ``qlora`` for 4-bit weights, ``lora`` for a PEFT model, else ``full``;
* optimizer from ``args.optim`` (``memguard_core.torch_train.optimizer_name``; ``paged_adamw_8bit`` /
  ``paged_adamw_32bit`` -> the paged optimizers, whose large states the CUDA counters leave out);
* ``bnb_version`` = the installed bitsandbytes for 4-bit weights (whether its 4-bit matmul keeps
  its input: ``memguard_core.estimate.bnb_4bit_keeps_input``);
* dtype / mixed precision from the weights' dtype and ``args.bf16`` / ``args.fp16``;
* attention implementation from the model's config (``_compat.attn_implementation``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from memguard_core import torch_train as tt
from memguard_core.preflight import attn_impl_from, method_and_lora
from memguard_core.spec import ModelSpec, TrainSpec, model_spec_from_module
from memguard_core.versions import installed_version

from . import _compat

#: ``TrainingArguments`` / TRL ``SFTConfig`` fields that give the sequence length.
SEQ_LENGTH_ARGS = ("max_length", "max_seq_length")


def trainspec_from_trainer(trainer: Any, model_spec: ModelSpec, *, seq_length: Optional[int] = None,
                           device: str = "auto") -> TrainSpec:
    """The ``TrainSpec`` of a ``Trainer`` run (see the module docstring for the mapping).

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
    seq = tt.infer_seq_length(seq_length, [(args, SEQ_LENGTH_ARGS)], getattr(trainer, "train_dataset", None))
    return TrainSpec(batch_size=args.per_device_train_batch_size, seq_length=seq,
                     grad_accum=args.gradient_accumulation_steps, method=method,
                     optimizer=tt.optimizer_name(args.optim), dtype=dtype, mixed_precision=mixed,
                     grad_checkpoint=gc_on, attn_impl=attn_impl_from(_compat.attn_implementation(model)),
                     framework="hf", device=device, world_size=max(1, int(getattr(args, "world_size", 1))),
                     bnb_version=installed_version("bitsandbytes") if method == "qlora" else None,
                     **tt.file_pages_kwargs(device, kwargs))


def read_specs(trainer: Any, *, seq_length: Optional[int] = None, device: str = "auto") -> Tuple[ModelSpec, TrainSpec]:
    """``(ModelSpec, TrainSpec)`` of ``trainer``'s model (PEFT and 4-bit aware) and run.

    Raises:
        ConfigError: the model's shapes or a setting cannot be read.
    """
    ms = model_spec_from_module(tt.unwrap(trainer.model))
    return ms, trainspec_from_trainer(trainer, ms, seq_length=seq_length, device=device)
