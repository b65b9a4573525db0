"""Preflight for a Hugging Face ``Trainer``: read the model and the ``TrainingArguments``, estimate,
plan, and apply in place what can be applied.

``trainspec_from_trainer`` maps HF settings to a ``TrainSpec``:

* micro-batch = ``per_device_train_batch_size``; accumulation = ``gradient_accumulation_steps``;
  ranks = ``world_size``;
* sequence length = given, else ``args.max_length`` / ``max_seq_length`` (TRL ``SFTConfig``), else
  the longest ``input_ids`` among the first 2048 training rows;
* method = ``qlora`` for 4-bit weights, ``lora`` for a PEFT model, else ``full``;
* optimizer from ``args.optim`` (``adamw_*`` -> adamw, ``sgd`` -> sgd (HF's SGD has no momentum),
  ``adafactor``, ``*adamw_8bit`` / ``adamw_bnb_8bit`` -> adamw-8bit);
* dtype / mixed precision from the weights' dtype and ``args.bf16`` / ``args.fp16``;
* attention implementation from ``model.config._attn_implementation``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from memguard_core.preflight import (Preflight, attn_impl_from, default_budget, enable_hf_checkpointing,
                                     method_and_lora, plan_in_place,
                                     resident_bytes_for)
from memguard_core.spec import ModelSpec, TrainSpec, model_spec_from_module

logger = logging.getLogger("memguard.hf")


def _optimizer_name(optim: Any) -> str:
    name = str(getattr(optim, "value", optim)).lower()
    if "8bit" in name:
        return "adamw-8bit"
    if "adafactor" in name:
        return "adafactor"
    if name == "sgd":
        return "sgd"
    if "adam" in name:
        return "adamw"
    logger.warning("memguard: optimizer %r is not modelled; estimating it as adamw", name)
    return "adamw"


def _unwrap(model):
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def infer_seq_length(trainer, given: Optional[int] = None, scan_rows: int = 2048) -> int:
    """Tokens per row for the estimate: ``given``, else the args' max length, else the longest of
    the first ``scan_rows`` training rows (``input_ids``). Falls back to 512 with a warning."""
    if given:
        return int(given)
    args = trainer.args
    for attr in ("max_length", "max_seq_length"):
        v = getattr(args, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    ds = getattr(trainer, "train_dataset", None)
    longest = 0
    try:
        n = min(len(ds), scan_rows)
        for i in range(n):
            row = ds[i]
            ids = row.get("input_ids") if isinstance(row, dict) else None
            if ids is not None:
                longest = max(longest, len(ids))
    except Exception:
        logger.debug("memguard: could not scan the dataset for lengths", exc_info=True)
    if longest:
        return longest
    logger.warning("memguard: sequence length unknown; estimating with 512 (pass seq_length=...)")
    return 512


def _checkpointing_on(model) -> bool:
    """Whether activation checkpointing is on (transformers 5 renamed the flag; read the new one first)."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), attr) or attr in getattr(model, "__dict__", {}):
            return bool(getattr(model, attr, False))
    return False


def trainspec_from_trainer(trainer, model_spec: ModelSpec, *, seq_length: Optional[int] = None,
                           device: str = "auto") -> TrainSpec:
    """Build the ``TrainSpec`` of a ``Trainer`` run (see the module docstring for the mapping)."""
    args = trainer.args
    model = _unwrap(trainer.model)
    p = next((p for p in model.parameters()), None)
    weight_dtype = p.dtype if p is not None else torch.float32
    method, kwargs = method_and_lora(model, model_spec)
    half = args.bf16 or args.fp16
    if weight_dtype == torch.float32:
        dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        mixed = bool(half)
    else:
        dtype = "fp16" if weight_dtype == torch.float16 else "bf16"
        mixed = False
    attn_impl = attn_impl_from(getattr(getattr(model, "config", None), "_attn_implementation", None))
    gc_on = bool(getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)
                 or _checkpointing_on(model))
    if device == "auto":
        dev = p.device.type if p is not None else "cpu"
        device = "cuda" if dev == "cuda" else "cpu"
    if device == "cpu" and "resident_file_bytes" not in kwargs:
        # the mapped libraries' resident pages are part of VmHWM and vary with the page cache
        from memguard_core.stats import process_file_resident_bytes
        kwargs["resident_file_bytes"] = process_file_resident_bytes()
    return TrainSpec(batch_size=args.per_device_train_batch_size, seq_length=infer_seq_length(trainer, seq_length),
                     grad_accum=args.gradient_accumulation_steps, method=method, optimizer=_optimizer_name(args.optim),
                     dtype=dtype, mixed_precision=mixed, grad_checkpoint=gc_on, attn_impl=attn_impl,
                     framework="hf", device=device, ranks=max(1, int(getattr(args, "world_size", 1))), **kwargs)


def enable_activation_checkpointing(model) -> None:
    """Turn on per-block activation checkpointing in place (non-reentrant, so PEFT models need no
    ``enable_input_require_grads``); ``use_cache`` is turned off as HF requires."""
    m = _unwrap(model)
    target = m
    if not hasattr(target, "gradient_checkpointing_enable") and hasattr(m, "get_base_model"):
        target = m.get_base_model()
    enable_hf_checkpointing(target)


def run_preflight(trainer, *, budget_bytes: Optional[int], safety_ratio: float = 0.8,
                  seq_length: Optional[int] = None, apply: Sequence[str] = ("grad_checkpoint", "micro_batch"),
                  device: str = "auto", plan_fraction: float = 0.85) -> Preflight:
    """Estimate the run of ``trainer``, plan (``memguard_core.preflight.plan_in_place``: against
    ``plan_fraction x budget``, with what this process already holds counted) and apply what can be
    applied in place (activation checkpointing; the split factor is returned for the callback).

    Raises:
        DoesNotFitError: nothing in the allowed search fits.
    """
    model = _unwrap(trainer.model)
    ms = model_spec_from_module(model)
    ts = trainspec_from_trainer(trainer, ms, seq_length=seq_length, device=device)
    probe_device = ts.device if device == "auto" else device
    if budget_bytes is None:
        budget_bytes = default_budget(probe_device, safety_ratio)
    resident = resident_bytes_for(ts)  # RSS with the model loaded (CPU counter only)
    pf = plan_in_place(ms, ts, budget_bytes, apply=apply, plan_fraction=plan_fraction, resident_bytes=resident)
    if pf.checkpointing_planned:
        enable_activation_checkpointing(trainer.model)
    return pf
