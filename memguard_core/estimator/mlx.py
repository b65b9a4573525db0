"""MLX device rules (mlx_lm's lazy graph): saved arrays per block, the backward's one-time working set,
logits and the full fine-tune's update window. Constants fitted on real mlx_lm runs:
docs/estimator.md, "MLX constants".
"""

from __future__ import annotations

from typing import Dict, Tuple

from .gradients import grad_layers
from .trainable import lora_linears, num_lora_layers
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec
from .weights import trainable_param_bytes


#: mlx_lm: the backward's one-time working set beyond the blocks' saved arrays, per token, in
#: units of compute-dtype elements: ``MLX_ONE_TIME_H`` x hidden + ``MLX_ONE_TIME_I`` x intermediate
#: (the top block's backward temporaries -- each LoRA'd / trained linear produces its base and
#: adapter input-gradients before they are summed -- plus the final norm, the head's input and its
#: gradient). ``mx.get_peak_memory()`` of real ``mlx_lm.tuner.trainer.train`` runs is linear in
#: the number of blocks with the slope the saved-array count below predicts; these two terms are
#: the intercept at 0 blocks, regressed over tiny Llama-layout LoRA runs (fitted on real mlx_lm
#: runs; docs/estimator.md, "MLX constants").
MLX_ONE_TIME_H = 16
MLX_ONE_TIME_I = 6
#: Why a one-time working set at all, and why it differs between LoRA and full fine-tuning: MLX's
#: CPU backend evaluates asynchronously. ``mx.eval`` walks the tape on the calling thread and, for
#: each array, allocates its output (``eval_cpu``) and enqueues the kernel on the stream's worker
#: thread; the caller only blocks when more than ``MAX_ACTIVE_TASKS`` (10, ``mlx/transforms.cpp``)
#: scheduler tasks are pending, and the CPU encoder counts one task per ``DISPATCHES_PER_TASK``
#: (10, ``mlx/backend/cpu/encoder.h`` of the installed wheel) dispatches -- so up to ~100 dispatches
#: (about 50 ops, kernel + buffer release each) are encoded, their outputs allocated, while the
#: worker still holds the inputs of the ops it has not run. The peak is the live set at the loss
#: plus the outputs of the first ~50 backward ops: asynchronous steps peak higher than the same
#: steps run synchronously (``mx.set_memory_limit(1)`` makes the eval loop wait for every task),
#: and vary between runs by whole arrays. The ``MLX_ONE_TIME_*`` terms are that window.
#: Its content depends on the backward's op mix:
#: under LoRA each adapted linear's backward is ~6 ops (base and adapter input-gradients, scaled,
#: summed; ``x @ A`` and ``g @ B^T`` products), so the window ends inside the top block's MLP, with
#: ~3 extra intermediate-sized arrays from ``down_proj``; a full fine-tune's linear backward is 2
#: ops (``g @ W`` and ``g^T x``), so the same window reaches through the top block's attention
#: backward, which on CPU (``mx.fast.scaled_dot_product_attention``'s fallback, ``softmax(q k^T)
#: v``) allocates two score-sized arrays (the probabilities' cotangent ``g v^T`` and the softmax
#: VJP), heads x seq per token each. Full fine-tune window: ``MLX_FULL_ONE_TIME_H`` x h +
#: ``MLX_FULL_ONE_TIME_I`` x i per token plus ``MLX_FULL_BWD_SCORES`` score arrays, regressed over
#: real mlx_lm full fine-tunes of tiny Llama shapes (LoRA runs of the same sweep show no score
#: term). Not covered: bf16 tiny models, where the same window is relatively larger. Fitted on real
#: mlx_lm runs; docs/estimator.md, "MLX constants".
MLX_FULL_ONE_TIME_H = 20
MLX_FULL_ONE_TIME_I = 3
MLX_FULL_BWD_SCORES = 2
#: mlx_lm ``default_loss``: logits (B, L, V) in the model dtype, ``nn.losses.cross_entropy``'s
#: ``logsumexp`` and the gathered-target difference, the logits' gradient and the ``astype``: 4 x
#: e x V per token, matching the vocabulary slope of real runs (docs/estimator.md, "MLX constants").
MLX_LOGITS_COPIES = 4
#: mlx_lm ``grad_checkpoint`` (``mx.checkpoint`` around each block's ``__call__``): per block, 4
#: hidden-sized arrays per token stay (the checkpoint's input and output and their cotangent
#: buffers), matching the per-block slope of checkpointed runs (docs/estimator.md, "MLX constants").
MLX_CKPT_H = 4
#: mlx_lm full fine-tune, the end of the compiled step (``train``'s ``step``: backward and
#: ``optimizer.update`` in one ``mx.compile``d graph, evaluated by one ``mx.eval``): the update of a
#: parameter is encoded as soon as its gradient is, so, with the asynchronous window described at
#: ``MLX_ONE_TIME_I``, the gradients and the new arrays of the last blocks reached by the backward
#: are allocated together while the old parameters and states are still held. Per trainable element
#: in flight, in the parameter's bytes: Adam/AdamW 4 (the gradient, the new m, the new v and the new
#: parameter; ``mlx/optimizers/optimizers.py`` ``Adam.apply_single``); SGD without momentum 1.25
#: (the gradient; ``parameter - lr * gradient`` mostly reuses the gradient's buffer, MLX donating an
#: elementwise op's sole-reference input); others: the gradient, one new array per state and the
#: new parameter. The window holds the updates of about ``MLX_UPDATE_WINDOW_BLOCKS`` blocks (the
#: same steps evaluated synchronously, ``mx.set_memory_limit(1)``, rise far less). Fitted on
#: parameter-dominated mlx_lm full fine-tunes; docs/estimator.md, "MLX constants".
MLX_UPDATE_ARRAYS = {"adam": 4, "adamw": 4, "sgd": 1.25, "sgd-momentum": 3}
MLX_UPDATE_WINDOW_BLOCKS = 2.25


def mlx_full_optimizer_moment(ms: ModelSpec, ts: TrainSpec, trainable: int) -> Tuple[int, int, int, int]:
    """mlx_lm full fine-tune, the end of the compiled step: (gradients, new parameters and states,
    activations, attention-score arrays) in flight, bytes.

    * the update window: ``MLX_UPDATE_ARRAYS`` arrays per trainable element of the last
      min(trained blocks, ``MLX_UPDATE_WINDOW_BLOCKS``) blocks, the first of them the gradient
      (the rest reported as optimizer temporaries); one block's trainable elements are
      ``params.blocks / num_layers``, so a spec that does not know how many blocks train (mlx_lm's
      ``num_layers`` is not on the model) still gets the window right from ``trainable``;
    * the backward still running below it: the saved arrays of the trained blocks beyond the window
      (the backward has not reached them yet), plus the backward's one-time window
      (``MLX_FULL_ONE_TIME_*`` and the attention backward's ``MLX_FULL_BWD_SCORES``).
    Fitted on real mlx_lm steps: see ``MLX_UPDATE_ARRAYS`` and docs/estimator.md, "MLX constants"."""
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

    MLX differentiates the lazy graph (``nn.value_and_grad``) and ``mx.eval`` of the compiled step
    keeps every forward array a VJP reads until the backward consumes it (``mlx/transforms.cpp``
    ``vjp``; arrays are released when their last consumer ran). For one mlx_lm Llama/Qwen2 block
    (``mlx_lm/models/llama.py``) the arrays read by the backward are, per token: the block input
    and the post-attention residual (RMSNorm's VJP reads its input: ``mx.fast.rms_norm``), the two
    normalised tensors (inputs of the LoRA'd / trained projections), q and k after RoPE and v
    (``mx.fast.scaled_dot_product_attention``'s CPU fallback: ``softmax(q k^T) v``), the
    attention output (o_proj's input), and in the MLP gate, sigmoid(gate), silu(gate), up and the
    product (down_proj's input): e x (4h + 2 q_dim + 2 kv_dim + 5i), plus the softmax output
    (heads x seq per token, compute dtype). Half-precision blocks with fp32 LoRA adapters promote
    each LoRA'd input to fp32 for ``x @ lora_a`` (mlx_lm ``tuner/lora.py``): 4 bytes per element of
    each LoRA'd input group. MoE (``SwitchGLU``): the MLP terms per routed expert (top-k), plus the
    router's logits and scores. Blocks below the lowest trained block keep nothing (no VJP reaches
    them). With checkpointing each block keeps ``MLX_CKPT_H`` hidden-sized arrays and one block's
    saved set is recomputed at a time. A full fine-tune (mlx_lm unfreezes whole blocks, norms
    included) also keeps each trained RMSNorm's normalised input for its weight's gradient (2 x e x
    h per token per block: freezing the norms removes the full-vs-LoRA difference of the live set),
    and its one-time window is ``MLX_FULL_ONE_TIME_*`` plus ``MLX_FULL_BWD_SCORES`` score-sized
    arrays (returned in the probs term). Constants ``MLX_*`` above: fitted on real mlx_lm runs, see
    their comments and docs/estimator.md, "MLX constants".
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
    per_block = e * (4 * h + 2 * qd + 2 * kvd + mlp)
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
    if ts.grad_checkpoint:
        blocks = n * MLX_CKPT_H * e * h * tokens + (per_block + probs) * tokens
        return int(blocks), int(bwd_scores), int(one_time), int(logits)
    return int(n * per_block * tokens), int(n * probs * tokens + bwd_scores), int(one_time), int(logits)


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
