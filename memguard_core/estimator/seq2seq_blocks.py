"""Encoder-decoder models (T5 / mT5, BART): what each encoder block saves over the source tokens, each
decoder block over the target tokens (self-attention, then cross-attention whose keys and values read
the encoder's output), what the two stacks keep outside their blocks, the loss's bytes per logit
over the target tokens, and the decoder's LoRA adapters. Called by ``activations.activation_bytes``,
``logits`` and ``estimate``. docs/estimator.md, "Encoder-decoder models".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .attention import attention_core, dropout_bytes
from .encoder_blocks import encoder_block_act, output_copied
from .lora_inputs import lora_input_bytes
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec
from .trainable import lora_linears

__all__ = ["is_seq2seq", "stack_activation_bytes", "block_bytes_per_row", "outside_bytes", "loss_bytes_per_logit",
           "decoder_lora_params"]

#: Names of the attention linears: T5 (``modeling_t5.py`` ``T5Attention``) and BART (``BartAttention``).
_QUERY, _KEYS, _OUT = ("q", "q_proj"), ("k", "v", "k_proj", "v_proj"), ("o", "out_proj")
#: The module of a decoder block's cross-attention: T5 ``T5LayerCrossAttention.EncDecAttention``,
#: BART ``BartDecoderLayer.encoder_attn``.
_CROSS = ("EncDecAttention", "encoder_attn")
#: The feed-forward's output linear: T5 ``wo``, BART ``fc2``; every other FFN linear reads the norm.
_FFN_OUT = ("wo", "fc2")


@dataclass
class _Row:
    """Bytes per row (batch element), split as ``activations._Act`` splits them."""

    hidden: float = 0.0
    scores: float = 0.0
    lora: float = 0.0


def is_seq2seq(ms: ModelSpec) -> bool:
    """An encoder-decoder spec (``ModelSpec.decoder_layers`` > 0) of a family this module counts."""
    return ms.decoder_layers > 0


def _t5(ms: ModelSpec) -> bool:
    return ms.model_type in ("t5", "mt5")


def _amp(ms: ModelSpec, ts: TrainSpec) -> bool:
    return bool(ts.mixed_precision and ms.dense_bits >= 32 and DTYPE_BYTES[ts.dtype] < 4)


def _is_cross(ls) -> bool:
    return any(c in (ls.path or ls.name).split(".") for c in _CROSS)


def _saved_input(ms: ModelSpec, ts: TrainSpec, group: list, lora: set, trainable: bool, fin: int) -> float:
    """Bytes per token that ``group`` (linears reading one tensor of ``fin`` features) save of it:
    a trained weight's input once (``derivatives.yaml`` ``mm``), or, under autocast, a bf16 copy per
    linear (``autocast_mode.h`` caches only weight casts); LoRA'd frozen linears as
    ``lora_inputs.lora_input_bytes`` says; nothing for frozen linears without LoRA."""
    e, amp = DTYPE_BYTES[ts.dtype], _amp(ms, ts)
    if not group:
        return 0.0
    if trainable:
        return 2.0 * fin * len(group) if amp else float(e * fin)
    n = sum(1 for ls in group if ls in lora)
    return lora_input_bytes(ts, n, fin, e, amp) if n else 0.0


def _t5_path(ms: ModelSpec, ts: TrainSpec, *, cross: bool, trainable: bool) -> str:
    """The kernel a T5 attention runs on CPU: ``eager``; SDPA's ``math`` path, which its
    ``check_for_dropout`` takes with attention dropout, and which a float mask that needs a
    gradient forces (the self-attention's relative position bias when it trains; the
    cross-attention's zero bias, which ``T5Attention.forward`` marks ``requires_grad`` under
    activation checkpointing); else the CPU ``flash`` kernel, the self-attention's bias passed as
    its float mask (transformers ``sdpa_attention.py`` ``create_position_bias_mask``)."""
    if ts.attn_impl == "eager":
        return "eager"
    if ms.attention_dropout > 0 or (trainable if not cross else ts.grad_checkpoint):
        return "math"
    return "flash"


def _core(ms: ModelSpec, ts: TrainSpec, n: int, m: int, *, cross: bool = False,
          trainable: bool = True) -> Tuple[float, float, bool]:
    """(hidden, scores, copied): bytes per row that one attention core saves for ``n`` queries
    over ``m`` keys, its output included, and whether the out projection reads a copy of that
    output (True) or the fused kernel's own tensor (counted here).

    T5 (``T5Attention``, :func:`_t5_path`): eager saves q, k^T, v, the softmax output and, with
    dropout, its noise and the dropped probabilities in the compute dtype e; SDPA's math path
    (``_scaled_dot_product_attention_math``) the same upcast to fp32; the CPU flash kernel q, k, v,
    its output (e) and an fp32 logsumexp per head. BART (``BartAttention``): as
    ``attention.attention_core`` counts an SDPA / eager core, the key and value over the ``m`` keys.
    """
    e = DTYPE_BYTES[ts.dtype]
    nh, qd = ms.num_heads, ms.num_heads * ms.head_dim
    if _t5(ms):
        path = _t5_path(ms, ts, cross=cross, trainable=trainable)
        if path == "flash":
            return e * qd * (2 * n + 2 * m), 4.0 * nh * n, False
        b = e if path == "eager" else 4
        per_score = b + (b + dropout_bytes(ts, b) if ms.attention_dropout > 0 else 0)
        return b * qd * (n + 2 * m), float(nh * n * m * per_score), True
    km = ts.replace(seq_length=m)
    with_qkv, core_s = attention_core(ms, km, e, views_of_one_buffer=True)
    rest, _ = attention_core(ms, km, e, views_of_one_buffer=False)
    qkv = with_qkv - rest                       # q, k, v as the kernel takes them (fused / eager)
    hidden = qkv / 3 * n + qkv * 2 / 3 * m
    if rest > e * qd:                           # the math path's fp32 copies of q, k and v
        hidden += rest / 3 * n + rest * 2 / 3 * m
    else:                                       # a fused kernel's output
        hidden += rest * n
    return hidden, core_s * n, output_copied(ms, ts)


def _bias_masks(ms: ModelSpec, ts: TrainSpec, trainable: bool) -> int:
    """Bytes per micro-batch (not per row) that T5's self-attentions save on the CPU flash kernel:
    each block's float mask holding the relative position bias, ``(1, heads, n, n)`` in the bias's
    dtype (n: the stack's tokens), which the kernel keeps for its backward; 0 for BART and on the
    other paths."""
    if not _t5(ms) or _t5_path(ms, ts, cross=False, trainable=trainable) != "flash":
        return 0
    b = 4 if _amp(ms, ts) else DTYPE_BYTES[ts.dtype]
    S, T = ts.seq_length, ts.decoder_tokens
    return int(b * ms.num_heads * (ms.num_layers * S * S + ms.decoder_layers * T * T))


def _norm(ms: ModelSpec, ts: TrainSpec, trainable: bool) -> float:
    """Bytes per token one norm saves, its output apart (the linears that read it save that).

    T5 (``T5LayerNorm``: ``hidden_states.to(torch.float32).pow(2).mean(-1)``, ``hidden_states *
    torch.rsqrt(variance + eps)``, ``.to(weight.dtype)`` for a half weight, ``weight * hidden``):
    the fp32 input (the residual itself in fp32, a copy of a half one, which ``mul`` also keeps),
    the per-token fp32 rsqrt, and, when the weight trains, the normalised tensor (e; fp32 under
    autocast). BART (``nn.LayerNorm``, ``native_layer_norm``): the input (r) and per-token mean and
    rstd (r on CPU, fp32 on CUDA)."""
    e, amp = DTYPE_BYTES[ts.dtype], _amp(ms, ts)
    r, h = (4 if amp else e), ms.hidden_size
    if _t5(ms):
        return 4.0 * h + 4 + (e * h if e < 4 and not amp else 0) + (r * h if trainable else 0)
    stat = 4 if ts.device == "cuda" else r
    return float(r * h + 2 * stat)


def _ffn(ms: ModelSpec, ts: TrainSpec, lins: list, lora: set, trainable: bool) -> float:
    """Bytes per token the feed-forward network saves, from the norm's output to its output.

    T5 ``T5DenseActDense`` (``wi``, act, dropout, ``wo``) / ``T5DenseGatedActDense`` (``act(wi_0(x))
    * wi_1(x)``, dropout, ``wo``); BART ``fc1``, ``activation_fn``, activation dropout, ``fc2``. The
    activation saves (``derivatives.yaml``): ``relu`` its result, exact ``gelu`` and ``silu`` their
    input, ``gelu_new`` (``NewGELUActivation`` in Python) four tensors (x, tanh(.), 0.5 x, 1 +
    tanh); a gated product saves both operands (the activation's output a new tensor unless it is
    ``relu``'s saved result); a dropout (p > 0) its noise (``attention.dropout_bytes``); the output
    linear, when it saves, its input (the dropped tensor, or the product / activation output)."""
    e, h, i = DTYPE_BYTES[ts.dtype], ms.hidden_size, ms.intermediate_size
    ins = [ls for ls in lins if ls.name not in _FFN_OUT]
    outs = [ls for ls in lins if ls.name in _FFN_OUT]
    gated = len(ins) > 1
    act = ms.ffn_act or ("relu" if _t5(ms) else "gelu")
    p = ms.ffn_dropout
    out = _saved_input(ms, ts, ins, lora, trainable, h)
    out += (4 if act == "gelu_new" else 1) * e * i
    if gated:
        out += e * i * (2 if act != "relu" else 1)            # the product's operands
    if p > 0:
        out += dropout_bytes(ts, e) * i
    fresh = p > 0 or gated or act != "relu"                   # wo's input is a tensor of its own
    if fresh:
        out += _saved_input(ms, ts, outs, lora, trainable, i)
    elif not trainable and (e < 4 or _amp(ms, ts) or ts.lora_dropout > 0):
        out += _saved_input(ms, ts, outs, lora, trainable, i)  # a LoRA'd wo's own copy of relu's result
    return out


def block_bytes_per_row(ms: ModelSpec, ts: TrainSpec, *, decoder: bool, trainable: bool) -> _Row:
    """What ONE encoder block (``decoder`` False: over the source tokens, ``ts.seq_length``) or
    decoder block (over the target tokens, ``ts.decoder_tokens``, cross-attending the source) saves
    for its backward, bytes per row. ``trainable``: a full fine-tune's block (every weight trains);
    else its LoRA'd linears (``ts.lora_targets`` matched to the stack's linears) save what PEFT's
    adapters need.

    T5 (``modeling_t5.py`` ``T5Block``: ``T5LayerSelfAttention`` -> [``T5LayerCrossAttention``] ->
    ``T5LayerFF``, each ``x + dropout(sublayer(T5LayerNorm(x)))``, pre-norm, no attention scaling,
    the relative position bias added to the scores) and BART decoder blocks (``BartDecoderLayer``:
    post-LN, self-attention, cross-attention, GELU FFN, a residual dropout after each) are counted
    here tensor by tensor (:func:`_norm`, :func:`_core`, :func:`_ffn`); a BART encoder block is
    BERT's (``encoder_blocks.encoder_block_act``). The cross-attention's keys and values read the
    encoder's output: the tensor itself is kept once for all decoder blocks (:func:`outside_bytes`);
    a block adds the copies a LoRA'd or autocast linear makes of it. LoRA's ``lora_A`` outputs
    (``r`` per token per LoRA'd linear, fp32; the compute dtype under autocast) are the ``lora``
    part.
    """
    e, amp = DTYPE_BYTES[ts.dtype], _amp(ms, ts)
    h, qd = ms.hidden_size, ms.num_heads * ms.head_dim
    S, T = ts.seq_length, ts.decoder_tokens
    n = T if decoder else S
    lins = list(ms.decoder_block_linears if decoder else ms.block_linears)
    lora = set() if trainable else set(lora_linears(ms.replace(block_linears=tuple(lins)), ts))
    row = _Row()
    for ls in lora:
        row.lora += ls.count * ts.lora_rank * (2 if amp else 4) * (S if (_is_cross(ls) and ls.name in _KEYS) else n)
    if not decoder and not _t5(ms):                            # BART's encoder block: BERT's rule
        a = encoder_block_act(ms.replace(block_linears=tuple(lins)), ts, _Row(), {ls.name for ls in lora},
                              trainable, e, 4 if amp else e, amp)
        if ms.ffn_dropout > 0:                                 # activation_dropout's noise (BERT has none);
            a.hidden += dropout_bytes(ts, e) * ms.intermediate_size  # fc2 saves its output in GELU's place
        row.hidden += a.hidden * S
        row.scores += a.scores * S
        return row
    attn = [ls for ls in lins if ls.name in _QUERY + _KEYS + _OUT]
    self_attn = [ls for ls in attn if not _is_cross(ls)]
    cross = [ls for ls in attn if _is_cross(ls)]
    ffn = [ls for ls in lins if ls not in attn]
    resid = dropout_bytes(ts, e) * h if ms.residual_dropout > 0 else 0
    t5 = _t5(ms)
    per_token = 0.0
    # self-attention
    per_token += _norm(ms, ts, trainable) if t5 else 0.0
    per_token += _saved_input(ms, ts, [ls for ls in self_attn if ls.name not in _OUT], lora, trainable, h)
    core_h, core_s, copied = _core(ms, ts, n, n, trainable=trainable)
    row.hidden += core_h
    row.scores += core_s
    # the out projection's input: a copy of the core's output (eager, the math path), or the fused
    # kernel's own output, counted in the core, which trained or fp32-LoRA'd linears save as is
    as_is = trainable or (not amp and e == 4 and ts.lora_dropout == 0)

    def out_input(group: list, copied: bool) -> float:
        return _saved_input(ms, ts, group, lora, trainable, qd) if (copied or not as_is) else 0.0

    per_token += out_input([ls for ls in self_attn if ls.name in _OUT], copied)
    per_token += resid + (0.0 if t5 else _norm(ms, ts, trainable))
    if decoder:
        per_token += _norm(ms, ts, trainable) if t5 else 0.0
        per_token += _saved_input(ms, ts, [ls for ls in cross if ls.name in _QUERY], lora, trainable, h)
        kv = [ls for ls in cross if ls.name in _KEYS]
        # the encoder's output: kept once (outside_bytes) unless each linear saves a copy of its own
        if amp or (not trainable and (e < 4 or ts.lora_dropout > 0)):
            row.hidden += _saved_input(ms, ts, kv, lora, trainable, h) * S
        core_h, core_s, copied = _core(ms, ts, n, S, cross=True, trainable=trainable)
        row.hidden += core_h
        row.scores += core_s
        per_token += out_input([ls for ls in cross if ls.name in _OUT], copied)
        per_token += resid + (0.0 if t5 else _norm(ms, ts, trainable))
    per_token += _norm(ms, ts, trainable) if t5 else 0.0
    per_token += _ffn(ms, ts, ffn, lora, trainable)
    per_token += resid + (0.0 if t5 else _norm(ms, ts, trainable))
    row.hidden += per_token * n
    return row


def _encoder_output_kept(ms: ModelSpec, ts: TrainSpec) -> bool:
    """Whether the cross-attention's key / value linears save the encoder's output itself: trained,
    or LoRA'd reading it as it is (fp32, no LoRA dropout); not under autocast, where each saves a
    bf16 copy of its own (counted per block)."""
    if _amp(ms, ts):
        return False
    if ts.method == "full":
        return True
    if DTYPE_BYTES[ts.dtype] < 4 or ts.lora_dropout > 0:
        return False
    kv = [ls for ls in lora_linears(ms.replace(block_linears=tuple(ms.decoder_block_linears)), ts)
          if _is_cross(ls) and ls.name in _KEYS]
    return bool(kv)


def stack_activation_bytes(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int, int, int]:
    """``activations.activation_bytes`` for an encoder-decoder: (hidden, scores, lora, one block's
    working set), bytes for the micro-batch. Every block the backward passes through keeps what
    :func:`block_bytes_per_row` counts (a full fine-tune's trained blocks; under LoRA the LoRA'd
    blocks of both stacks: ``lora_layers`` is not applied to an encoder-decoder). With activation
    checkpointing (transformers' ``GradientCheckpointingLayer``: one checkpoint per ``T5Block`` /
    ``Bart*Layer``) each block keeps its input (e x h per token of its stack, fp32 under autocast)
    and one block, the larger of the two kinds, is recomputed during the backward. T5's flash-kernel
    bias masks (:func:`_bias_masks`, per micro-batch) are part of the blocks' hidden bytes."""
    B = ts.batch_size
    full = ts.method == "full"
    enc = block_bytes_per_row(ms, ts, decoder=False, trainable=full)
    dec = block_bytes_per_row(ms, ts, decoder=True, trainable=full)
    one = int(B * max(enc.hidden + enc.scores + enc.lora, dec.hidden + dec.scores + dec.lora))
    if ts.grad_checkpoint:
        r = 4 if _amp(ms, ts) else DTYPE_BYTES[ts.dtype]
        per = r * ms.hidden_size * (ms.num_layers * ts.seq_length + ms.decoder_layers * ts.decoder_tokens)
        return int(B * per), 0, 0, one
    L, D = ms.num_layers, ms.decoder_layers
    masks = _bias_masks(ms, ts, full)
    return (int(B * (L * enc.hidden + D * dec.hidden) + masks), int(B * (L * enc.scores + D * dec.scores)),
            int(B * (L * enc.lora + D * dec.lora)), one)


def outside_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """What the two stacks save outside their blocks, bytes for the micro-batch (S source, T target
    tokens per row):

    * the encoder's output, kept for every decoder block's cross-attention (e x h x S), when the
      key / value linears save it (:func:`_encoder_output_kept`);
    * T5 (``T5Stack.forward``): per stack the embedding dropout's noise, the final
      ``T5LayerNorm`` (:func:`_norm`) and the final dropout's noise; the decoder's output, which
      ``lm_head`` saves when it trains (``T5ForConditionalGeneration.forward`` scales it by
      ``d_model ** -0.5`` first when the head is tied: a new tensor); with the relative position
      bias trained, its two embeddings' int64 bucket indices (S x S and T x T, per micro-batch);
    * BART (``BartEncoder`` / ``BartDecoder``): per stack ``layernorm_embedding`` (input and
      stats) and the embedding dropout's noise; the decoder's last LayerNorm output that
      ``lm_head`` saves when it trains.
    """
    e, amp = DTYPE_BYTES[ts.dtype], _amp(ms, ts)
    h, B = ms.hidden_size, ts.batch_size
    S, T = ts.seq_length, ts.decoder_tokens
    full = ts.method == "full"
    drop = dropout_bytes(ts, e) * h if ms.residual_dropout > 0 else 0
    per_token = drop + _norm(ms, ts, full) + (drop if _t5(ms) else 0)   # each stack's ends
    out = B * (S + T) * per_token
    if _encoder_output_kept(ms, ts):
        out += B * S * (4 if amp else e) * h
    if full:
        out += B * T * (2 if amp else e) * h                   # lm_head's input
        if _t5(ms):
            out += 8 * (S * S + T * T)                         # relative-position bucket indices
    return int(out)


def loss_bytes_per_logit(ms: ModelSpec, ts: TrainSpec) -> int:
    """The loss moment's bytes per logit over the target tokens (B x T x vocab logits:
    ``logits.logits_elements``).

    ``T5ForConditionalGeneration`` / ``BartForConditionalGeneration`` take ``CrossEntropyLoss`` on
    the logits as the head returns them (no ``.float()``; BART adds ``final_logits_bias`` first, a
    new logits tensor while ``lm_head``'s output is freed): forward, the logits and the
    ``log_softmax`` output; backward start, that output, ``nll_loss``'s gradient and
    ``log_softmax``'s, all in the logits' dtype: 3 x e per logit. fp32, and autocast (whose
    ``log_softmax`` runs in fp32 on a cast copy), as ``logits.logits_bytes`` counts an LM head:
    12 per logit; mlx_lm: 3 x e."""
    e = DTYPE_BYTES[ts.dtype]
    if ts.framework == "mlx":
        return 3 * e
    return 12 if (e == 4 or _amp(ms, ts)) else 3 * e


def decoder_lora_params(ms: ModelSpec, ts: TrainSpec) -> int:
    """Elements of the LoRA adapters on the decoder's blocks: ``r * (in + out)`` per LoRA'd linear
    of ``ms.decoder_block_linears`` (Hu et al. 2021, "LoRA", sec. 4.1; PEFT ``lora.Linear``) times
    ``ms.decoder_layers``; the encoder's are counted by ``trainable.lora_trainable_params``."""
    dec = lora_linears(ms.replace(block_linears=tuple(ms.decoder_block_linears)), ts)
    return ms.decoder_layers * sum(ls.count * ts.lora_rank * (ls.in_features + ls.out_features) for ls in dec)
