"""Activations of a vision-language model's vision tower and projector when LoRA reaches them.
docs/estimator.md, "Vision-language models: LoRA that reaches the vision tower".
"""

from __future__ import annotations


from .activations import lora_input_bytes
from .trainable import vision_lora_linears
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec


def vision_activation_bytes(ms: ModelSpec, ts: TrainSpec, images: float) -> int:
    """Bytes the vision tower and projector of a vision-language model save for the backward when
    LoRA reaches their linears (``vision_lora_linears``: ``all-linear``, or names PEFT's suffix rule
    matches there), for ``images`` images per row x ``batch_size`` rows; 0 when no vision linear is
    LoRA'd (nothing on the vision side then requires grad), without a ``ModelSpec.vision_tower`` or
    under mlx (no vision-language models there).

    Per patch (``VisionTower.patches_per_image``) and block, with the text blocks' rules
    (``block_act_per_token_modules``): the pre-norms' inputs, the LoRA'd linears' inputs
    (``lora_input_bytes``), the attention's q, k, v, output and logsumexp (or eager's
    probabilities), the MLP activation's inputs; the projector per projector token; one input per
    block under checkpointing. Tensor by tensor, and how it was checked: docs/estimator.md,
    "Vision-language models: LoRA that reaches the vision tower"."""
    vt = ms.vision_tower
    if vt is None or images <= 0 or ts.method == "full" or ts.framework == "mlx":
        return 0
    hits = vision_lora_linears(ms, ts.lora_targets)
    if not hits:
        return 0
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    r = 4 if amp else e
    h, i, nh = vt.hidden_size, vt.intermediate_size, vt.num_heads
    T = vt.patches_per_image
    block_lora = {lin.path for lin, n in hits if lin in vt.block_linears}
    proj_lora = [lin for lin, n in hits if lin in vt.projector_linears]
    ad = 2 if amp else 4  # adapter dtype: fp32 (PEFT autocast_adapter_dtype), the autocast copy under amp

    def group(paths, fin: int) -> float:
        return lora_input_bytes(ts, sum(1 for p in paths if p in block_lora), fin, e, amp)

    per_patch = 0.0   # all blocks together, per patch
    if block_lora:
        norm = 4 * h if vt.norm == "rmsnorm" else r * h
        per = 2 * norm                                    # norm1, norm2 inputs
        names = {lin.path for lin in vt.block_linears}
        fused = "attn.qkv" in names
        per += group(("attn.qkv",) if fused else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), h)
        qkv_kept = e * (5 * h if fused else 3 * h)   # q, k, v; a fused qkv's whole output behind the v view
        if ts.attn_impl == "eager":
            per += qkv_kept + nh * T * (4 + (e if e < 4 else 0))
        else:
            per += qkv_kept + e * h + 4 * nh
        per += group(("attn.proj", "self_attn.out_proj"), h)
        if vt.act == "silu_gated":
            per += group(("mlp.gate_proj", "mlp.up_proj"), h) + 3 * e * i + group(("mlp.down_proj",), i)
        else:
            per += group(("mlp.fc1",), h) + (2 if vt.act == "quick_gelu" else 1) * e * i + group(("mlp.fc2",), i)
        per += sum(ad * ts.lora_rank * lin.count for lin in vt.block_linears if lin.path in block_lora)
        if ts.grad_checkpoint:
            per_patch = vt.num_layers * r * h
        else:
            per_patch = vt.num_layers * per - norm     # block 0's norm1 saves nothing
        per_patch += r * vt.extra_patch_features
        if fused:  # Qwen2-VL's vision RoPE: fp32 cos and sin per patch, built once, saved by every block's mul
            per_patch += 2 * 4 * vt.head_dim
    per_tok = 0.0     # the projector, per projector token
    if block_lora or proj_lora:
        if block_lora and vt.projector_norm:
            per_tok += r * vt.projector_norm
        first = vt.projector_linears[0] if vt.projector_linears else None
        if vt.projector_act and (block_lora or (first is not None and first in proj_lora)):
            per_tok += e * vt.projector_act
        for lin in proj_lora:
            per_tok += lora_input_bytes(ts, 1, lin.in_features, e, amp) + ad * ts.lora_rank
    return int((per_patch * T + per_tok * vt.projector_tokens) * images * ts.batch_size)
