"""The weights terms: stored weights (dense and bitsandbytes-quantized), the dequantized transient,
fp32 master weights and autocast weight copies; the bytes of a trainable parameter.
docs/estimator.md, "bitsandbytes: QLoRA (NF4) and LLM.int8".
"""

from __future__ import annotations

import math
from typing import List

from .gradients import grad_layers
from .trainable import block_linear_shapes
from .specs import DTYPE_BYTES, LinearShape, ModelSpec, NF4_BITS, TrainSpec


def weight_bits(ms: ModelSpec, ts: TrainSpec) -> float:
    """Storage bits of the block linears: NF4 (4.5) for QLoRA on an unquantized spec."""
    if ts.method == "qlora" and ms.weight_bits >= 8:
        return NF4_BITS
    return float(ms.weight_bits)


def weight_bytes(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """Stored weights: block linears (attention + MLP + experts) at ``weight_bits`` (NF4 4.5 bits /
    4.127 with double quantization under QLoRA, bitsandbytes ``Linear4bit``), everything else
    (embeddings, head, norms, router) at ``dense_bits`` -- bitsandbytes skips ``lm_head`` and never
    quantizes embeddings or norms (transformers ``integrations/bitsandbytes.py``). LoRA adapters are
    fp32: PEFT ``get_peft_model(autocast_adapter_dtype=True)`` upcasts bf16/fp16 adapters to fp32,
    mlx_lm creates them fp32 (``tuner/lora.py``)."""
    p = ms.params
    quant = p.attention + p.mlp + p.experts
    dense = p.total - quant
    b = quant * weight_bits(ms, ts) / 8 + dense * ms.dense_bits / 8
    if ts.method != "full":
        b += trainable * 4
    return int(math.ceil(b))


#: NF4's absmax block, and double quantization's: bnb ``quantize_4bit`` / ``quantize_blockwise(absmax, 256)``.
BNB_4BIT_BLOCKSIZE = 64
BNB_DQ_BLOCKSIZE = 256


def nf4_storage_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes a bitsandbytes NF4 weight of ``numel`` elements occupies on the device: the packed
    data ``(numel + 1) // 2`` (uint8 storage), the absmax (``ceil(numel / 64)`` fp32; with double
    quantization ``ceil(numel / 64)`` uint8 + ``ceil(blocks / 256)`` fp32 + the 256-entry fp32 code
    + the fp32 offset) and the 16-entry fp32 NF4 code of the ``QuantState``. Source:
    ``bitsandbytes/functional.py`` ``quantize_4bit`` / ``QuantState``; ``nn/modules.py``
    ``Params4bit._quantize``. Per weight this is 4.5 bits (4.127 with double quantization), the
    QLoRA paper's figures (Dettmers et al. 2023, sec. 3), plus a few hundred bytes per tensor."""
    n = int(numel)
    blocks = -(-n // BNB_4BIT_BLOCKSIZE)
    b = (n + 1) // 2 + 16 * 4
    if double_quant:
        b += blocks + 4 * (-(-blocks // BNB_DQ_BLOCKSIZE)) + 256 * 4 + 4
    else:
        b += 4 * blocks
    return b


def _quantized_linears(ms: ModelSpec) -> List[LinearShape]:
    """Block linears bitsandbytes quantizes: the module linears (not routers, not transformers 5's
    fused expert tensors)."""
    return [ls for ls in block_linear_shapes(ms) if not ls.is_param and ls.kind not in ("router", "experts")]


def dequant_transient_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of the weight bitsandbytes materialises for one quantized linear's matmul, live while
    that linear runs in the forward and again in the backward (one layer at a time).

    * 4-bit: ``MatMul4Bit.forward`` / ``backward`` (``bitsandbytes/autograd/_functions.py``) call
      ``dequantize_4bit(B, quant_state)`` -- a dense out x in weight in ``quant_state.dtype`` (the
      dtype the weight was loaded in) cast ``.to(A.dtype)`` -- then ``F.linear``; the dense copy is
      freed after the matmul. With double quantization ``dequantize_4bit`` first rebuilds the fp32
      absmax (``dequantize_blockwise(absmax, state2) + offset``): 4 bytes per 64 weights more.
      Counted for the largest quantized linear of a block.
    * 8-bit (LLM.int8, ``MatMul8bitLt``): the input quantized to int8 (tokens x in bytes) and the
      int32 product (tokens x out x 4) before it is dequantized.
    Zero without bitsandbytes weights."""
    wb = weight_bits(ms, ts)
    if ts.framework == "mlx" or ts.method == "full" or wb >= 16:
        return 0
    lins = _quantized_linears(ms)
    if not lins:
        return 0
    e = DTYPE_BYTES[ts.dtype]
    if ts.mixed_precision and ms.dense_bits >= 32 and e < 4:
        e = 2
    if wb >= 8:
        tokens = ts.batch_size * ts.seq_length
        return max(tokens * (ls.in_features + 4 * ls.out_features) for ls in lins)
    big = max(ls.in_features * ls.out_features for ls in lins)
    out = e * big
    if wb < NF4_BITS - 0.1:  # double quantization: the fp32 absmax rebuilt first
        out += 4 * (-(-big // BNB_4BIT_BLOCKSIZE))
    return int(out)


def trainable_param_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes per element of a trainable parameter (and so of its gradient and, for torch/MLX
    optimizers, of its states: ``torch.zeros_like(p)`` in ``torch/optim/adamw.py``)."""
    if ts.method != "full":
        # PEFT keeps the adapters fp32 (autocast_adapter_dtype); LitGPT converts them with the model
        return DTYPE_BYTES[ts.dtype] if ts.model_code == "litgpt" else 4
    return int(ms.dense_bits // 8)


def master_weight_bytes(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """An fp32 master copy of the trainable parameters, when the weights are stored in half
    precision, trained in full, and ``mixed_precision`` asks for fp32 masters (Micikevicius et al.
    2018, "Mixed Precision Training", sec. 3.1; accelerate/DeepSpeed/FSDP bf16 with fp32 masters).
    HF ``Trainer`` with ``bf16=True`` on fp32 weights keeps no extra copy (the fp32 weights are the
    masters); see ``weight_copy_bytes`` for its autocast copies."""
    if ts.method == "full" and ts.mixed_precision and ms.dense_bits < 32:
        return 4 * trainable
    return 0


def weight_copy_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """Autocast half-precision copies of the linear weights (fp32 weights, ``mixed_precision`` with
    a half compute dtype). ``torch.autocast`` casts every ``linear``/``matmul`` weight to the half
    dtype; casts of leaf tensors that require grad are cached until the autocast region exits
    (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``), and each cast copy of a weight in a block
    the backward passes through is saved by the matmul for grad-input. So: 2 bytes x the linear
    weights of those blocks, plus the head (the tied embedding when tied)."""
    if not (ts.mixed_precision and ms.dense_bits >= 32 and DTYPE_BYTES[ts.dtype] < 4):
        return 0
    lin = sum(ls.params for ls in block_linear_shapes(ms) if ls.kind != "experts")
    exp = sum(ls.params for ls in block_linear_shapes(ms) if ls.kind == "experts")
    if ms.is_moe and ms.num_experts:
        exp = exp * min(ms.num_experts_per_tok * 4, ms.num_experts) // ms.num_experts
    head = ms.vocab_size * ms.hidden_size
    return 2 * ((lin + exp) * grad_layers(ms, ts) + head)
