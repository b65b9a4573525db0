"""Building the traced step of ``memguard estimate --trace`` (``memguard_hf.trace``; docs/estimator.md):
the checks of the settings, the model from its config on the meta device with PEFT's adapters, then
on fake CPU tensors with the optimizer in its steady state and a batch of random token ids.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

from memguard_core.errors import ConfigError
from memguard_core.estimator.config_fields import is_vision_language
from memguard_core.estimator.lora_targets import peft_default_lora_targets
from memguard_core.estimator.specs import DEFAULT_LORA_TARGETS, TrainSpec

__all__ = ["load_config", "validate", "resolve_lora_targets", "dtypes", "build_model", "prepare_step",
           "make_optimizer", "add_lora", "blocks_of", "has_experts"]

_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def load_config(config_or_path: Any):
    """A transformers config from a path / directory / dict / ``PretrainedConfig``."""
    from memguard_core.estimator.config_fields import load_config_dict as _load_config_dict
    from memguard_hf.model_spec import config_from_dict as _config_from_dict

    if hasattr(config_or_path, "to_dict") and hasattr(config_or_path, "model_type"):
        return config_or_path
    d, label = _load_config_dict(config_or_path)
    return _config_from_dict(d, label)


def validate(ts: Any, device: Any) -> None:
    """Check that the trace can run these settings.

    Raises:
        ConfigError: naming the field (see ``memguard_hf.trace.step.trace_step``).
    """
    if not isinstance(ts, TrainSpec):
        raise ConfigError("train_spec", "a memguard_core.estimator.specs.TrainSpec", type(ts).__name__)
    if str(device) != "cpu":
        raise ConfigError("device", "'cpu' (the trace runs the step on fake CPU tensors; a fake cuda device "
                          "needs a CUDA build of torch, and in a CPU build it aborts the process)", device)
    # the trace runs the model's own torch code on fake tensors: the same step whichever loop
    # (HF Trainer, Lightning, a plain PyTorch loop) drives it; only mlx runs other code
    if ts.framework not in ("hf", "lightning", "torch"):
        raise ConfigError("framework", "hf, lightning or torch for --trace (it runs the torch model)",
                          ts.framework)
    if ts.method == "qlora":
        raise ConfigError("method", "full or lora for --trace (bitsandbytes 4-bit layers do not run on fake "
                          "CPU tensors)", ts.method)
    if ts.optimizer in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"):
        raise ConfigError("optimizer", "adam, adamw, sgd, sgd-momentum or adafactor for --trace "
                          "(bitsandbytes' 8-bit AdamW needs CUDA)", ts.optimizer)
    if ts.attn_impl not in ("eager", "sdpa"):
        raise ConfigError("attn_impl", "eager or sdpa for --trace (flash-attention kernels need CUDA)",
                          ts.attn_impl)


def resolve_lora_targets(ts: TrainSpec, cfg) -> TrainSpec:
    """``ts`` with PEFT's default LoRA targets for the model type when none were given, as
    ``estimate()`` and ``plan()`` resolve them."""
    if ts.method != "full" and ts.lora_targets == DEFAULT_LORA_TARGETS:
        default = peft_default_lora_targets(getattr(cfg, "model_type", None))
        if default is not None:
            ts = ts.replace(lora_targets=default)
    return ts


def dtypes(ts: TrainSpec) -> Tuple[bool, Any, Any]:
    """``(autocast, compute dtype, weights dtype)``: fp32 weights under ``torch.autocast(dtype)``
    with ``mixed_precision`` (and a half dtype), else the weights stored in ``dtype``."""
    import torch

    amp = bool(ts.mixed_precision) and ts.dtype != "fp32"
    compute = getattr(torch, _TORCH_DTYPE[ts.dtype])
    return amp, compute, torch.float32 if amp else compute


def build_model(cfg, ts: TrainSpec, wdtype, auto_class: str = "AutoModelForCausalLM") -> Tuple[Any, Any]:
    """``(model, inner)``: the model built from ``cfg`` on the meta device in ``wdtype`` (the
    class users fine-tune: ``AutoModelForImageTextToText`` for a vision-language config), PEFT's
    LoRA on it for ``lora``, every parameter trainable for ``full``; ``inner`` the bare model.
    ``auto_class``: the transformers Auto class of the task head
    (``memguard_core.estimator.heads.AUTO_CLASSES``).

    Raises:
        ConfigError: transformers cannot build the config; LoRA targets that match nothing.
    """
    import torch
    import transformers

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5's deprecation notices
            auto = getattr(transformers, auto_class)
            if is_vision_language(cfg):  # the class users fine-tune: vision tower + language model
                from transformers import AutoModelForImageTextToText as auto
            model = auto.from_config(cfg, dtype=wdtype, attn_implementation=ts.attn_impl)
    except ConfigError:
        raise
    except Exception as exc:  # whatever the modeling code raises on this config / implementation
        raise ConfigError("config", f"a config transformers can build with attn_implementation="
                          f"{ts.attn_impl!r} ({getattr(cfg, 'model_type', '?')})",
                          f"{type(exc).__name__}: {exc}") from None
    inner = model
    if ts.method != "full":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = add_lora(model, cfg, ts)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    return model, inner


def prepare_step(model, inner, ts: TrainSpec, vocab: int, notes: List[str]) -> Tuple[Any, Any, Dict[str, Any]]:
    """Under ``FakeTensorMode``: the model on fake CPU tensors (the head tied back), in training mode
    with the checkpointing of ``ts``, its optimizer in the steady state (the states exist from the
    2nd step on), and the batch. Returns ``(optimizer, input_ids, batch)``; ``notes`` gets the
    assumptions that applied."""
    import torch

    model.to_empty(device="cpu")
    # to_empty gives every parameter its own storage: tie the head back as from_pretrained does
    if hasattr(inner, "tie_weights"):
        inner.tie_weights()
    model.train()
    if ts.grad_checkpoint:
        kw = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:  # transformers < 5
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(trainable, ts.optimizer)
    # steady state: the states exist from the 2nd step on
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=ts.grad_accum == 1)
    if ts.grad_accum > 1:
        notes.append("grad_accum > 1: the .grad of an earlier micro-batch is resident through the step")
    ids = torch.randint(0, vocab, (ts.batch_size, ts.seq_length))
    # No attention_mask: a batch without padding. On fake tensors transformers cannot tell that
    # a mask of ones masks nothing (``masking_utils._ignore_causal_mask_sdpa`` gives up on a
    # tensor ``is_tracing`` flags, FakeTensors included), so it would build the 4-D mask and
    # make sdpa repeat the KV heads -- which the real run with a mask of ones skips.
    return opt, ids, {"input_ids": ids, "labels": ids}


def make_optimizer(params, name: str):
    """The optimizer HF ``Trainer`` builds for ``--optim`` (transformers ``training_args.py``):
    ``adamw`` -> ``adamw_torch_fused`` (its default), ``adam`` -> ``torch.optim.Adam(fused=True)``,
    ``sgd`` -> ``torch.optim.SGD`` without momentum, ``sgd-momentum`` -> momentum 0.9,
    ``adafactor`` -> ``transformers.optimization.Adafactor(scale_parameter=False,
    relative_step=False)``."""
    import torch

    lr = 5e-5
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    raise ConfigError("optimizer", "adam, adamw, sgd, sgd-momentum or adafactor", name)  # pragma: no cover


def add_lora(model, cfg, ts: TrainSpec):
    """PEFT's ``get_peft_model(model, LoraConfig(...))`` of ``ts``'s rank, targets, layers, dropout.

    Raises:
        ConfigError: LoRA targets that match nothing in the model.
    """
    from peft import LoraConfig, get_peft_model

    targets = ts.lora_targets
    tm: Any = "all-linear" if any(t.lower() in ("all-linear", "all_linear") for t in targets) else list(targets)
    kw: Dict[str, Any] = {}
    if ts.lora_layers is not None:
        n = int(getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg,
                        "num_hidden_layers"))
        kw["layers_to_transform"] = list(range(max(n - ts.lora_layers, 0), n))
    try:
        return get_peft_model(model, LoraConfig(r=ts.lora_rank, target_modules=tm, task_type="CAUSAL_LM",
                                                lora_dropout=ts.lora_dropout, **kw))
    except ValueError as exc:
        raise ConfigError("lora_targets", "module names of this model (or all-linear)",
                          f"{','.join(targets)} ({exc})") from None


def blocks_of(model, text_cfg) -> list:
    """The transformer blocks (``memguard_torch.block_kinds.find_blocks`` with the config's
    ``num_hidden_layers``); ``[]`` when there is none."""
    from memguard_torch.block_kinds import find_blocks

    return find_blocks(model, getattr(text_cfg, "num_hidden_layers", None))


def has_experts(model) -> bool:
    """Whether the model holds mixture-of-experts layers (a module class named ``*Experts``)."""
    return any(type(m).__name__.endswith("Experts") for m in model.modules())
