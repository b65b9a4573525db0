"""The numbers of a Hugging Face model config (a config.json path, a dict, or a config object read
by attribute): sizes, dropout probabilities, image tokens, the vision tower, quantization. Plain
reading, no transformers: building the config class and counting on the meta device is
``memguard_hf.model_spec``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

from ..errors import ConfigError
from .specs import LinearShape, NF4_BITS, NF4_DOUBLE_QUANT_BITS, VisionTower


def cfg_get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


#: Config fields of the three dropout probabilities, first present one wins. From the config
#: classes of transformers 5.x: ``GPT2Config`` / ``GPTJConfig`` / ``PhiConfig`` / ``Phi3Config``
#: (``attn_pdrop`` / ``attention_dropout``, ``resid_pdrop``, ``embd_pdrop``), ``LlamaConfig`` and
#: its descendants (``attention_dropout`` only), ``OPTConfig`` (``attention_dropout``, ``dropout``
#: after the attention and after ``fc2``), ``GPTNeoXConfig`` / ``StableLmConfig`` / ``FalconConfig``
#: / ``BloomConfig`` (``hidden_dropout``), ``Starcoder2Config`` (``residual_dropout``,
#: ``embedding_dropout``), ``GPTNeoConfig`` (``resid_dropout``, ``embed_dropout``).
DROPOUT_FIELDS = {
    "attention_dropout": ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout"),
    "residual_dropout": ("resid_pdrop", "residual_dropout", "hidden_dropout", "resid_dropout",
                         "hidden_dropout_prob", "dropout"),
    "embedding_dropout": ("embd_pdrop", "embedding_dropout", "embed_dropout"),
}


def dropout_probabilities(cfg: Any) -> dict:
    """The dropout probabilities a transformers config applies in training, by role
    (``attention_dropout``, ``residual_dropout``, ``embedding_dropout``; 0.0 when the config has
    none), read through ``DROPOUT_FIELDS``. A value that is not a number in [0, 1) reads as 0.0
    (some configs keep a module name or None there)."""
    out = {}
    for role, names in DROPOUT_FIELDS.items():
        v = 0.0
        for n in names:
            x = getattr(cfg, n, None)
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                v = float(x) if 0.0 <= float(x) < 1.0 else 0.0
                break
        out[role] = v
    return out


#: Image tokens per image a vision-language decoder sees, when the config does not fix it, by
#: model type: the family's documented default resolution. Qwen2-VL / Qwen2.5-VL resize each image
#: dynamically (processor ``min_pixels`` .. ``max_pixels``); 448 x 448 px -> (448 / 14)^2 patches /
#: ``spatial_merge_size``^2 = 256 tokens is counted (``Qwen2VLImageProcessor``: one token per 28 x 28
#: px). Mllama feeds the image through cross-attention layers, so the decoder sequence does not grow.
IMAGE_TOKENS_DEFAULT_PX = {"qwen2_vl": 448, "qwen2_5_vl": 448, "qwen3_vl": 448}
#: Tiles one image becomes at the processor's default settings, by model type: Idefics3 / SmolVLM
#: split an image into up to 4 x 4 tiles plus a downscaled global view (``do_image_splitting=True``,
#: ``max_image_size`` = 4 tiles per edge: ``Idefics3ImageProcessor``); LLaVA-NeXT's ``anyres`` adds up
#: to 2 x 2 grid tiles to the base view (``image_grid_pinpoints`` up to 672 x 672).
IMAGE_TILES_DEFAULT = {"idefics3": 17, "smolvlm": 17, "llava_next": 5}


def image_tokens_per_image(cfg: Any) -> int:
    """Tokens one image adds to the language model's sequence, from a vision-language config
    (0 for a text-only config and for cross-attention models such as Mllama).

    Rules (transformers 5 configs / processors): ``mm_tokens_per_image`` (Gemma-3: 256);
    ``image_seq_len`` (Idefics3 / SmolVLM); else ``(image_size / patch_size)^2`` patches of the
    vision config, divided by ``scale_factor^2`` (Idefics3 / SmolVLM pixel shuffle) or by
    ``spatial_merge_size^2`` (Qwen2-VL merger), with LLaVA's ``vision_feature_select_strategy``
    "default" dropping the CLS token (576 for LLaVA-1.5's 336 px / 14); Qwen2-VL-style dynamic
    resolution at ``IMAGE_TOKENS_DEFAULT_PX``; times the tiles of ``IMAGE_TILES_DEFAULT`` where the
    family's processor splits an image by default.
    """
    if not is_vision_language(cfg) or cfg.model_type == "mllama":
        return 0
    return IMAGE_TILES_DEFAULT.get(cfg.model_type, 1) * _tokens_per_tile(cfg)


def _tokens_per_tile(cfg: Any) -> int:
    for key in ("mm_tokens_per_image", "image_seq_len", "image_seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return int(v)
    vc = cfg.vision_config
    patch = getattr(vc, "patch_size", None) or 14
    size = getattr(vc, "image_size", None) or IMAGE_TOKENS_DEFAULT_PX.get(cfg.model_type, 448)
    if isinstance(size, (list, tuple)):
        size = size[0]
    n = (int(size) // int(patch)) ** 2
    merge = getattr(vc, "spatial_merge_size", None)
    scale = getattr(cfg, "scale_factor", None) or getattr(vc, "scale_factor", None)
    if isinstance(merge, int) and merge > 1:
        n //= merge * merge
    elif isinstance(scale, int) and scale > 1:
        n //= scale * scale
    return int(n)


#: Vision-language families whose tower :func:`vision_tower_from_config` reads, by ``model_type``.
VISION_TOWER_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "gemma3", "idefics3", "smolvlm")


def vision_tower_from_config(cfg: Any) -> Optional[VisionTower]:
    """The vision tower and projector of a vision-language config (:class:`VisionTower`), or
    ``None`` for a text-only config and a family not in :data:`VISION_TOWER_FAMILIES` (Mllama's
    tiled two-encoder tower with gated cross-attention, Qwen3-VL's deepstack mergers: not read).

    Layouts (transformers 5 modeling files; linear paths as PEFT sees them):

    * Qwen2-VL (``qwen2_vl/modeling_qwen2_vl.py`` ``Qwen2VLVisionBlock``): LayerNorm ``norm1`` /
      ``norm2``, fused ``attn.qkv`` + ``attn.proj``, ``mlp.fc1`` / ``mlp.fc2`` with QuickGELU; width
      ``embed_dim``, MLP ``embed_dim * mlp_ratio``; ``PatchMerger`` ``ln_q`` + ``merger.mlp.0`` /
      ``merger.mlp.2`` (GELU between) on ``spatial_merge_size^2`` patches per token.
    * Qwen2.5-VL (``qwen2_5_vl``): the same with RMSNorm, a gated SiLU MLP (``mlp.gate_proj`` /
      ``up_proj`` / ``down_proj``), width ``hidden_size``, output ``out_hidden_size``.
    * LLaVA / LLaVA-NeXT (CLIP or SigLIP ``vision_config``; ``clip/modeling_clip.py``): LayerNorm
      ``layer_norm1`` / ``layer_norm2``, ``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` /
      ``out_proj``, ``mlp.fc1`` / ``mlp.fc2``; CLIP adds a CLS token to the patches; every block runs
      and its saved tensors are live at the loss (the tower's output object, last block included,
      outlives the forward), although only ``vision_feature_layer`` (-2) reaches
      ``multi_modal_projector.linear_1`` / ``linear_2`` (GELU between).
    * Gemma-3 (SigLIP, ``gemma3/modeling_gemma3.py``): SigLIP blocks, ``post_layernorm``, then
      ``Gemma3MultiModalProjector``'s average pool, RMSNorm and a bare ``mm_input_projection_weight``
      matmul (no ``nn.Linear``: ``all-linear`` adapts none of the projector).
    * Idefics3 / SmolVLM (``idefics3/modeling_idefics3.py``): SigLIP-style blocks, ``post_layernorm``,
      pixel shuffle, then ``connector.modality_projection.proj``.

    ``patches_per_image`` is at the image size and tiling :func:`image_tokens_per_image` assumes.
    """
    if not is_vision_language(cfg):
        return None
    mt = str(getattr(cfg, "model_type", ""))
    if mt not in VISION_TOWER_FAMILIES:
        return None
    vc = cfg.vision_config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text_h = _positive_int(getattr(text, "hidden_size", None))
    tiles = IMAGE_TILES_DEFAULT.get(mt, 1)
    tokens = image_tokens_per_image(cfg)
    act_name = str(getattr(vc, "hidden_act", "gelu"))
    act = "quick_gelu" if act_name == "quick_gelu" else "gelu"

    def lin(path: str, fin: int, fout: int, bias: bool = True) -> LinearShape:
        kind = "attention" if path.split(".")[0] in ("attn", "self_attn") else "mlp"
        return LinearShape(path.rsplit(".", 1)[-1], int(fin), int(fout), kind=kind, bias=bias, path=path)

    if mt in ("qwen2_vl", "qwen2_5_vl"):
        merge = int(getattr(vc, "spatial_merge_size", 2) or 2)
        heads = _positive_int(getattr(vc, "num_heads", None))
        if mt == "qwen2_vl":
            h = _positive_int(getattr(vc, "embed_dim", None))
            i = int(h * float(getattr(vc, "mlp_ratio", 4)))
            out = _positive_int(getattr(vc, "hidden_size", None))
            mlp = (lin("mlp.fc1", h, i), lin("mlp.fc2", i, h))
            norm = "layernorm"
        else:
            h = _positive_int(getattr(vc, "hidden_size", None))
            i = _positive_int(getattr(vc, "intermediate_size", None))
            out = _positive_int(getattr(vc, "out_hidden_size", None))
            mlp = (lin("mlp.gate_proj", h, i), lin("mlp.up_proj", h, i), lin("mlp.down_proj", i, h))
            norm, act = "rmsnorm", "silu_gated"
        if not (h and i and heads and out):
            return None
        m2 = merge * merge
        return VisionTower(
            model_type=mt, hidden_size=h, intermediate_size=i, num_layers=_positive_int(getattr(vc, "depth", None)),
            num_heads=heads, patches_per_image=tokens * m2, projector_tokens=tokens, norm=norm, act=act,
            block_linears=(lin("attn.qkv", h, 3 * h), lin("attn.proj", h, h)) + mlp,
            projector_linears=(lin("merger.mlp.0", h * m2, h * m2), lin("merger.mlp.2", h * m2, out)),
            projector_norm=h * m2, projector_act=h * m2)
    h = _positive_int(getattr(vc, "hidden_size", None))
    i = _positive_int(getattr(vc, "intermediate_size", None))
    heads = _positive_int(getattr(vc, "num_attention_heads", None))
    layers = _positive_int(getattr(vc, "num_hidden_layers", None))
    patch = _positive_int(getattr(vc, "patch_size", None))
    size = getattr(vc, "image_size", None)
    size = _positive_int(size[0] if isinstance(size, (list, tuple)) else size)
    if not (h and i and heads and layers and patch and size and text_h):
        return None
    per_tile = (size // patch) ** 2
    blocks = (lin("self_attn.q_proj", h, h), lin("self_attn.k_proj", h, h), lin("self_attn.v_proj", h, h),
              lin("self_attn.out_proj", h, h), lin("mlp.fc1", h, i), lin("mlp.fc2", i, h))
    # SigLIP's attention-pooling head (``SiglipMultiheadAttentionPoolingHead``: nn.MultiheadAttention's
    # ``out_proj`` is an nn.Linear subclass) runs on one probe token and no VLM uses its output
    head = ((lin("head.attention.out_proj", h, h), lin("head.mlp.fc1", h, i), lin("head.mlp.fc2", i, h))
            if getattr(vc, "vision_use_head", False) else ())
    if mt in ("llava", "llava_next"):
        cls = 1 if "clip" in str(getattr(vc, "model_type", "")) else 0
        fl = getattr(cfg, "vision_feature_layer", -2)
        fls = list(fl) if isinstance(fl, (list, tuple)) else [fl]  # a list: those layers concatenated
        bias = bool(getattr(cfg, "multimodal_projector_bias", True))
        return VisionTower(
            model_type=mt, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
            patches_per_image=tiles * (per_tile + cls), projector_tokens=tokens, act=act, block_linears=blocks,
            unused_linears=head,
            projector_linears=(lin("multi_modal_projector.linear_1", h * len(fls), text_h, bias),
                               lin("multi_modal_projector.linear_2", text_h, text_h, bias)),
            projector_act=text_h)
    if mt == "gemma3":
        # post_layernorm's input and the projector's average pool input, per patch
        return VisionTower(model_type=mt, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
                           patches_per_image=per_tile, projector_tokens=tokens, act=act, block_linears=blocks,
                           extra_patch_features=2 * h, unused_linears=head)
    scale = int(getattr(cfg, "scale_factor", 1) or 1)  # idefics3 / smolvlm
    return VisionTower(
        model_type=mt, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
        patches_per_image=tiles * per_tile, projector_tokens=tokens, act=act, block_linears=blocks,
        projector_linears=(lin("connector.modality_projection.proj", h * scale * scale, text_h, False),),
        extra_patch_features=h, unused_linears=head)


def config_numbers(cfg: Any) -> dict:
    """The ModelSpec numbers of a transformers config (text config of a multimodal one).

    Sources: transformers' config classes (``LlamaConfig``: ``num_key_value_heads`` defaults to
    ``num_attention_heads``, ``head_dim`` to ``hidden_size // num_attention_heads``;
    ``MixtralConfig.num_local_experts``; ``Qwen2MoeConfig.num_experts``/``moe_intermediate_size``;
    ``DeepseekV3Config.n_routed_experts``; ``GPT2Config.n_inner`` defaulting to ``4 * n_embd``).
    """
    hidden = cfg_get(cfg, "hidden_size", "n_embd", "d_model")
    heads = cfg_get(cfg, "num_attention_heads", "n_head")
    layers = cfg_get(cfg, "num_hidden_layers", "n_layer")
    vocab = cfg_get(cfg, "vocab_size")
    for field_name, v in (("hidden_size", hidden), ("num_attention_heads", heads),
                          ("num_hidden_layers", layers), ("vocab_size", vocab)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(field_name, "a positive integer in the model config", v)
    kv = cfg_get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv is None and getattr(cfg, "multi_query", False):
        kv = 1
    kv = int(kv or heads)
    head_dim = cfg_get(cfg, "head_dim")
    if not isinstance(head_dim, int) or head_dim < 1:
        if hidden % heads:
            raise ConfigError("num_attention_heads", f"a divisor of hidden_size ({hidden}), or a head_dim "
                              "in the model config", heads)
        head_dim = hidden // heads
    if heads % kv:
        raise ConfigError("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv)
    experts = int(cfg_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    per_tok = int(cfg_get(cfg, "num_experts_per_tok", "moe_topk", default=0) or 0) if experts else 0
    inter = cfg_get(cfg, "intermediate_size", "n_inner", "ffn_dim")
    moe_inter = int(cfg_get(cfg, "moe_intermediate_size", "expert_intermediate_size", default=0) or 0)
    if experts and not moe_inter and inter:
        moe_inter = int(inter)  # Mixtral convention: intermediate_size is per expert
    return dict(hidden_size=int(hidden), num_heads=int(heads), num_layers=int(layers),
                vocab_size=int(vocab), num_kv_heads=kv, head_dim=int(head_dim),
                intermediate_size=int(inter) if isinstance(inter, int) else 0,
                num_experts=experts, num_experts_per_tok=per_tok, moe_intermediate_size=moe_inter,
                attn_logit_softcapping=_positive_float(cfg_get(cfg, "attn_logit_softcapping")),
                final_logit_softcapping=_positive_float(cfg_get(cfg, "final_logit_softcapping")),
                max_position_embeddings=_positive_int(cfg_get(cfg, "max_position_embeddings", "n_positions",
                                                               "max_sequence_length")),
                **dropout_probabilities(cfg))


def _positive_int(v: Any) -> int:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _positive_float(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0.0


def fill_intermediate(nums: dict, linears: tuple) -> None:
    """Take intermediate_size from the MLP linears when the config leaves it implicit (GPT-2)."""
    if nums["intermediate_size"]:
        return
    h = nums["hidden_size"]
    for lin in linears:
        if lin.kind in ("mlp", "shared_experts") and lin.in_features == h and lin.out_features != h:
            nums["intermediate_size"] = lin.out_features
            return
    for lin in linears:
        if lin.kind == "experts" and lin.in_features == h:
            nums["intermediate_size"] = lin.out_features
            return


#: The keys a raw config dict must hold for memguard to read it.
REQUIRED_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def load_config_dict(config: Any) -> tuple:
    """``(dict, label)`` from a path to config.json, a directory holding one, or a mapping."""
    if isinstance(config, Mapping):
        return dict(config), "config"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, "r", encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError("config", "a readable config.json path or a directory holding one",
                              f"{path} ({exc.strerror or exc})") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("config", f"valid JSON in {path}", f"{exc.msg} at line {exc.lineno}") from None
        if not isinstance(d, dict):
            raise ConfigError("config", f"a JSON object in {path}", type(d).__name__)
        return d, path
    raise ConfigError("config", "a config.json path, a directory, a dict or a PretrainedConfig",
                      type(config).__name__)


def is_vision_language(cfg: Any) -> bool:
    """A composite config with a vision side (``vision_config`` among its sub-configs)."""
    return getattr(cfg, "vision_config", None) is not None


def quant_bits_from_config(qc: Any) -> Optional[float]:
    """Weight bits implied by a config's ``quantization_config`` (bitsandbytes, GPTQ, AWQ).

    bitsandbytes 4-bit: NF4_BITS / NF4_DOUBLE_QUANT_BITS; 8-bit: 8. GPTQ/AWQ ``bits`` with
    ``group_size`` g: ``bits + (16 + bits) / g`` (an fp16 scale and a ``bits``-wide zero point per
    group, AutoGPTQ/AutoAWQ packing).
    """
    if not isinstance(qc, Mapping):
        qc = getattr(qc, "to_dict", lambda: None)()
        if not isinstance(qc, Mapping):
            return None
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        return NF4_DOUBLE_QUANT_BITS if qc.get("bnb_4bit_use_double_quant") else NF4_BITS
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        return 8.0
    bits = qc.get("bits")
    if isinstance(bits, (int, float)) and not isinstance(bits, bool) and 1 <= bits <= 16:
        g = qc.get("group_size") or qc.get("q_group_size") or 0
        return float(bits) + ((16.0 + bits) / g if isinstance(g, int) and g > 0 else 0.0)
    return None
