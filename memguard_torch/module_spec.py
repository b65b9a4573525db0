"""Reading a live ``torch.nn.Module`` (PEFT / bitsandbytes aware) into a ``ModelSpec``: the one
parameter classifier the three routes (config, module, numbers) share. torch is imported inside
functions only. One classifier serves the three routes, so a spec counted from a config.json, from a
live module and (where it can) from bare numbers splits its parameters the same way.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Any, Mapping, Optional

from memguard_core.errors import ConfigError
from memguard_core.estimator.components import component_kind
from memguard_core.estimator.config_fields import (config_numbers, fill_intermediate, image_tokens_per_image,
                                                   vision_tower_from_config)
from memguard_core.estimator.specs import dtype_bits, LinearShape, ModelSpec, NF4_BITS, NF4_DOUBLE_QUANT_BITS, ParamCounts

from .task_head import task_head_from_module
from .train_reading import peft_base


_log = logging.getLogger("memguard.spec")
_LORA_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                         "lora_magnitude_vector", "lora_dropout"})
#: torch dtype names -> the estimator's dtype names.


#: Module names of a vision-language model's vision side (transformers 5 modeling code:
#: Qwen2-VL / Qwen2.5-VL ``model.visual`` (its ``merger`` inside), LLaVA / Gemma-3 / Mllama
#: ``model.vision_tower`` or ``vision_model`` + ``model.multi_modal_projector``, SmolVLM / Idefics3
#: ``model.vision_model`` + ``model.connector``, LLaVA-NeXT ``image_newline``).
_VISION_PARTS = frozenset({"visual", "vision_tower", "vision_model", "vision_encoder", "vision_embed_tokens",
                           "multi_modal_projector", "mm_projector", "vision_projector", "connector",
                           "image_newline", "vision"})


def _is_vision_path(parts: list) -> bool:
    """True when a parameter's module path (outside the blocks) lies on the vision side."""
    return any(p in _VISION_PARTS for p in parts)


def _is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def _clean_path(path: str) -> str:
    """Drop PEFT wrapper parts (``base_layer``, ``original_module``) from a module path."""
    return ".".join(p for p in path.split(".") if p not in ("base_layer", "original_module"))


def _real_numel(param: Any, module: Any = None) -> int:
    """Element count of the weight a parameter stands for.

    bitsandbytes ``Params4bit`` stores two 4-bit values per uint8 byte in a flattened
    ``(n/2, 1)`` tensor; its ``quant_state.shape`` is the original shape
    (bitsandbytes/functional.py ``quantize_4bit``). Without a quant state (not yet quantized,
    still on the CPU) the tensor holds the real shape.
    """
    if type(param).__name__ == "Params4bit":
        qs = getattr(param, "quant_state", None)
        shape = getattr(qs, "shape", None)
        if shape is not None:
            return int(math.prod(shape))
        if param.dtype.is_floating_point:  # not quantized yet: real shape
            return int(param.numel())
        if module is not None and hasattr(module, "in_features") and hasattr(module, "out_features"):
            return int(module.in_features) * int(module.out_features)
        return int(param.numel()) * 2
    return int(param.numel())


def _find_blocks(model: Any, num_layers: Optional[int]):
    """The ``nn.ModuleList`` holding the transformer blocks: ``(prefix, modulelist)``.

    The list with ``num_layers`` entries (when known) holding the most parameters.
    """
    import torch.nn as nn

    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            if num_layers and len(mod) != num_layers:
                continue
            n = sum(p.numel() for p in mod.parameters())
            if best is None or n > best[2]:
                best = (name, mod, n)
    if best is None:
        return None, None
    return best[0], best[1]


def _linear_in_out(module: Any) -> Optional[tuple]:
    """(in_features, out_features, bias) of a linear-like module, else None.

    ``nn.Linear`` (and subclasses: bitsandbytes ``Linear4bit``/``Linear8bitLt``) holds weight
    ``(out, in)``; HF's ``Conv1D`` (transformers/pytorch_utils.py, GPT-2) holds weight ``(in, out)``
    with ``nx = in`` and ``nf = out``.
    """
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return int(module.in_features), int(module.out_features), module.bias is not None
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        nx = getattr(module, "nx", None)
        if nx is None:
            nx = module.weight.shape[0]
        return int(nx), int(module.nf), getattr(module, "bias", None) is not None
    return None


def torch_block_linears(block: Any, hidden_size: int, is_moe: bool) -> tuple:
    """Linear projections of one block as ``LinearShape`` s (expert copies merged, count=E)."""
    import torch.nn as nn

    found: dict = {}  # path -> [LinearShape fields]

    def add(path: str, name: str, fin: int, fout: int, bias: bool, kind: str, count: int = 1,
            is_param: bool = False) -> None:
        if path in found:
            found[path]["count"] += count
        else:
            found[path] = dict(name=name, in_features=fin, out_features=fout, count=count,
                               kind=kind, bias=bias, path=path, is_param=is_param)

    for mpath, mod in block.named_modules():
        parts = mpath.split(".") if mpath else []
        if any(p in _LORA_PARTS for p in parts) or "modules_to_save" in parts:
            continue
        if isinstance(mod, nn.Embedding) or _is_norm(mod):
            continue
        clean = [p for p in _clean_path(mpath).split(".") if p and not p.isdigit()]
        lin = _linear_in_out(mod)
        if lin is not None:
            kind = component_kind(clean, is_moe)
            if kind == "other":
                kind = "mlp"
            add(".".join(clean), clean[-1] if clean else mpath, lin[0], lin[1], lin[2], kind)
            continue
        # Bare weights owned directly by a non-Linear module: fused experts (3D) and routers (2D).
        own = dict(mod.named_parameters(recurse=False))
        for pname, p in own.items():
            if pname.endswith("_bias") or pname == "bias":
                continue
            ppath = ".".join(clean + [pname]) if pname != "weight" else ".".join(clean)
            pparts = ppath.split(".")
            kind = component_kind(pparts, is_moe)
            if kind == "other":
                kind = "mlp"
            if p.dim() == 3:
                # Fused expert weights (transformers 5, e.g. MixtralExperts.gate_up_proj of shape
                # (E, 2*I, H) used as F.linear weight; gpt-oss stores (E, H, 2*I)). The hidden
                # size is the input of gate/up and the output of down.
                e, a, b = (int(s) for s in p.shape)
                if "down" in pname:
                    fout = hidden_size if hidden_size in (a, b) else a
                    fin = b if fout == a else a
                else:
                    fin = hidden_size if hidden_size in (a, b) else b
                    fout = a if fin == b else b
                has_bias = (pname + "_bias") in own
                add(ppath, pname, fin, fout, has_bias, "experts" if kind != "shared_experts" else kind,
                    count=e, is_param=True)
            elif p.dim() == 2 and pname == "weight":
                has_bias = "bias" in own and own["bias"] is not None
                add(ppath, pparts[-1], int(p.shape[1]), int(p.shape[0]), has_bias, kind,
                    is_param=False)
    return tuple(LinearShape(**f) for f in found.values())


def count_params(model: Any, *, num_layers: Optional[int], hidden_size: int, is_moe: bool,
                  tied: Optional[bool]) -> dict:
    """Count a model's parameters by kind from ``named_parameters``.

    Args:
        tied: ``True``/``False`` forces whether ``lm_head`` shares the input embedding (the config
            route: a meta-device build in transformers 5 leaves the head untied); ``None`` trusts
            the module (``named_parameters`` lists a shared tensor once).

    Returns a dict: ``counts`` (``ParamCounts``), ``block_linears``, ``adapter_params``,
    ``trainable`` (elements with ``requires_grad``, adapters included), ``lora_rank`` (max
    ``lora_A`` rank or None), ``quant`` (``None`` | ``"nf4"`` | ``"nf4-dq"`` | ``"int8"``),
    ``linear_bits`` (dtype bits of the block linear weights), ``embed_bits``, ``num_blocks``,
    ``block_prefix`` (dotted name of the block list, ``None`` when none was found) and
    ``per_block`` (block index -> dict of the elements that block adds to each ``ParamCounts``
    field, plus ``trainable``; a parameter listed once under several blocks counts in the first).
    """
    import torch.nn as nn

    modules = dict(model.named_modules())
    prefix, blocks = _find_blocks(model, num_layers)
    block_re = re.compile(r"^" + re.escape(prefix) + r"\.(\d+)\.") if prefix else None

    emb_in = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        emb_out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except Exception:  # some heads raise NotImplementedError
        emb_out = None
    emb_in_w = getattr(emb_in, "weight", None)
    out_ids = {id(p) for p in emb_out.parameters()} if emb_out is not None else set()

    c = dict(embeddings=0, attention=0, mlp=0, experts=0, router=0, norms=0, lm_head=0, other=0,
             vision=0, norms_in_blocks=0)
    adapter = trainable = 0
    per_block: dict = {}
    lora_dims: list = []
    quant = None
    linear_bits = None
    embed_bits = dtype_bits(getattr(emb_in_w, "dtype", None))

    for pname, p in model.named_parameters():
        parts = pname.split(".")
        mpath = ".".join(parts[:-1])
        owner = modules.get(mpath)
        n = _real_numel(p, owner)
        if p.requires_grad:
            trainable += n
        if any(q in _LORA_PARTS for q in parts) or "modules_to_save" in parts:
            adapter += n
            if "lora_A" in parts and p.dim() == 2:
                lora_dims.append(int(p.shape[0]))
            continue
        tname = type(p).__name__
        if tname == "Params4bit":
            qs = getattr(p, "quant_state", None)
            dq = bool(getattr(qs, "nested", False) or getattr(p, "compress_statistics", False))
            quant = "nf4-dq" if dq else (quant or "nf4")
        elif tname == "Int8Params" and quant is None:
            quant = "int8"
        if id(p) in out_ids and p is not emb_in_w:  # a head tied in place is the embedding
            if tied and emb_in_w is not None and p is not emb_in_w and tuple(p.shape) == tuple(emb_in_w.shape):
                continue  # the head shares the embedding: counted once, there
            c["lm_head"] += n
            continue
        m = block_re.match(pname) if block_re else None
        if m is not None:
            bc = per_block.setdefault(int(m.group(1)), dict.fromkeys(c, 0))
            bc.setdefault("trainable", 0)
            if p.requires_grad:
                bc["trainable"] += n
            if _is_norm(owner):
                c["norms"] += n
                c["norms_in_blocks"] += n
                bc["norms"] += n
                bc["norms_in_blocks"] += n
                continue
            rel = _clean_path(pname[m.end():])
            rparts = [q for q in rel.split(".") if not q.isdigit()]
            kind = component_kind(rparts[:-1] if rparts[-1] in ("weight", "bias") else rparts, is_moe)
            if kind == "shared_experts":
                kind = "mlp"
            elif kind == "other" and owner is not None and _linear_in_out(owner) is not None:
                kind = "mlp"  # a block linear outside any named sub-module (OPT's fc1/fc2)
            if kind in ("attention", "mlp", "experts") and p.dim() >= 2 and linear_bits is None \
                    and tname not in ("Params4bit", "Int8Params"):
                linear_bits = dtype_bits(p.dtype)
            c[kind] += n
            bc[kind] += n
            continue
        if _is_vision_path(parts[:-1]):
            c["vision"] += n
        elif isinstance(owner, nn.Embedding) or owner is emb_in:
            c["embeddings"] += n
        elif owner is not None and _is_norm(owner):
            c["norms"] += n
        else:
            c["other"] += n

    # The rank is the most common lora_A height: PEFT's lora_A is nn.Linear(in, r) (weight (r, in)),
    # but a fused-expert ParamWrapper stacks the experts' A matrices as (r * E, in).
    lora_rank = max(set(lora_dims), key=lambda d: (lora_dims.count(d), -d)) if lora_dims else None
    linears = ()
    if blocks is not None and len(blocks):
        linears = torch_block_linears(blocks[len(blocks) - 1], hidden_size, is_moe)
    return dict(counts=ParamCounts(**c), block_linears=linears, adapter_params=adapter,
                trainable=trainable, lora_rank=lora_rank, quant=quant, linear_bits=linear_bits,
                embed_bits=embed_bits, num_blocks=len(blocks) if blocks is not None else 0,
                block_prefix=prefix if blocks is not None else None, per_block=per_block)


def model_spec_from_module(model: Any, name: Optional[str] = None, *, config: Any = None) -> ModelSpec:
    """Introspect a live ``torch.nn.Module``: a HF ``PreTrainedModel`` or a PEFT ``PeftModel``.

    Counts come from ``named_parameters`` (a tied head, being the same tensor, is listed once).
    LoRA/DoRA adapter tensors (``lora_A``/``lora_B``/``lora_magnitude_vector``) and PEFT
    ``modules_to_save`` copies are kept out of ``params`` (which describe the base architecture)
    and reported in ``adapter_params``; ``trainable_params`` counts every element with
    ``requires_grad``; ``lora_rank_found`` is the largest ``lora_A`` weight's first dimension
    (PEFT's ``lora_A`` is ``nn.Linear(in, r)``, weight ``(r, in)``). ``head`` is the task head read
    from the module's class and tree (``memguard_torch.task_head.task_head_from_module``).
    ``config``: the config to read the numbers from in place of the model's own (a copy the
    caller completed; the model's is the user's object and is never changed here).

    bitsandbytes: a ``Params4bit`` weight packs two 4-bit values per uint8 (its ``numel`` is
    half the real count; ``quant_state.shape`` holds the real shape); ``weight_bits`` becomes
    4.5 (NF4) or 4.127 when the quant state is nested (double quantization,
    ``compress_statistics``); ``Int8Params`` gives 8. Otherwise ``weight_bits`` is the dtype of
    the block linears and ``dense_bits`` that of the input embedding.

    Raises:
        ConfigError: ``model`` is not a torch module, or its shapes cannot be found (no config
            and no block list / embedding).
    """
    try:
        import torch.nn as nn
    except ImportError:  # pragma: no cover
        raise ConfigError("model", "a torch.nn.Module", type(model).__name__) from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model", "a torch.nn.Module (HF PreTrainedModel or PEFT PeftModel)",
                          type(model).__name__)
    base = peft_base(model)
    cfg = config if config is not None else getattr(base, "config", None)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    nums = None
    if text_cfg is not None:
        try:
            nums = config_numbers(text_cfg)
        except ConfigError:
            nums = None
    if nums is None:
        nums = _numbers_from_structure(base)
    counted = count_params(base, num_layers=nums["num_layers"], hidden_size=nums["hidden_size"],
                            is_moe=nums["num_experts"] > 0, tied=None)
    fill_intermediate(nums, counted["block_linears"])
    emb_in = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    emb_out = None
    try:
        emb_out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    except Exception:
        pass
    tied = bool(emb_in is not None and emb_out is not None
                and getattr(emb_out, "weight", None) is getattr(emb_in, "weight", 0))
    lora_rank = counted["lora_rank"]
    peft_cfgs = getattr(model, "peft_config", None)
    if lora_rank is not None and isinstance(peft_cfgs, Mapping):
        active = getattr(model, "active_adapter", None)
        pc = peft_cfgs.get(active) if isinstance(active, str) else None
        pc = pc or next(iter(peft_cfgs.values()), None)
        if isinstance(getattr(pc, "r", None), int):
            lora_rank = pc.r  # the adapter's own rank (PEFT LoraConfig.r)
    dense = counted["embed_bits"] or counted["linear_bits"] or 32.0
    quant = counted["quant"]
    if quant == "nf4":
        wbits = NF4_BITS
    elif quant == "nf4-dq":
        wbits = NF4_DOUBLE_QUANT_BITS
    elif quant == "int8":
        wbits = 8.0
    else:
        wbits = counted["linear_bits"] or dense
    label = name or getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or type(base).__name__
    return ModelSpec(
        name=str(label), model_type=str(getattr(cfg, "model_type", None) or type(base).__name__),
        params=counted["counts"], block_linears=counted["block_linears"], tie_word_embeddings=tied,
        weight_bits=float(wbits), dense_bits=float(dense), trainable_params=counted["trainable"],
        lora_rank_found=lora_rank, adapter_params=counted["adapter_params"],
        image_tokens=image_tokens_per_image(cfg) if cfg is not None else 0,
        vision_tower=vision_tower_from_config(cfg) if cfg is not None else None, source="module",
        head=task_head_from_module(base), **nums)


def _numbers_from_structure(model: Any) -> dict:
    """ModelSpec numbers of a module without a usable config: from its embedding and blocks.

    Heads cannot be read from weights; ``num_heads`` is taken as ``hidden // 64`` (the common
    head size) and marked by ``head_dim = 64``.
    """
    import torch.nn as nn

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    _, blocks = _find_blocks(model, None)
    weight = getattr(emb, "weight", None)   # an image model's input embedding is a patch conv module
    if emb is None or blocks is None or getattr(weight, "ndim", 0) != 2:
        raise ConfigError("model", "a model with a config, or an nn.Embedding and a block ModuleList",
                          type(model).__name__)
    vocab, hidden = (int(s) for s in weight.shape)
    heads = max(1, hidden // 64)
    return dict(hidden_size=hidden, num_heads=heads, num_layers=len(blocks), vocab_size=vocab,
                num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=0,
                num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
