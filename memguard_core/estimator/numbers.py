"""``model_spec_from_numbers``: a ``ModelSpec`` from plain numbers (total parameters, hidden size,
layers, heads, ...), for when no config or module is at hand. docs/estimator.md.
"""

from __future__ import annotations

from typing import Any, Optional

from ..errors import ConfigError, require_positive_int
from .specs import GROUP64_OVERHEAD_BITS, LinearShape, ModelSpec, NF4_BITS, NF4_DOUBLE_QUANT_BITS, ParamCounts


def quant_bits_arg(quantization_bits: Any, double_quant: bool) -> Optional[float]:
    if quantization_bits is None:
        return None
    if isinstance(quantization_bits, bool) or not isinstance(quantization_bits, (int, float)):
        raise ConfigError("quantization_bits", "None, 4, 8, 16 or 32", quantization_bits)
    if quantization_bits == 4:
        return NF4_DOUBLE_QUANT_BITS if double_quant else NF4_BITS
    if quantization_bits in (8, 16, 32):
        return float(quantization_bits)
    raise ConfigError("quantization_bits", "None, 4, 8, 16 or 32", quantization_bits)


_QUANT_MODEL_BITS = (2, 3, 4, 5, 6, 8)


def _bits_from_model_bits(model_bits: Any) -> tuple:
    """``(weight_bits, dense_bits)`` for ``ml-memguard``'s ``model_bits``.

    16 / 32: unquantized, everything in that width. 2, 3, 4, 5, 6, 8: quantized block linears at
    ``b + 0.5`` bits (group-64 constants: MLX affine quantization stores an fp16 scale and bias
    per 64 weights, bitsandbytes NF4 an fp32 absmax per 64: both 0.5 bit/weight), the rest in 16
    bits. A non-integer in (1, 32] (e.g. 4.127) is taken as the effective bits as given.
    """
    if isinstance(model_bits, bool) or not isinstance(model_bits, (int, float)):
        raise ConfigError("model_bits", "one of 2, 3, 4, 5, 6, 8, 16, 32 (or effective bits in (1, 32])",
                          model_bits)
    b = float(model_bits)
    if b in (16.0, 32.0):
        return b, b
    if b.is_integer() and int(b) in _QUANT_MODEL_BITS:
        return b + GROUP64_OVERHEAD_BITS, 16.0
    if not b.is_integer() and 1.0 < b <= 32.0:
        return b, 16.0 if b < 16 else b
    raise ConfigError("model_bits", "one of 2, 3, 4, 5, 6, 8, 16, 32 (or effective bits in (1, 32])",
                      model_bits)


def model_spec_from_numbers(model_params: int, hidden_dim: int, num_layers: int, num_heads: int,
                            num_kv_heads: Optional[int] = None, model_bits: float = 16,
                            vocab_size: int = 32000, intermediate_size: Optional[int] = None,
                            num_experts: int = 0, num_experts_per_tok: int = 0,
                            tie_word_embeddings: bool = False, name: str = "custom") -> ModelSpec:
    """A llama-like ``ModelSpec`` from ``ml-memguard``'s ``preflight(...)`` numbers.

    Shapes follow Llama (transformers ``LlamaForCausalLM``): per block q/k/v/o projections
    (``head_dim = hidden_dim / num_heads``, k/v ``num_kv_heads * head_dim`` wide, no bias), a SwiGLU
    MLP gate/up/down, two RMSNorms (weight only); a final norm; token embedding and, unless tied,
    an lm_head. With ``num_experts > 0`` the MLP is a Mixtral-style sparse MoE: router
    ``gate`` (hidden -> E) and fused experts ``gate_up_proj``/``down_proj`` (count E), laid out
    as in transformers 5.

    ``model_params`` is split so the kinds add up to it exactly: embeddings, head, attention,
    norms and router come from the shapes, the MLP (or experts) takes the rest. Without
    ``intermediate_size`` it is derived from that rest (``rest // (3 * hidden * layers [* E])``).

    Raises:
        ConfigError: a non-positive or non-integer count, ``hidden_dim`` not divisible by
            ``num_heads``, ``num_heads`` not divisible by ``num_kv_heads``, bad ``model_bits``,
            ``num_experts_per_tok`` outside ``[1, num_experts]``, or ``model_params`` smaller
            than the embeddings + attention + norms the shapes imply.
    """
    P = require_positive_int("model_params", model_params)
    H = require_positive_int("hidden_dim", hidden_dim)
    L = require_positive_int("num_layers", num_layers)
    nh = require_positive_int("num_heads", num_heads)
    kv = nh if num_kv_heads is None else require_positive_int("num_kv_heads", num_kv_heads)
    V = require_positive_int("vocab_size", vocab_size)
    E = require_positive_int("num_experts", num_experts, allow_zero=True)
    k = require_positive_int("num_experts_per_tok", num_experts_per_tok, allow_zero=True)
    inter = None if intermediate_size is None else require_positive_int("intermediate_size",
                                                                         intermediate_size)
    if H % nh:
        raise ConfigError("hidden_dim", f"a multiple of num_heads ({nh})", H)
    if kv > nh or nh % kv:
        raise ConfigError("num_kv_heads", f"a divisor of num_heads ({nh})", kv)
    if E:
        if k == 0:
            k = min(2, E)  # Mixtral's top-2 routing when the caller does not say
        if k > E:
            raise ConfigError("num_experts_per_tok", f"an integer in [1, num_experts={E}]", k)
    elif k:
        raise ConfigError("num_experts_per_tok", "0 when num_experts is 0", k)
    if not isinstance(tie_word_embeddings, bool):
        raise ConfigError("tie_word_embeddings", "a bool", tie_word_embeddings)
    if not isinstance(name, str) or not name:
        raise ConfigError("name", "a non-empty string", name)
    weight_bits, dense_bits = _bits_from_model_bits(model_bits)

    hd = H // nh
    attn_block = H * nh * hd + 2 * H * kv * hd + nh * hd * H
    norms_block = 2 * H
    router_block = E * H
    embeddings = V * H
    lm_head = 0 if tie_word_embeddings else V * H
    fixed = embeddings + lm_head + L * (attn_block + norms_block + router_block) + H
    ffn = P - fixed
    per_unit = L * 3 * H * (E or 1)
    if ffn < (per_unit if inter is None else 0):
        raise ConfigError("model_params",
                          f"at least {fixed + per_unit:,} for these shapes (embeddings, attention, "
                          f"norms{', router' if E else ''} and a minimal MLP)", P)
    if inter is None:
        inter = ffn // per_unit
    counts = ParamCounts(embeddings=embeddings, attention=L * attn_block,
                         mlp=0 if E else ffn, experts=ffn if E else 0, router=L * router_block,
                         norms=L * norms_block + H, lm_head=lm_head, other=0,
                         norms_in_blocks=L * norms_block)
    lin = [LinearShape("q_proj", H, nh * hd, 1, "attention", False, "self_attn.q_proj"),
           LinearShape("k_proj", H, kv * hd, 1, "attention", False, "self_attn.k_proj"),
           LinearShape("v_proj", H, kv * hd, 1, "attention", False, "self_attn.v_proj"),
           LinearShape("o_proj", nh * hd, H, 1, "attention", False, "self_attn.o_proj")]
    if E:
        lin += [LinearShape("gate", H, E, 1, "router", False, "mlp.gate"),
                LinearShape("gate_up_proj", H, 2 * inter, E, "experts", False,
                            "mlp.experts.gate_up_proj", True),
                LinearShape("down_proj", inter, H, E, "experts", False, "mlp.experts.down_proj", True)]
    else:
        lin += [LinearShape("gate_proj", H, inter, 1, "mlp", False, "mlp.gate_proj"),
                LinearShape("up_proj", H, inter, 1, "mlp", False, "mlp.up_proj"),
                LinearShape("down_proj", inter, H, 1, "mlp", False, "mlp.down_proj")]
    return ModelSpec(
        name=name, model_type="mixtral" if E else "llama", vocab_size=V, hidden_size=H,
        intermediate_size=inter, num_layers=L, num_heads=nh, num_kv_heads=kv, head_dim=hd,
        params=counts, block_linears=tuple(lin), num_experts=E, num_experts_per_tok=k,
        moe_intermediate_size=inter if E else 0, tie_word_embeddings=tie_word_embeddings,
        weight_bits=weight_bits, dense_bits=dense_bits, source="numbers")
