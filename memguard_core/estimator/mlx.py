"""MLX device rules (mlx_lm's lazy graph): saved arrays per block, the backward's one-time working set,
logits and the full fine-tune's update window. Constants fitted on real mlx_lm runs:
docs/estimator.md, "MLX constants".
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

from .gradients import grad_layers
from .trainable import lora_linears, num_lora_layers
from .specs import DTYPE_BYTES, ModelSpec, ParamCounts, TrainSpec
from .weights import trainable_param_bytes


#: LoRA: the backward's one-time window per token (x h, x i elements): fitted, docs/estimator.md#mlx-constants.
MLX_ONE_TIME_H = 16
MLX_ONE_TIME_I = 6
#: Full fine-tune: the same window, and its score-sized arrays: fitted, docs/estimator.md#mlx-constants.
MLX_FULL_ONE_TIME_H = 20
MLX_FULL_ONE_TIME_I = 3
MLX_FULL_BWD_SCORES = 2
#: Vocabulary-sized arrays per token of mlx_lm's ``default_loss``: measured slope, docs/estimator.md#mlx-constants.
MLX_LOGITS_COPIES = 4
#: Hidden-sized arrays per token one ``mx.checkpoint``'d block keeps: measured slope, docs/estimator.md#mlx-constants.
MLX_CKPT_H = 4
#: Full fine-tune update window: arrays per element, depth in blocks: fitted, docs/estimator.md#mlx-constants.
MLX_UPDATE_ARRAYS = {"adam": 4, "adamw": 4, "sgd": 1.25, "sgd-momentum": 3}
MLX_UPDATE_WINDOW_BLOCKS = 2.25


def mlx_full_optimizer_moment(ms: ModelSpec, ts: TrainSpec, trainable: int) -> Tuple[int, int, int, int]:
    """mlx_lm full fine-tune, the end of the compiled step: (gradients, new parameters and states,
    activations, attention-score arrays) in flight, bytes.

    The update window holds ``MLX_UPDATE_ARRAYS`` arrays per trainable element of the last
    min(trained blocks, ``MLX_UPDATE_WINDOW_BLOCKS``) blocks (the first the gradient, the rest
    reported as optimizer temporaries; one block's elements are ``params.blocks / num_layers``);
    below it the backward still holds the saved arrays of the trained blocks beyond the window,
    plus its one-time window (``MLX_FULL_ONE_TIME_*``, ``MLX_FULL_BWD_SCORES``).
    docs/estimator.md#mlx-constants."""
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length
    per_block_params = ms.params.blocks / max(ms.num_layers, 1)
    n_spec = max(num_lora_layers(ms, ts), 1)
    n_trained = min(float(n_spec), trainable / per_block_params) if per_block_params > 0 else n_spec
    pb = trainable_param_bytes(ms, ts)
    window = pb * min(trainable, MLX_UPDATE_WINDOW_BLOCKS * per_block_params)
    arrays = MLX_UPDATE_ARRAYS.get(ts.optimizer, 4)
    hidden, scores, one_time, _ = mlx_activations(ms, ts)
    bwd_scores = MLX_FULL_BWD_SCORES * e * ms.num_heads * ts.seq_length * tokens
    saved_per_block = (hidden + scores - bwd_scores) / n_spec
    lower = max(n_trained - MLX_UPDATE_WINDOW_BLOCKS, 0.0)
    return (int(window), int(max(arrays - 1, 0) * window), int(one_time + lower * saved_per_block),
            int(bwd_scores))


def mlx_activations(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int, int, int]:
    """mlx_lm's activation memory for ``mx.get_peak_memory()``: (blocks, attention probs, one-time
    backward working set, logits) in bytes for the micro-batch.

    Every forward array a VJP reads stays until the backward consumes it; per token and block the
    arrays of an mlx_lm Llama / Qwen2 block (e x (4h + 2 q_dim + 2 kv_dim + 5i) plus the softmax
    output), per routed expert for MoE, fp32 inputs of the LoRA'd groups on a half base, the
    trained norms' inputs under a full fine-tune; ``MLX_CKPT_H`` arrays per block under
    checkpointing. The array-by-array list: docs/estimator.md#mlx-constants.
    """
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length
    h, hd = ms.hidden_size, ms.head_dim
    qd, kvd = ms.num_heads * hd, ms.num_kv_heads * hd
    n = grad_layers(ms, ts)
    if ms.is_moe:
        k = max(ms.num_experts_per_tok, 1)
        i = (ms.moe_intermediate_size or ms.intermediate_size)
        mlp = k * (5 * i + h) + 2 * ms.num_experts
        i_eff = k * i
    else:
        i = ms.intermediate_size
        mlp = 5 * i
        i_eff = i
    per_block = e * (4 * h + 2 * qd + 2 * kvd + mlp + extra_norm_inputs(ms))
    if ts.method == "full":
        # trained RMSNorm weights: the VJP for each norm's weight reads the normalised input
        # (``x * rsqrt(mean(x^2) + eps)``), one hidden-sized array per norm, 2 per block -- like
        # HF's ``block_act_per_token`` (the "normalised" term of a trainable block)
        per_block += e * 2 * h
    if ts.method != "full" and e < 4:
        names = {ls.name for ls in lora_linears(ms, ts)}
        groups = [(("q_proj", "k_proj", "v_proj"), h), (("o_proj",), qd), (("gate_proj", "up_proj"), h),
                  (("down_proj",), i)]
        per_block += sum(4 * fin for ns, fin in groups if names & set(ns))
    probs = e * ms.num_heads * ts.seq_length
    if ts.method == "full":
        one_time = e * (MLX_FULL_ONE_TIME_H * h + MLX_FULL_ONE_TIME_I * i_eff) * tokens
        bwd_scores = MLX_FULL_BWD_SCORES * probs * tokens
    else:
        one_time = e * (MLX_ONE_TIME_H * h + MLX_ONE_TIME_I * i_eff) * tokens
        bwd_scores = 0
    logits = MLX_LOGITS_COPIES * e * ms.vocab_size * tokens
    keep, measured, one_measured = _measured_blocks(ms)
    if ts.grad_checkpoint:
        one = max(per_block + probs, one_measured)
        blocks = n * MLX_CKPT_H * e * h * tokens + one * tokens
        return int(blocks), int(bwd_scores), int(one_time), int(logits)
    # the blocks a VJP reaches (n of num_layers) hold the kinds in the model's proportions
    share = n / max(ms.num_layers, 1)
    blocks = n * per_block * tokens * keep + share * measured * tokens
    return int(blocks), int(n * probs * tokens * keep + bwd_scores), int(one_time), int(logits)


def _measured_blocks(ms: ModelSpec) -> Tuple[float, float, float]:
    """Block kinds the rules do not model whose saved bytes per token were measured on MLX
    (``memguard_mlx.block_census``: ``traced_under`` ends in the ``mlx`` device; a PyTorch census
    does not carry to MLX's graph): (share of blocks the rules still count, bytes per token all
    measured blocks keep, bytes per token the largest one keeps)."""
    kinds = [k for k in ms.block_kinds if not k.modelled and k.saved_per_token is not None
             and (k.traced_under or "").endswith(" mlx")]
    if not kinds:
        return 1.0, 0.0, 0.0
    n_measured = sum(k.count for k in kinds)
    keep = max(ms.num_layers - n_measured, 0) / max(ms.num_layers, 1)
    return keep, float(sum(k.count * k.saved_per_token for k in kinds)), max(k.saved_per_token for k in kinds)


@dataclasses.dataclass(frozen=True)
class MlxParamCounts(ParamCounts):
    """:class:`ParamCounts` of a live mlx_lm model, plus the elements of the blocks' norm WEIGHTS
    alone (``norm_weights_in_blocks``; ``norms_in_blocks`` also holds LayerNorm biases, which are
    parameters but no further saved input). Not part of ``as_dict``."""

    norm_weights_in_blocks: int = 0

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.pop("norm_weights_in_blocks", None)
        return d


def extra_norm_inputs(ms: ModelSpec) -> int:
    """Elements per token a block keeps for the VJPs of norms beyond the Llama layout's two (the
    block input and the post-attention residual, already in the rule): ``mx.fast.rms_norm``'s VJP
    reads its input (mlx ``mlx/fast.cpp`` ``RMSNorm::vjp``), so every further
    hidden-sized norm keeps a hidden-sized array -- Gemma-2/3 sandwich norms
    (``mlx_lm/models/gemma3_text.py`` ``TransformerBlock``: ``post_attention_layernorm``,
    ``post_feedforward_layernorm``) -- and head-dim q/k norms (``Attention.q_norm`` / ``k_norm``,
    Qwen3, Gemma-3) keep q and k before the norm (q_dim + kv_dim).

    The norms are read from the blocks' norm WEIGHTS per block
    (:attr:`MlxParamCounts.norm_weights_in_blocks`; a LayerNorm's bias is one more vector of the
    same norm, not another norm -- StarCoder2, StableLM: 0 here), else from
    ``params.norms_in_blocks``: hidden-sized ones by rounding over ``hidden_size``; a remainder of
    two ``head_dim`` vectors is a q/k norm pair. 0 when the spec does not count norms."""
    if isinstance(ms.params, MlxParamCounts):
        total = ms.params.norm_weights_in_blocks
    else:
        total = ms.params.norms_in_blocks
    per = total / max(ms.num_layers, 1)
    h, hd = ms.hidden_size, ms.head_dim
    if per < 1.5 * h:
        return 0
    n_h = int(round(per / h))
    qk = ms.num_heads * hd + ms.num_kv_heads * hd if abs(per - n_h * h - 2 * hd) < 0.5 else 0
    return max(n_h - 2, 0) * h + qk


def activation_terms(ms: ModelSpec, ts: TrainSpec) -> Dict[str, int]:
    """mlx_lm's activation terms of a step, bytes, keyed as ``moments.StepTerms`` names them:
    ``blocks``, ``scores``, ``lora`` (here the backward's one-time window), ``one_block`` (0: MLX
    recomputes within its graph), ``logits``, ``head_inputs`` (0: inside the one-time window)."""
    blocks, scores, one_time, logits = mlx_activations(ms, ts)
    return dict(blocks=blocks, scores=scores, lora=one_time, one_block=0, logits=logits, head_inputs=0)


def optimizer_moment(ms: ModelSpec, ts: TrainSpec, trainable: int) -> Dict[str, int]:
    """mlx_lm full fine-tune: the optimizer moment's terms that the update window replaces, bytes
    (``gradients``, ``optimizer_temporaries``, ``activations``, ``attention_scores``):
    :func:`mlx_full_optimizer_moment`. The loss moment holds no update arrays; SGD's extra copy of
    the trainable parameters (MLX SGD's ``v``) is counted as a state."""
    g_fly, new_fly, acts, scores = mlx_full_optimizer_moment(ms, ts, trainable)
    return dict(gradients=g_fly, optimizer_temporaries=new_fly, activations=acts, attention_scores=scores)
