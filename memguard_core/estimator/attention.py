"""The attention term: what the attention core (SDPA kernels, the math path, eager) and dropout save
per token. docs/estimator.md, "Dropout and the attention kernel".
"""

from __future__ import annotations

from typing import Tuple

from .cuda import CUDA_EFFICIENT_LSE_PAD, cuda_sdpa_backend
from .mps import mps_sdpa_math
from .specs import ModelSpec, TrainSpec


def dropout_bytes(ts: TrainSpec, e: int) -> int:
    """Bytes per element a training-mode ``F.dropout`` saves: on CPU ``_dropout_impl`` computes
    ``input * noise`` and ``mul`` saves the noise, in the input's dtype; on CUDA the fused
    ``native_dropout`` saves a 1-byte bool mask (``aten/src/ATen/native/Dropout.cpp``
    ``is_fused_kernel_acceptable`` takes the fused kernel only for CUDA/XPU/lazy tensors, so
    ``mps`` saves the noise as the CPU does)."""
    return e if ts.device in ("cpu", "mps") else 1


def sdpa_lse_per_token(ms: ModelSpec, ts: TrainSpec, backend: str) -> float:
    """Bytes per token of the fp32 logsumexp the fused SDPA kernels save: heads x 4, padded to a
    multiple of ``CUDA_EFFICIENT_LSE_PAD`` queries for the memory-efficient kernel."""
    nh, s = ms.num_heads, ts.seq_length
    if backend == "efficient":
        padded = -(-s // CUDA_EFFICIENT_LSE_PAD) * CUDA_EFFICIENT_LSE_PAD
        return 4.0 * nh * padded / s
    return 4.0 * nh


def attention_core(ms: ModelSpec, ts: TrainSpec, e: int, *, views_of_one_buffer: bool) -> Tuple[float, float]:
    """(hidden-sized, score-sized) bytes per token that the attention core saves, from q/k/v to
    its output, for ``scaled_dot_product_attention`` or the eager matmul-softmax-matmul.

    SDPA on CPU (torch ``sdp_utils_cpp.cpp`` ``use_flash_attention_cpp``): the flash kernel unless
    the attention dropout is > 0 in training (``check_for_dropout``); it saves q, k, v as passed
    (views of one fused c_attn buffer keep the whole buffer), its output (e) and an fp32
    logsumexp per head. The math path (``_scaled_dot_product_attention_math``) upcasts half inputs
    to fp32 and saves the scaled q and k^T and a contiguous fp32 v (GQA: repeated to every head),
    the softmax output, the dropout noise and the dropped probabilities, all fp32: 12 bytes per
    score (9 on CUDA, where the dropout mask is 1 byte). Eager (``eager_attention_forward``): q, k,
    v, the softmax output and, with dropout, the noise and the dropped probabilities, in e.
    """
    s, nh = ts.seq_length, ms.num_heads
    qd, kvd = nh * ms.head_dim, ms.num_kv_heads * ms.head_dim
    drop = ms.attention_dropout > 0
    qkv = e * (qd + 2 * kvd) if views_of_one_buffer else 0.0
    if ts.attn_impl == "eager":
        # with dropout: CPU saves the noise in e (``_dropout_impl``), CUDA a 1-byte mask
        per_score = e + ((e + dropout_bytes(ts, e)) if drop else 0)
        return qkv, nh * s * per_score
    if ts.device == "cuda":
        backend = cuda_sdpa_backend(ms, ts)
        if backend == "math":
            # fp32 probabilities, and with dropout the 1-byte ``native_dropout`` mask and the dropped
            # probabilities (fp32)
            per_score = 4 + ((1 + 4) if drop else 0)
            return 4.0 * 3 * qd, nh * s * per_score
        return qkv + e * qd, sdpa_lse_per_token(ms, ts, backend)
    if ts.attn_impl == "sdpa" and (drop or mps_sdpa_math(ts)):
        per_score = 4 + (4 + 4 if drop else 0)  # fp32 probabilities (+ noise and dropped ones)
        return 4.0 * 3 * qd, nh * s * per_score
    return qkv + e * qd, 4.0 * nh
