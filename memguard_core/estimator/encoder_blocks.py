"""Encoder blocks: what one post-LN GELU encoder block (BERT, RoBERTa, DistilBERT, DeBERTa-v2) saves
for its backward, per token. Called by :func:`memguard_core.estimator.activations.block_act_per_token`.
docs/estimator.md, "Encoder blocks".
"""

from __future__ import annotations

from typing import Any

from .attention import attention_core, dropout_bytes
from .cuda import cuda_sdpa_backend
from .heads import head_of
from .lora_inputs import lora_input_bytes
from .mps import mps_sdpa_math
from .specs import ModelSpec, TrainSpec
from .trainable import block_linear_shapes, lora_linears

__all__ = ["is_post_norm_encoder", "encoder_block_act", "encoder_reads_norm", "relative_positions", "output_copied"]

#: Residual dropouts per block where a family's block has other than BERT's two (``BertSelfOutput``
#: and ``BertOutput`` each drop their dense's output): DistilBERT drops only the FFN's output
#: (``modeling_distilbert.py`` ``FFN.ff_chunk``; ``TransformerBlock`` adds the attention's output as is).
_RESIDUAL_DROPOUTS = {"distilbert": 1}
#: Families whose self-attention is DeBERTa's disentangled attention (``modeling_deberta_v2.py``
#: ``DisentangledSelfAttention``), which no SDPA kernel runs.
_DISENTANGLED = ("deberta-v2",)
#: Output projections of the attention, by module name (BERT / RoBERTa / DeBERTa-v2 ``attention.output.dense``,
#: DistilBERT ``out_lin``).
_ATTN_OUT = ("dense", "out_lin", "out_proj", "o_proj")


def is_post_norm_encoder(ms: ModelSpec) -> bool:
    """True for an encoder whose blocks end in their own LayerNorm (post-LN: BERT, RoBERTa,
    DistilBERT, DeBERTa-v2, ELECTRA, XLM-R): the task head reads a base model with no final norm
    outside its blocks (:attr:`memguard_core.estimator.heads.TaskHead.final_norm` False, read from the
    module tree by ``memguard_torch.task_head``), on a dense model with one key / value head per
    query head. A causal LM (the default head, also a spec from plain numbers) is never one."""
    head = head_of(ms)
    return (not head.final_norm and head.kind != "causal_lm" and not ms.is_moe
            and ms.num_kv_heads == ms.num_heads)


def encoder_reads_norm(ms: ModelSpec, ls: Any) -> bool:
    """Whether the block linear ``ls`` (a :class:`memguard_core.estimator.specs.LinearShape`) of a
    post-LN encoder reads a LayerNorm's output (fp32 under autocast: the query / key / value
    projections read the last block's, the FFN's first linear this block's first) rather than a
    product in the compute dtype (the attention's output projection, the FFN's second linear)."""
    if ls.kind == "attention":
        return ls.name not in _ATTN_OUT
    return ls.in_features == ms.hidden_size


def _output_copied(ms: ModelSpec, ts: TrainSpec) -> bool:
    """Whether the attention's output reaches the out projection as a new tensor: eager's and SDPA's
    math path's ``(batch, heads, seq, head_dim)`` product goes through ``transpose(1, 2).contiguous()``
    (transformers ``sdpa_attention_forward`` / ``eager_attention_forward``), a copy; the fused
    kernels (CPU flash, CUDA flash / memory-efficient / cuDNN) write ``(batch, seq, heads, head_dim)``
    already, so the transpose is contiguous and the out projection saves the kernel's own output."""
    if ts.attn_impl == "eager" or ms.model_type in _DISENTANGLED:
        return True
    if ts.device == "cuda":
        return cuda_sdpa_backend(ms, ts) == "math"
    return ts.attn_impl == "sdpa" and (ms.attention_dropout > 0 or mps_sdpa_math(ts))


def encoder_block_act(ms: ModelSpec, ts: TrainSpec, a: Any, lora_names: set, trainable_block: bool,
                      e: int, r: int, amp: bool) -> Any:
    """Adds to ``a`` (an ``activations._Act``: bytes per token) what one post-LN encoder block saves
    for its backward, tensor by tensor, and returns it. ``e``: compute-dtype bytes; ``r``: the
    residual stream's (fp32 under autocast, whose ``layer_norm`` runs in fp32); ``amp``: autocast
    on fp32 weights; ``lora_names``: the block's LoRA'd linears; ``trainable_block``: a full
    fine-tune's block (every weight trains) rather than a LoRA'd frozen one.

    transformers 5 ``modeling_bert.py`` (``BertLayer``: ``BertSelfAttention`` -> ``BertSelfOutput``
    dense, dropout, ``LayerNorm(x + input)`` -> ``BertIntermediate`` dense, GELU -> ``BertOutput``
    dense, dropout, ``LayerNorm(x + attention_output)``; RoBERTa's blocks are BERT's), with
    ``derivatives.yaml``'s saved tensors:

    * a linear saves its input when its weight trains or LoRA wraps it (``lora_A`` needs it; a
      frozen weight's input gradient needs only the weight): the block input once for query, key
      and value (a bf16 autocast copy per linear under autocast: ``autocast_mode.h`` caches only
      weight casts), the attention output, the first LayerNorm's output, the GELU's output; a
      LoRA'd frozen one as ``lora_inputs.lora_input_bytes`` says (PEFT's fp32 / autocast copies,
      the LoRA dropout);
    * the attention core as ``attention.attention_core`` counts it (SDPA's CPU flash kernel with no
      attention dropout; its math path with one; eager: probabilities in e, and with dropout the
      noise and the dropped ones); the out projection's input is a contiguous copy of the
      product for eager / the math path, the kernel's own output otherwise (:func:`_output_copied`);
      DeBERTa-v2's disentangled attention by :func:`_disentangled_attention`;
    * exact GELU (``ACT2FN["gelu"]``, ``gelu`` in ``derivatives.yaml``) saves its input (e x i);
    * a residual dropout (``hidden_dropout_prob`` > 0) saves its noise, in e on CPU / mps, a 1-byte
      mask on CUDA (``attention.dropout_bytes``): two per block, one for DistilBERT
      (:data:`_RESIDUAL_DROPOUTS`);
    * ``native_layer_norm`` saves its input (the residual sum, r x h) and per-token mean and rstd
      (fp32 on CUDA, r on CPU); its weight's gradient is computed from them, so no normalised copy.

    A LoRA'd frozen block saves the same tensors but the linears' inputs (every op's input there
    requires grad) above the lowest LoRA'd block; that one, whose key needs no gradient, saves a
    little less (one q-sized tensor), counted alike. ``lora_names`` only says whether the block is
    LoRA'd: the LoRA'd linears are matched by shape and path (``lora_linears``). Checked against
    ``memguard_torch.saved_census.saved_bytes_per_block`` on real blocks: tests/test_encoder_blocks.py.
    """
    h, i = ms.hidden_size, ms.intermediate_size
    qd = ms.num_heads * ms.head_dim
    lins = [ls for ls in block_linear_shapes(ms) if not ls.name.startswith("pos_")]
    attn = [ls for ls in lins if ls.kind == "attention"]
    out = [ls for ls in attn if ls.name in _ATTN_OUT][-1:]
    qkv = [ls for ls in attn if ls not in out]
    mlp_in = [ls for ls in lins if ls.kind != "attention" and ls.in_features == h]
    mlp_out = [ls for ls in lins if ls.kind != "attention" and ls.in_features != h]
    # by shape and path, not name: BERT's three ``dense`` linears share one
    lora = set(lora_linears(ms, ts)) if lora_names else set()
    copied = _output_copied(ms, ts)
    # the frozen fp32 linears' adapters read the block's own tensor (no PEFT copy, no LoRA dropout)
    shared = not amp and e == 4 and ts.lora_dropout == 0

    def saved_input(group: list, fin: int, own: bool, cast: bool) -> float:
        """Input bytes (per token) that a group of linears reading one tensor of ``fin`` features
        saves beyond what the block saves anyway. ``own``: the tensor is saved for them only (else
        the attention core holds it); ``cast``: it is fp32 under autocast (a LayerNorm's output),
        so each trained linear saves its own bf16 copy."""
        if trainable_block:
            if not group:
                return 0.0
            if amp and cast:
                return 2.0 * fin * len(group)
            return float(e * fin) if own else 0.0
        n = sum(1 for ls in group if ls in lora)
        if not n or (shared and not own):
            return 0.0                          # none LoRA'd, or lora_A saves the core's own output
        return lora_input_bytes(ts, n, fin, e, amp)

    a.hidden += saved_input(qkv, h, True, True)             # block input (the last LayerNorm's output)
    if ms.model_type in _DISENTANGLED:
        _disentangled_attention(ms, ts, a, e)
    else:
        # q, k and v are three linears' outputs here, not views of one fused buffer, but the kernels
        # save the same bytes: e x 3 x qd (the math path its own fp32 copies, counted either way)
        core_h, core_s = attention_core(ms, ts, e, views_of_one_buffer=True)
        a.hidden += core_h                                  # q, k, v (or the math path's copies), output
        a.scores += core_s
    a.hidden += saved_input(out, qd, copied, False)         # attention output: a copy, or the kernel's
    drop = dropout_bytes(ts, e) * h if ms.residual_dropout > 0 else 0
    a.hidden += drop * _RESIDUAL_DROPOUTS.get(ms.model_type, 2)
    stat = 4 if ts.device == "cuda" else r                  # LayerNorm mean and rstd, per token
    a.hidden += 2 * (r * h + 2 * stat)                      # two LayerNorms: input (residual sum), stats
    a.hidden += saved_input(mlp_in, h, True, True)          # the first LayerNorm's output
    a.hidden += e * i                                       # GELU's input
    a.hidden += saved_input(mlp_out, i, True, False)        # GELU's output
    return a


def relative_positions(ms: ModelSpec) -> int:
    """``2 x att_span`` of a DeBERTa-v2 block (``modeling_deberta_v2.py``
    ``DisentangledSelfAttention.pos_ebd_size`` x 2), the relative positions each query scores: the
    model's ``max_position_embeddings`` (512 when unknown). The spec does not carry the config's
    ``position_buckets``; the released checkpoints (deberta-v2-xlarge, deberta-v3-*,
    mdeberta-v3-base) set 256 buckets on 512 positions, so the two agree there; a config with other
    buckets, or without ``relative_attention``, is not counted right (docs/estimator.md, "Encoder
    blocks")."""
    return int(ms.max_position_embeddings or 512)


def output_copied(ms: ModelSpec, ts: TrainSpec) -> bool:
    """Whether the attention's output reaches the out projection as a new tensor (a contiguous copy:
    eager, SDPA's math path) rather than the fused kernel's own output; the rule of
    :func:`encoder_block_act`, for the encoder-decoder blocks (``seq2seq_blocks``)."""
    return _output_copied(ms, ts)


def _disentangled_attention(ms: ModelSpec, ts: TrainSpec, a: Any, e: int) -> None:
    """Adds to ``a`` what DeBERTa-v2's ``DisentangledSelfAttention`` saves per token
    (``modeling_deberta_v2.py``, relative attention with ``pos_att_type`` ``c2p|p2c`` as the
    released checkpoints have it): the eager core (q, k, v, the probabilities, with dropout its
    noise and the dropped ones; ``attention.attention_core``) and

    * the key a second time: ``bmm(query, key^T / scale)`` saves the scaled key, the p2c
      ``bmm(key, pos_query^T)`` the key itself (e x qd);
    * the c2p and p2c products ``bmm`` returns before ``torch.gather`` picks the relative
      positions: ``gather`` saves its input (``derivatives.yaml`` ``gather_backward``), heads x
      ``2 x att_span`` per token each (:func:`relative_positions`);
    * the position keys and queries ``.repeat``-ed for every row, ``(batch x heads, 2 x att_span,
      head_dim)`` each, that the two ``bmm`` save: ``2 x att_span x qd / seq`` per token each;
    * ``masked_fill``'s bool mask, ``(batch, 1, seq, seq)``: seq bytes per token;
    * per block what the rows share, spread over the micro-batch's tokens: the two int64 gather
      indices (expanded views of one ``seq x seq`` tensor) and, with a dropout, the block's dropped
      relative embeddings (``2 x att_span x h``, the position projections' input) and its noise;
      without one the projections read the encoder's single tensor (counted in none of the blocks).
      A LoRA run's frozen embeddings save no noise (a slight over-estimate).
    """
    s, h = ts.seq_length, ms.hidden_size
    qd, nh = ms.num_heads * ms.head_dim, ms.num_heads
    span2 = relative_positions(ms)
    core_h, core_s = attention_core(ms, ts.replace(attn_impl="eager"), e, views_of_one_buffer=True)
    a.hidden += core_h + e * qd                     # q, k, v; the key again
    a.scores += core_s + s                          # probabilities (...); the bool mask
    a.hidden += 2 * nh * span2 * e                  # c2p, p2c before the gather
    a.hidden += 2 * span2 * qd * e / s              # position keys and queries, repeated per row
    shared = 2 * 8 * s * s                          # the int64 gather indices
    if ms.residual_dropout > 0:                     # each block's dropped copy of the embeddings, its noise
        shared += span2 * h * (e + dropout_bytes(ts, e))
    a.hidden += shared / (ts.batch_size * s)
