"""``model_spec_from_hf_config``: a ``ModelSpec`` from a Hugging Face config, its parameters counted
exactly on the meta device, with the truncation cache:
for a uniform stack two short copies (1-2 and 2-4 blocks) are counted and extended per layer; other
layouts fall back to the full meta build; and ``config_from_dict``, the transformers config class of a
raw config dict. torch / transformers / accelerate are imported inside functions only.
"""

from __future__ import annotations

import logging
import dataclasses
import json
import re
from typing import Any, Mapping, Optional

from memguard_core.errors import ConfigError
from memguard_core.estimator.numbers import quant_bits_arg
from memguard_core.estimator.config_fields import (REQUIRED_KEYS, cfg_get, config_numbers, fill_intermediate,
                                                   image_tokens_per_image, is_vision_language, load_config_dict,
                                                   quant_bits_from_config, vision_tower_from_config)
from memguard_core.estimator.heads import (AUTO_CLASSES, CAUSAL_LM, IMAGE_CLASSIFICATION, IMAGE_FAMILIES, SEQ2SEQ_LM,
                                           TaskHead, check_image_family, check_seq2seq_family,
                                           head_kind_from_architectures, parse_head)
from memguard_core.estimator.specs import DTYPE_NAMES, ModelSpec, ParamCounts, dtype_bits

from memguard_torch.module_spec import count_params, torch_block_linears
from memguard_torch.task_head import task_head_from_module
from memguard_torch.train_reading import peft_base

_log = logging.getLogger("memguard.spec")


_META_CACHE: dict = {}
# Private switch: False forces the full meta build for every config (the tests compare both routes).
_FAST_COUNT = True
# Config keys that make blocks differ by their index in transformers 5.23 (modeling_*.py of the
# model types named), with the values that keep every block alike. A key set otherwise sends the
# config to the full build.
_LAYOUT_RULES = {
    # qwen2_moe / qwen3_moe / qwen3_next / flint / qwen3_omni_moe: a block is sparse iff
    # ``layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0``
    "decoder_sparse_step": lambda v, L: v in (None, 1),
    # deepseek_v2 / deepseek_v3 / glm4_moe / glm4v_moe / dots1 / mistral4: dense below k
    "first_k_dense_replace": lambda v, L: v in (None, 0),
    # afmoe / lfm2_moe: ``moe_enabled = layer_idx >= num_dense_layers``
    "num_dense_layers": lambda v, L: v in (None, 0),
    # deepseek (v1 layout): a MoE block every ``moe_layer_freq`` layers
    "moe_layer_freq": lambda v, L: v in (None, 1),
    # llama4: a MoE block every ``interleave_moe_layer_step`` layers
    "interleave_moe_layer_step": lambda v, L: v in (None, 1),
    # ernie4_5_moe: MoE iff ``(i + 1) % interval == 0 and start <= i <= end``
    "moe_layer_interval": lambda v, L: v in (None, 1),
    "moe_layer_start_index": lambda v, L: v in (None, 0),
    "moe_layer_end_index": lambda v, L: v is None or v == -1 or (isinstance(v, int) and v >= L - 1),
    # jamba / zamba: attention and expert blocks every ``period`` layers from ``offset``
    "attn_layer_period": lambda v, L: v is None,
    "attn_layer_offset": lambda v, L: v is None,
    "expert_layer_period": lambda v, L: v is None,
    "expert_layer_offset": lambda v, L: v is None,
    # inkling2: a block-attention residual module at block boundaries and on layer_idx > 0
    "n_layers_per_attn_res_block": lambda v, L: v is None,
    # gemma3n / gemma4: the last layers share KV; per-layer embeddings sized by the layer count
    "num_kv_shared_layers": lambda v, L: v in (None, 0),
    "hidden_size_per_layer_input": lambda v, L: v in (None, 0),
    "kv_sharing_modes": lambda v, L: not v,
    # blip_2 / instructblip / evolla: cross attention every n layers
    "cross_attention_frequency": lambda v, L: v is None,
    "aligner_num_add_layers": lambda v, L: v is None,
    # nemotron_h: one character per layer selects the block type
    "hybrid_override_pattern": lambda v, L: not v,
    # DeciLM / Nemotron-NAS: one config per block; transformers' heterogeneous per-layer configs
    "block_configs": lambda v, L: not v,
    "per_layer_config": lambda v, L: not v,
    # mllama / zamba2 / qwen4_exp: lists of layer indices with an extra module
    "cross_attention_layers": lambda v, L: not v,
    "hybrid_layer_ids": lambda v, L: not v,
    "ple_layer_ids": lambda v, L: not v,
}
# Lists of layer indices that select a block kind (qwen2_moe-family ``mlp_only_layers``, llama4
# ``moe_layers``): alike when empty or when they hold every index (then cut to ``range(S)``).
_INDEX_LISTS = frozenset({"mlp_only_layers", "moe_layers"})
# List fields that are not per-layer (token ids; mamba's (min, max) clamp).
_HARMLESS_LISTS = frozenset({"architectures", "eos_token_id", "bos_token_id", "pad_token_id",
                             "time_step_limit", "suppress_tokens", "begin_suppress_tokens"})
# Scalars whose names look like layout keys but only derive a per-layer list the config also
# holds (``layer_types``: qwen2 ``max_window_layers``, gemma ``sliding_window_pattern``, afmoe
# ``global_attn_every_n_layers``, llama4 / smollm3 ``no_rope_layer_interval``) or name layers
# transformers does not build (``num_nextn_predict_layers``: DeepSeek multi-token prediction).
_HARMLESS_KEYS = frozenset({"num_hidden_layers", "num_layers", "n_layers", "n_layer",
                            "max_window_layers", "num_nextn_predict_layers", "num_mtp_layers",
                            "no_rope_layer_interval", "sliding_window_pattern",
                            "_sliding_window_pattern", "global_attn_every_n_layers",
                            "scale_attn_by_inverse_layer_idx"})
# Any other key that looks like a layout knob is unknown: set to anything but None/False/empty,
# the config goes to the full build.
_LAYOUT_KEY_RE = re.compile(r"first_k|dense_(layers|replace)|sparse_step|layer_(freq|step|period|offset|"
                            r"interval)|_(start|end)_index|every_n|per_layer|layers?_ids?$|layer_idxs?$|"
                            r"_idxs$|block_configs?|override_pattern|shared_layers|_layers$")


def config_from_dict(d: dict, label: str) -> Any:
    """A transformers config from a raw dict, checking the fields memguard needs exist."""
    from transformers import AutoConfig, CONFIG_MAPPING

    mt = d.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise ConfigError(f"{label}: model_type", "the transformers model_type (e.g. 'llama')", mt)
    if mt not in CONFIG_MAPPING:
        raise ConfigError(f"{label}: model_type", "a model_type this transformers knows", mt)
    if mt in IMAGE_FAMILIES and "vocab_size" not in d:
        d = dict(d, vocab_size=1)  # an image classifier has no token vocabulary (_with_vocab)
    cls = CONFIG_MAPPING[mt]
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    amap = getattr(cls, "attribute_map", {}) or {}
    sub = getattr(cls, "sub_configs", {}) or {}
    if text is not d and "text_config" in sub:
        amap = getattr(sub["text_config"], "attribute_map", {}) or {}
    for key in REQUIRED_KEYS[1:]:
        alias = amap.get(key)
        if key not in text and (alias is None or alias not in text):
            raise ConfigError(f"{label}: {key}" + (f" (or {alias})" if alias else ""),
                              "present in the model config", None)
    _check_heads(text, amap, label)
    d = {k: v for k, v in d.items() if k not in ("quantization_config", "model_type")}
    if "torch_dtype" in d and "dtype" not in d:  # transformers 5 renamed it (and warns)
        d["dtype"] = d.pop("torch_dtype")
    try:
        return AutoConfig.for_model(mt, **d)
    except Exception as exc:  # TypeError / ValueError, huggingface_hub's strict-dataclass validators
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise ConfigError(label, f"a valid {mt} config", str(cause)) from None


def _check_heads(text: dict, amap: dict, label: str) -> None:
    """The head counts of a raw config dict divide what they must (else transformers' validators
    raise deep inside the config class): ``num_attention_heads`` divides ``hidden_size`` unless the
    config gives ``head_dim``, and ``num_key_value_heads`` divides ``num_attention_heads``.

    Raises:
        ConfigError: naming the field and the path.
    """
    def get(key):
        v = text.get(key, text.get(amap.get(key, ""), None))
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    hidden, heads, kv = get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads")
    if hidden and heads and not get("head_dim") and hidden % heads:
        raise ConfigError(f"{label}: num_attention_heads", f"a divisor of hidden_size ({hidden}), or a "
                          "head_dim in the config", heads)
    if heads and kv and heads % kv:
        raise ConfigError(f"{label}: num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv)


def _freeze(v: Any) -> Any:
    """A hashable stand-in for a per-layer value (dicts and lists as sorted JSON)."""
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, sort_keys=True, default=str)
    return v


_PROPS_BY_CLASS: dict = {}


def _list_properties(cls: type) -> tuple:
    """Names of a config class's properties that may hold per-layer values (``layer`` /
    ``block`` / ``modes`` in the name; others are not read: some warn as deprecated). Cached."""
    names = _PROPS_BY_CLASS.get(cls)
    if names is None:
        names = tuple(n for n in dir(cls) if re.search(r"layer|block|modes", n)
                      and isinstance(getattr(cls, n, None), property))
        _PROPS_BY_CLASS[cls] = names
    return names


def _truncation_plan(cfg: Any, num_layers: int):
    """How to count ``cfg`` from short copies: ``(n_a, n_b, fields, types)`` or a reason string.

    ``fields``: ``{name: list}`` to cut to the first ``n`` entries (per-layer lists, and index lists
    holding every layer); ``types[i]``: the tuple of layer ``i``'s per-layer values. ``n_a`` is the
    shortest prefix holding every distinct tuple, ``n_b > n_a`` the shortest holding each tuple
    twice (once when it occurs once).
    """
    L = num_layers
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if text is not cfg:
        return "composite config (the text stack is a sub-config)"
    if cfg_get(cfg, "num_hidden_layers", "n_layer") != L:
        return "the layer count is not num_hidden_layers"
    if getattr(cfg, "is_heterogeneous", False):
        return "heterogeneous per-layer config"
    d = cfg.to_dict()
    # per-layer lists a config computes in a property (jamba ``layers_block_type``, bamba,
    # recurrent_gemma): not in to_dict, so they cannot be cut; any that varies sends the config to
    # the full build
    for name in _list_properties(type(cfg)):
        if name in d:
            continue
        try:
            v = getattr(cfg, name)
        except Exception:
            continue
        if isinstance(v, (list, tuple)) and len(v) == L and len({_freeze(x) for x in v}) > 1:
            return f"per-layer property {name} varies"
    per_layer: dict = {}
    fields: dict = {}
    for k, v in d.items():
        rule = _LAYOUT_RULES.get(k)
        if rule is not None:
            if not rule(v, L):
                return f"{k}={v!r} lays the blocks out by index"
            continue
        if k in _INDEX_LISTS:
            if not v:
                continue
            if isinstance(v, (list, tuple)) and sorted(set(v)) == list(range(L)):
                fields[k] = "all"
                continue
            return f"{k}={v!r} selects some layers"
        if isinstance(v, (list, tuple)):
            if k in _HARMLESS_LISTS or len(v) == 0:
                continue
            if len(v) == L:
                per_layer[k] = v
                fields[k] = v
                continue
            return f"list {k} has {len(v)} entries, not one per layer ({L})"
        unset = v is None or v is False or (isinstance(v, (str, dict)) and not v)
        if _LAYOUT_KEY_RE.search(k) and k not in _HARMLESS_KEYS and not unset:
            return f"unknown layout key {k}={v!r}"
    names = sorted(per_layer)
    types = [tuple(_freeze(per_layer[k][i]) for k in names) for i in range(L)]
    first: dict = {}
    second: dict = {}
    for i, t in enumerate(types):
        if t not in first:
            first[t] = i
        elif t not in second:
            second[t] = i
    n_a = 1 + max(first.values())
    n_b = max(n_a + 1, 1 + max(second.get(t, first[t]) for t in first))
    if n_a + n_b >= L:
        return f"the short copies ({n_a} + {n_b} blocks) are not shorter than the model ({L})"
    return n_a, n_b, fields, types


def _build_meta(cfg: Any, head: str = CAUSAL_LM) -> Any:
    """The model a config describes, built under ``torch.device("meta")`` and accelerate's
    ``init_empty_weights`` (every tensor on the meta device; the second guard catches code that
    creates parameters on an explicit device): ``AutoModelForImageTextToText`` for a
    vision-language causal LM (the class users fine-tune: vision tower, projector and language
    model; ``AutoModelForCausalLM`` would build Mllama's text model alone or refuse Qwen2-VL /
    LLaVA), else the Auto class of the head kind (``memguard_core.estimator.heads.AUTO_CLASSES``:
    ``AutoModelForCausalLM``, ``AutoModelForSequenceClassification``, ...).

    Raises:
        ConfigError: (field ``architectures``, one line) a model type the head's Auto class does
            not list (transformers' own message lists every class it knows).
    """
    import torch
    import transformers
    from accelerate import init_empty_weights

    auto = getattr(transformers, AUTO_CLASSES[head])
    with torch.device("meta"), init_empty_weights():
        if head == CAUSAL_LM and is_vision_language(cfg):
            from transformers import AutoModelForImageTextToText

            try:
                return AutoModelForImageTextToText.from_config(cfg)
            except ValueError:  # a composite config the image-text mapping does not list
                pass
        try:
            return auto.from_config(cfg)
        except ValueError as exc:  # auto_factory.py ``_BaseAutoModelClass.from_config``: the message
            if "Unrecognized configuration class" not in str(exc):  # lists every class it knows
                raise
            raise ConfigError("architectures", f"a model type {AUTO_CLASSES[head]} builds ({head})",
                              getattr(cfg, "model_type", type(cfg).__name__)) from None


def _head_tied(model: Any, tied: bool) -> bool:
    # transformers 5 ties only the pairs a class lists in ``_tied_weights_keys``: a class without
    # any keeps its head even when the config says tie_word_embeddings.
    if tied and hasattr(model, "_tied_weights_keys") and not model._tied_weights_keys:
        return False
    return tied


def _full_count(cfg: Any, nums: dict, tied: bool, head: str) -> dict:
    """Count the whole model built on the meta device (every block)."""
    try:
        model = _build_meta(cfg, head)
    except ConfigError:
        raise
    except Exception as exc:  # whatever the modeling code raises on an inconsistent config
        raise ConfigError("config", f"a config transformers can build ({cfg.model_type})",
                          f"{type(exc).__name__}: {exc}") from None
    tied = _head_tied(model, tied)
    out = count_params(model, num_layers=nums["num_layers"], hidden_size=nums["hidden_size"],
                        is_moe=nums["num_experts"] > 0, tied=tied)
    out["head"] = task_head_from_module(model, head)
    del model
    out.pop("per_block", None)
    out["tied"] = tied
    out["counted_by"] = "full"
    return out


def _count_short(cfg: Any, n: int, fields: dict, nums: dict, tied: bool, head: str) -> Optional[dict]:
    """Count a copy of ``cfg`` cut to ``n`` layers; ``None`` when a block shares a parameter."""
    import copy

    small = copy.deepcopy(cfg)
    small.num_hidden_layers = n  # attribute_map turns it into n_layer (GPT-2) and the like
    if cfg_get(small, "num_hidden_layers", "n_layer") != n:
        return None
    for k, v in fields.items():
        setattr(small, k, list(range(n)) if v == "all" else type(v)(v[:n]))
    model = _build_meta(small, head)
    tied = _head_tied(model, tied)
    is_moe = nums["num_experts"] > 0
    out = count_params(model, num_layers=n, hidden_size=nums["hidden_size"], is_moe=is_moe, tied=tied)
    prefix = out["block_prefix"]
    if prefix is None or out["num_blocks"] != n:
        return None
    # a parameter reachable from a block and from anywhere else (Zamba's shared blocks) would be
    # counted once by the full build, not once per block
    names: dict = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(pname)
    for group in names.values():
        if len(group) > 1 and any(g.startswith(prefix + ".") for g in group):
            return None
    blocks = model.get_submodule(prefix)
    out["linears_by_block"] = [torch_block_linears(b, nums["hidden_size"], is_moe) for b in blocks]
    out["tied"] = tied
    out["head"] = task_head_from_module(model, head)
    return out


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(ParamCounts))


def _truncated_count(cfg: Any, nums: dict, tied: bool, head: str) -> Optional[dict]:
    """Exact counts from two short copies of the model, or ``None`` when that is not sure.

    Blocks are alike when every per-layer value (``layer_types``, ``mlp_layer_types``, any list
    with one entry per layer) is alike and no key of ``_LAYOUT_RULES`` lays blocks out by index.
    The model is built with ``n_a`` and with ``n_b`` layers (see ``_truncation_plan``); in both,
    every block must hold the same counts by kind and the same linears as the blocks of its
    per-layer tuple, and everything outside the blocks must be the same. The full model's counts
    are then the outside counts plus, for each of its layers, the counts of its tuple's block; its
    ``block_linears`` are those of its last layer's tuple. Any failure returns ``None`` (the
    caller builds the whole model).
    """
    L = nums["num_layers"]
    try:
        plan = _truncation_plan(cfg, L)
        if isinstance(plan, str):
            _log.debug("full meta build for %s: %s", getattr(cfg, "model_type", "?"), plan)
            return None
        n_a, n_b, fields, types = plan
        a = _count_short(cfg, n_a, fields, nums, tied, head)
        b = _count_short(cfg, n_b, fields, nums, tied, head) if a is not None else None
    except Exception as exc:  # a config the short copy cannot take: the full build decides
        _log.debug("full meta build for %s: short copy failed (%s: %s)",
                   getattr(cfg, "model_type", "?"), type(exc).__name__, exc)
        return None
    if a is None or b is None:
        _log.debug("full meta build for %s: shared block parameters or no block list", cfg.model_type)
        return None
    keys = _PARAM_FIELDS + ("trainable",)
    zero = dict.fromkeys(keys, 0)

    def block(out: dict, j: int) -> tuple:
        c = out["per_block"].get(j, zero)
        return tuple(c.get(k, 0) for k in keys), out["linears_by_block"][j]

    def outside(out: dict) -> tuple:
        tot = dataclasses.asdict(out["counts"])
        tot["trainable"] = out["trainable"]
        for c in out["per_block"].values():
            for k in keys:
                tot[k] -= c.get(k, 0)
        return tuple(tot[k] for k in keys)

    ref: dict = {}
    for j in range(n_b):
        entry = block(b, j)
        if ref.setdefault(types[j], entry) != entry:
            _log.debug("full meta build for %s: blocks %s differ", cfg.model_type, types[j])
            return None
    same = all(block(a, j) == ref[types[j]] for j in range(n_a))
    same = same and outside(a) == outside(b)
    for k in ("tied", "adapter_params", "lora_rank", "quant", "linear_bits", "embed_bits", "block_prefix", "head"):
        same = same and a[k] == b[k]
    if not same or b["adapter_params"] or b["quant"] is not None:
        _log.debug("full meta build for %s: the short copies disagree", cfg.model_type)
        return None
    total = list(outside(b))
    for t in types:
        for i, v in enumerate(ref[t][0]):
            total[i] += v
    tot = dict(zip(keys, total))
    trainable = tot.pop("trainable")
    return dict(counts=ParamCounts(**tot), block_linears=ref[types[-1]][1], adapter_params=0,
                trainable=trainable, lora_rank=None, quant=None, linear_bits=b["linear_bits"],
                embed_bits=b["embed_bits"], num_blocks=L, block_prefix=b["block_prefix"],
                tied=b["tied"], head=b["head"], counted_by=f"short copies ({n_a} and {n_b} of {L} layers)")


def _meta_count(cfg: Any, nums: dict, tied: bool, head: str = CAUSAL_LM) -> dict:
    """Count a config's parameters on the meta device (no weight memory); cached per config.

    Fast path (``_truncated_count``): when the blocks are provably alike up to their per-layer
    values, two short copies of the model (a few layers each) are built and the per-block counts
    are extended to all layers: the time no longer grows with the depth. Otherwise (a layout key
    such as ``first_k_dense_replace``, ``decoder_sparse_step`` or ``mlp_only_layers`` set, a
    composite config, shared block parameters, any doubt) the whole model is built
    (``_full_count``). Both give the same result; ``counted_by`` says which ran.
    """
    try:
        key = (("fast:" if _FAST_COUNT else "full:") + head + ":"
               + json.dumps(cfg.to_dict(), sort_keys=True, default=str))
    except Exception:  # unserializable config: no cache
        key = None
    if key is not None and key in _META_CACHE:
        return _META_CACHE[key]
    out = _truncated_count(cfg, nums, tied, head) if _FAST_COUNT else None
    if out is None:
        out = _full_count(cfg, nums, tied, head)
    if key is not None:
        if len(_META_CACHE) >= 64:
            _META_CACHE.pop(next(iter(_META_CACHE)))
        _META_CACHE[key] = out
    return out


def model_spec_from_hf_config(config: Any, name: Optional[str] = None, *,
                              quantization_bits: Optional[int] = None,
                              double_quant: bool = False, head: Optional[str] = None) -> ModelSpec:
    """Introspect a Hugging Face config, counting parameters exactly.

    The model is built with the Auto class of its task head (``AutoModelForCausalLM``,
    ``AutoModelForSequenceClassification``, ...: the first head the config's ``architectures``
    names, a causal LM when it names none, or ``head``) under ``torch.device("meta")``
    and accelerate's ``init_empty_weights`` (no weight memory); the counts are cached per config.
    When the blocks are provably alike up to their per-layer values (``layer_types`` and other
    one-entry-per-layer lists), only two short copies (a few layers each) are built and the
    per-block counts are extended to every layer, so the time does not grow with the depth
    (~10-40 ms after the imports, 135M to 70B); a config with a layout key that makes blocks
    differ by index (``first_k_dense_replace``, ``decoder_sparse_step``, ``mlp_only_layers``,
    Jamba periods, ...), a composite (multimodal) config, or short copies that disagree falls
    back to building every block (time grows with the layer count). Both routes give the same
    ModelSpec. Every parameter is classified by kind (see ``ParamCounts``);
    ``config.tie_word_embeddings`` is respected explicitly (transformers 5 leaves a meta-built
    head untied), so a tied head counts 0.

    Args:
        config: path to a ``config.json``, a directory holding one, a dict (a parsed
            config.json) or a ``transformers.PretrainedConfig``.
        name: label; defaults to the path or ``_name_or_path`` or ``model_type``.
        quantization_bits: load-time quantization of the block linears: 4 (bitsandbytes NF4,
            4.5 bits/weight, 4.127 with ``double_quant``), 8, 16 or 32. ``None``: take it from the
            config's ``quantization_config`` if any, else the config dtype.
        double_quant: NF4 double quantization (``bnb_4bit_use_double_quant``).
        head: the task head kind (``memguard_core.estimator.heads.HEAD_KINDS``, as
            ``parse_head`` reads it), overriding the config's ``architectures``.

    Returns:
        ``ModelSpec`` with ``source="hf-config"``. ``dense_bits`` is the config dtype's bits
        (``torch_dtype``/``dtype``; 32 when absent, transformers' default float32).

    Raises:
        ConfigError: unreadable path, invalid JSON, missing ``model_type`` / ``hidden_size`` /
            ``num_hidden_layers`` / ``num_attention_heads`` / ``vocab_size`` (not needed for an
            image classifier; the message names the field and the path), unknown model_type, or a
            config transformers cannot build; in one line, Whisper, a head the estimator does not
            count (masked image modeling, multiple choice, ...) or a model type the head's Auto
            class does not build.
    """
    qbits = quant_bits_arg(quantization_bits, double_quant)
    raw_qc = None
    if hasattr(config, "to_dict") and hasattr(config, "model_type") and not isinstance(config, Mapping):
        cfg = config
        label = getattr(cfg, "_name_or_path", "") or cfg.model_type
        raw_qc = getattr(cfg, "quantization_config", None)
    else:
        d, label = load_config_dict(config)
        raw_qc = d.get("quantization_config")
        # a head or an encoder-decoder family not counted: one line, before transformers reads it
        if head is None:
            head_kind_from_architectures(d.get("architectures"), d.get("model_type"), bool(d.get("is_encoder_decoder")))
        elif d.get("is_encoder_decoder"):
            check_seq2seq_family(d.get("model_type"))
        cfg = config_from_dict(d, label if label != "config" else "config")
    enc_dec = bool(getattr(cfg, "is_encoder_decoder", False))
    if head is None:
        kind = head_kind_from_architectures(getattr(cfg, "architectures", None), cfg.model_type, enc_dec)
    else:  # --head overrides the config's ``architectures``
        if enc_dec:
            check_seq2seq_family(cfg.model_type)
        kind = parse_head(head)
        if enc_dec != (kind == SEQ2SEQ_LM):
            raise ConfigError("head", f"{SEQ2SEQ_LM} for an encoder-decoder, another head otherwise "
                              f"(model_type {cfg.model_type})", head)
    image = image_fields(cfg) if kind == IMAGE_CLASSIFICATION else {}
    if image:
        cfg = _with_vocab(cfg)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    nums = config_numbers(text_cfg)
    tied = bool(getattr(text_cfg, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False)))
    counted = _meta_count(cfg, nums, tied, kind)
    tied = counted["tied"]
    fill_intermediate(nums, counted["block_linears"])
    # ``torch_dtype`` is read from __dict__: transformers 5 warns on the deprecated attribute.
    dense = dtype_bits(getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype")) or 32.0
    if qbits is None:
        qbits = quant_bits_from_config(raw_qc)
    weight_bits = qbits if qbits is not None else dense
    if qbits is not None and qbits < 16:
        dense = min(dense, 16.0)  # bitsandbytes keeps the rest in the compute dtype (fp16/bf16)
    declared = DTYPE_NAMES.get(str(getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype"))
                                .replace("torch.", ""))
    head_spec, block_linears, params, with_meta = counted["head"], counted["block_linears"], counted["counts"], {}
    if enc_dec:
        with_meta = _seq2seq_meta_fields(cfg)
        head_spec, block_linears = with_meta.pop("head"), with_meta.pop("block_linears")
        nums.update(with_meta.pop("numbers"))
        # the per-kind count sees the stacks' embed_tokens apart from ``shared``; tied, they are one
        # tensor (transformers ``_tied_weights_keys``), as the tied model built by ``tie_weights`` says
        total, tied = with_meta.pop("total"), with_meta.pop("tied")
        params = dataclasses.replace(params, embeddings=params.embeddings - (params.total - total),
                                     lm_head=0 if tied else params.lm_head)
    return ModelSpec(
        name=name or str(label), model_type=str(cfg.model_type), params=params,
        block_linears=block_linears, tie_word_embeddings=tied,
        weight_bits=float(weight_bits), dense_bits=float(dense), source="hf-config",
        weight_dtype=declared, image_tokens=image_tokens_per_image(cfg),
        vision_tower=vision_tower_from_config(cfg), head=head_spec, **with_meta, **image, **nums)


def _square_side(cfg: Any, key: str) -> int:
    """``cfg.<key>`` (``image_size`` / ``patch_size``) as one side in pixels: an int, or a pair of
    equal ints (``ViTPatchEmbeddings`` takes either).

    Raises:
        ConfigError: (field ``key``, one line) missing, not a positive integer, or a non-square pair.
    """
    v = getattr(cfg, key, None)
    if isinstance(v, (list, tuple)) and len(v) == 2 and v[0] == v[1]:
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(key, "a positive integer (pixels; a square image)", v)
    return int(v)


def image_fields(cfg: Any, image_size: Optional[int] = None) -> dict:
    """The ``ModelSpec`` fields of an image classifier's config (ViT, DeiT): ``image_size``,
    ``patch_size``, ``num_channels`` (3 when the config has none) and ``prefix_tokens``
    (``heads.check_image_family``: CLS, and DeiT's distillation token); ``image_size`` given (the
    side a guarded run reads from ``pixel_values``) replaces the config's.

    Raises:
        ConfigError: (one line) a vision family the estimator does not count (``model_type``);
            an ``image_size`` / ``patch_size`` that is not a positive integer or a square pair, or
            an image smaller than one patch (naming the field).
    """
    prefix = check_image_family(getattr(cfg, "model_type", None))
    size = _square_side(cfg, "image_size") if image_size is None else int(image_size)
    patch = _square_side(cfg, "patch_size")
    ch = getattr(cfg, "num_channels", 3)
    if isinstance(ch, bool) or not isinstance(ch, int) or ch < 1:
        raise ConfigError("num_channels", "a positive integer (pixel channels)", ch)
    if size < patch:
        raise ConfigError("image_size", f"at least patch_size ({patch} pixels)", size)
    return dict(image_size=size, patch_size=patch, num_channels=int(ch), prefix_tokens=prefix)


def _with_vocab(cfg: Any) -> Any:
    """``cfg``, or a copy of it with ``vocab_size`` 1 when it has none: an image classifier's config
    names no token vocabulary, which ``config_numbers`` and the estimate's vocabulary terms read
    (embedding gradients, LM logits: 1 makes them vanish)."""
    if isinstance(getattr(cfg, "vocab_size", None), int):
        return cfg
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.vocab_size = 1
    return cfg


def live_model_spec(model: Any, dataset: Any = None, name: Optional[str] = None) -> Any:
    """``memguard_torch.module_spec.model_spec_from_module`` of a live model, and for an image
    classifier (ViT, DeiT) its image fields (:func:`image_fields`), the image side read from the
    ``pixel_values`` of ``dataset``'s first rows (``rows.largest_image``) when they hold one, the
    config's otherwise; ``name`` labels the spec (``model_spec_from_module``'s).

    ``model_spec_from_module`` reads the numbers from the model's config, and an image classifier's
    names no vocabulary: that call reads a copy with ``vocab_size`` 1 (:func:`_with_vocab`; the
    model's config is the user's object, saved with the model, and is not changed). The rows
    scanned are the first ``rows.IMAGE_SCAN_ROWS``, with the random states put back after (an image
    dataset's ``__getitem__`` often draws random augmentations).

    Raises:
        ConfigError: as ``model_spec_from_module``; as :func:`image_fields`.
    """
    from memguard_torch.module_spec import model_spec_from_module

    from .rows import largest_image

    base = peft_base(model)
    cfg = getattr(base, "config", None)
    if getattr(cfg, "model_type", None) not in IMAGE_FAMILIES or "ForImageClassification" not in type(base).__name__:
        return model_spec_from_module(model, name=name)
    ms = model_spec_from_module(model, name=name, config=_with_vocab(cfg))
    return ms.replace(**image_fields(cfg, largest_image(dataset) or None))


def _seq2seq_meta_fields(cfg: Any) -> dict:
    """:func:`seq2seq_fields` of the model ``cfg`` describes, built on the meta device (cached per
    config)."""
    key = "seq2seq:" + json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    if key not in _META_CACHE:
        model = _build_meta(cfg, SEQ2SEQ_LM)
        model.tie_weights()
        fields = seq2seq_fields(model)
        fields["total"] = sum(p.numel() for p in model.parameters())
        fields["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        _META_CACHE[key] = fields
    out = dict(_META_CACHE[key])
    out["numbers"] = dict(out["numbers"])
    return out


def seq2seq_fields(model: Any) -> dict:
    """The encoder-decoder fields of a ``ModelSpec`` read from a T5 / mT5 / BART
    ``*ForConditionalGeneration`` (PEFT-wrapped or not, live or on the meta device):
    ``decoder_layers`` and ``decoder_block_linears`` (from ``model.get_decoder()``'s block list:
    T5 ``T5Stack.block``, BART ``BartDecoder.layers``), ``block_linears`` (the encoder's, from
    ``model.get_encoder()``'s list), ``ffn_act`` (T5 ``dense_act_fn``, BART
    ``activation_function``), ``ffn_dropout`` (T5 ``dropout_rate``, BART ``activation_dropout``),
    ``head`` (the seq2seq LM head: a final norm outside the blocks for
    T5's pre-norm stacks, none for BART's post-LN ones) and, under ``numbers``, the dropouts the
    config names its own way (T5 ``dropout_rate`` on the residuals, the FFN and the attention
    probabilities; BART ``dropout`` and ``attention_dropout``), which ``config_numbers`` does not
    read.

    Raises:
        ConfigError: (field ``model_type``, one line) an encoder-decoder family the estimator does not
            count (Whisper, ...), or a model without a decoder block list.
    """
    base = peft_base(model)
    cfg = base.config
    check_seq2seq_family(cfg.model_type)
    dec = base.get_decoder() if hasattr(base, "get_decoder") else None
    enc = base.get_encoder() if hasattr(base, "get_encoder") else None
    blocks = getattr(dec, "block", None) or getattr(dec, "layers", None)
    enc_blocks = getattr(enc, "block", None) or getattr(enc, "layers", None)
    if not blocks or not enc_blocks:
        raise ConfigError("model_type", "an encoder-decoder with a decoder block list (T5Stack.block, "
                          "BartDecoder.layers)", cfg.model_type)
    hidden = int(cfg.d_model)
    t5 = cfg.model_type in ("t5", "mt5")
    if t5:
        numbers = dict(residual_dropout=float(cfg.dropout_rate), attention_dropout=float(cfg.dropout_rate),
                       embedding_dropout=0.0)
        act, ffn_p = str(cfg.dense_act_fn), float(cfg.dropout_rate)
    else:
        numbers = dict(residual_dropout=float(cfg.dropout), attention_dropout=float(cfg.attention_dropout),
                       embedding_dropout=0.0)
        act, ffn_p = str(cfg.activation_function), float(cfg.activation_dropout)
    arch = type(base).__name__
    return dict(decoder_layers=len(blocks), decoder_block_linears=torch_block_linears(blocks[-1], hidden, False),
                block_linears=torch_block_linears(enc_blocks[-1], hidden, False),
                ffn_act=act, ffn_dropout=ffn_p, numbers=numbers,
                head=TaskHead(kind=SEQ2SEQ_LM, final_norm=t5, architecture=arch))


def with_seq2seq_fields(model: Any, ms: ModelSpec) -> ModelSpec:
    """``ms`` (read from the live ``model`` by ``memguard_torch.module_spec.model_spec_from_module``)
    with an encoder-decoder's fields (:func:`seq2seq_fields`: the decoder stack, the encoder's block
    linears, the seq2seq LM head, the config's dropouts); ``ms`` itself for any other model.

    Raises:
        ConfigError: (one line) an encoder-decoder family the estimator does not count.
    """
    base = peft_base(model)
    if not getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        return ms
    f = seq2seq_fields(model)
    return ms.replace(decoder_layers=f["decoder_layers"], decoder_block_linears=f["decoder_block_linears"],
                      block_linears=f["block_linears"], num_layers=len(_encoder_blocks(base)),
                      ffn_act=f["ffn_act"], ffn_dropout=f["ffn_dropout"], head=f["head"], **f["numbers"])


def _encoder_blocks(base: Any) -> Any:
    enc = base.get_encoder()
    return getattr(enc, "block", None) or enc.layers
