"""Preflight for a Lightning ``Trainer``: read the ``LightningModule`` and the trainer, estimate,
plan (``memguard_core.preflight.plan_in_place``) and apply in place what can be applied.

``trainspec_from_lightning`` maps Lightning settings to a ``TrainSpec``:

* model: the largest submodule of the ``LightningModule`` that carries a HF-style ``config`` or is
  a PEFT model (``get_base_model``) -- typically ``self.model`` -- else the module itself (its
  shapes are then read from its ``nn.Embedding`` and block ``ModuleList``);
* micro-batch = rows of the first batch that reaches ``training_step`` (or the dataloader's
  ``batch_size`` when larger: the first batch is full unless the epoch has a single short batch);
  accumulation = ``trainer.accumulate_grad_batches``; ranks = ``trainer.world_size``;
* sequence length = given, else ``hparams.max_length`` / ``max_seq_length`` / ``seq_length`` /
  ``block_size``, else the longest ``input_ids`` (dict rows) or first element (tuple rows) of the
  first 2048 rows of the training dataset, else the first batch's dimension 1. The dataloader is
  never iterated for this: an extra iterator would draw from the sampler's random generator and
  change the data order of the run;
* method = ``qlora`` for 4-bit weights, ``lora`` for a PEFT model, else ``full``;
* optimizer from ``trainer.optimizers[0]``: ``Adam``/``AdamW`` -> adamw (``adam`` without decoupled
  weight decay holds the same states), ``SGD`` -> ``sgd`` / ``sgd-momentum`` (momentum buffer),
  ``Adafactor``, bitsandbytes ``*8bit`` -> adamw-8bit;
* precision from ``trainer.precision`` (Lightning's ``precision=`` strings): ``32-true`` -> fp32;
  ``16-mixed`` / ``bf16-mixed`` -> fp16 / bf16 autocast over fp32 weights (``mixed_precision``);
  ``16-true`` / ``bf16-true`` -> weights stored in half;
* activation checkpointing: on when the HF model says ``is_gradient_checkpointing``; attention
  implementation from ``config._attn_implementation``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import torch

from memguard_core.preflight import (Preflight, attn_impl_from, default_budget, enable_hf_checkpointing,
                                     method_and_lora, plan_in_place,
                                     resident_bytes_for)
from memguard_core.spec import ModelSpec, TrainSpec, model_spec_from_module

from .batch import batch_units

logger = logging.getLogger("memguard.lightning")

_HPARAM_SEQ = ("max_length", "max_seq_length", "seq_length", "seq_len", "block_size")


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


def _hf_model(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The module that has ``gradient_checkpointing_enable`` (HF ``PreTrainedModel``), if any."""
    target = model
    if not hasattr(target, "gradient_checkpointing_enable") and callable(getattr(model, "get_base_model", None)):
        target = model.get_base_model()
    return target if hasattr(target, "gradient_checkpointing_enable") else None


def can_checkpoint(pl_module: torch.nn.Module) -> bool:
    """Activation checkpointing can be turned on in place (the model is a HF ``PreTrainedModel``)."""
    return _hf_model(find_model(pl_module)) is not None


def enable_activation_checkpointing(pl_module: torch.nn.Module) -> None:
    """Per-block activation checkpointing of the inner HF model, non-reentrant (so PEFT models need
    no ``enable_input_require_grads``); ``use_cache`` is turned off as HF requires.

    Raises:
        ValueError: the model has no ``gradient_checkpointing_enable``.
    """
    target = _hf_model(find_model(pl_module))
    if target is None:
        raise ValueError("the model has no gradient_checkpointing_enable()")
    enable_hf_checkpointing(target)


def optimizer_name(optimizer: Any) -> str:
    """``TrainSpec.optimizer`` of a torch optimizer (see the module docstring)."""
    opt = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the real one
    name = type(opt).__name__.lower()
    if "8bit" in name:
        return "adamw-8bit"
    if "adafactor" in name:
        return "adafactor"
    if name == "sgd":
        groups = getattr(opt, "param_groups", [{}])
        return "sgd-momentum" if any(g.get("momentum", 0) for g in groups) else "sgd"
    if "adam" in name:
        return "adamw"
    logger.warning("memguard: optimizer %s is not modelled; estimating it as adamw", type(opt).__name__)
    return "adamw"


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


def _rows_len(row: Any) -> int:
    if isinstance(row, Mapping):
        ids = row.get("input_ids")
    elif isinstance(row, (tuple, list)) and row and not isinstance(row[0], (int, float)):
        ids = row[0]
    else:
        ids = row
    if torch.is_tensor(ids):
        return int(ids.shape[-1]) if ids.dim() > 0 else 0
    return len(ids) if isinstance(ids, (list, tuple)) else 0


def _batch_seq(batch: Any) -> int:
    if isinstance(batch, Mapping) and torch.is_tensor(batch.get("input_ids")):
        t = batch["input_ids"]
        return int(t.shape[1]) if t.dim() >= 2 else 0
    leaves = batch if isinstance(batch, (tuple, list)) else [batch]
    for t in leaves:
        if torch.is_tensor(t) and t.dim() >= 2 and not t.is_floating_point():
            return int(t.shape[1])
    return 0


def infer_seq_length(trainer, pl_module, batch: Any, given: Optional[int] = None, scan_rows: int = 2048) -> int:
    """Tokens per row for the estimate (see the module docstring); 512 with a warning if unknown."""
    if given:
        return int(given)
    hp = getattr(pl_module, "hparams", None) or {}
    for name in _HPARAM_SEQ:
        v = hp.get(name) if isinstance(hp, Mapping) else getattr(hp, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    longest = 0
    try:
        dl = trainer.train_dataloader
        ds = getattr(dl, "dataset", None)
        if ds is not None and hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
            for i in range(min(len(ds), scan_rows)):
                longest = max(longest, _rows_len(ds[i]))
    except Exception:
        logger.debug("memguard: could not scan the dataset for lengths", exc_info=True)
    longest = max(longest, _batch_seq(batch))
    if longest:
        return longest
    logger.warning("memguard: sequence length unknown; estimating with 512 (pass seq_length=...)")
    return 512


def trainspec_from_lightning(trainer, pl_module, batch: Any, model_spec: ModelSpec, *,
                             seq_length: Optional[int] = None, device: str = "auto") -> TrainSpec:
    """Build the ``TrainSpec`` of a Lightning run from the trainer, the module and its first batch."""
    model = find_model(pl_module)
    p = next((p for p in model.parameters()), None)
    weight_dtype = p.dtype if p is not None else torch.float32
    method, kwargs = method_and_lora(model, model_spec)
    dtype, mixed = precision_settings(getattr(trainer, "precision", "32-true"), weight_dtype)
    cfg = getattr(_hf_model(model) or model, "config", None)
    attn_impl = attn_impl_from(getattr(cfg, "_attn_implementation", None))
    hf = _hf_model(model)
    gc_on = False
    if hf is not None:
        attr = "is_activation_checkpointing" if hasattr(type(hf), "is_activation_checkpointing") else "is_gradient_checkpointing"
        gc_on = bool(getattr(hf, attr, False))
    if device == "auto":
        device = "cuda" if (p is not None and p.device.type == "cuda") else "cpu"
    rows = batch_units(batch)
    dl_bs = getattr(getattr(trainer, "train_dataloader", None), "batch_size", None)
    if isinstance(dl_bs, int) and dl_bs > rows:
        rows = dl_bs
    opts = getattr(trainer, "optimizers", None) or []
    if device == "cpu" and "resident_file_bytes" not in kwargs:
        # the mapped libraries' resident pages are part of VmHWM and vary with the page cache
        from memguard_core.stats import process_file_resident_bytes
        kwargs["resident_file_bytes"] = process_file_resident_bytes()
    return TrainSpec(batch_size=max(1, rows), seq_length=infer_seq_length(trainer, pl_module, batch, seq_length),
                     grad_accum=max(1, int(trainer.accumulate_grad_batches)), method=method,
                     optimizer=optimizer_name(opts[0]) if opts else "adamw", dtype=dtype,
                     mixed_precision=mixed, grad_checkpoint=gc_on, attn_impl=attn_impl,
                     framework="lightning", device=device, ranks=max(1, int(trainer.world_size)), **kwargs)


def run_preflight(trainer, pl_module, batch: Any, *, budget_bytes: Optional[int], safety_ratio: float = 0.8,
                  seq_length: Optional[int] = None,
                  apply: Sequence[str] = ("grad_checkpoint", "micro_batch"), device: str = "auto",
                  plan_fraction: float = 0.85) -> Preflight:
    """Estimate the Lightning run, plan against ``plan_fraction x budget`` (below the guard's warning
    level, with what this process already holds counted: ``memguard_core.preflight.plan_in_place``)
    and apply what can be applied in place (activation checkpointing of a HF model; the split factor
    is returned for the caller).

    Raises:
        ConfigError: the model's shapes cannot be read (no config, no embedding + blocks).
        DoesNotFitError: nothing in the allowed search fits.
    """
    model = find_model(pl_module)
    ms = model_spec_from_module(model)
    ts = trainspec_from_lightning(trainer, pl_module, batch, ms, seq_length=seq_length, device=device)
    if budget_bytes is None:
        budget_bytes = default_budget(ts.device if device == "auto" else device, safety_ratio)
    allowed = tuple(a for a in apply if a != "grad_checkpoint" or can_checkpoint(pl_module))
    resident = resident_bytes_for(ts)  # RSS with the model loaded (CPU counter only)
    pf = plan_in_place(ms, ts, budget_bytes, apply=allowed, plan_fraction=plan_fraction, resident_bytes=resident)
    if pf.checkpointing_planned:
        enable_activation_checkpointing(pl_module)
    return pf
