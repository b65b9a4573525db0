"""``estimate()``: the peak of one counter composed from the terms of memory at the three moments of
a step (``loss``, ``backward``, ``optimizer``); the rules of each term live in the sibling modules.
How the peak is composed: docs/estimator.md, "How the peak is composed".
"""

from __future__ import annotations

import math
from typing import List

from ..errors import ConfigError
from .activations import activation_bytes
from .attention import dropout_bytes
from .bnb import bnb_4bit_keeps_input, bnb_last_step_inputs
from .cpu_heap import (CPU_HEAP_SLACK_BACKWARD, CPU_HEAP_SLACK_CHECKPOINTED, CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS,
                       CPU_HEAP_SLACK_FORWARD, LORA_TEMP_SLACK, MMAP_THRESHOLD_MAX, activation_traffic,
                       heap_gradient_bytes, lora_forward_traffic)
from .cuda import CUDA_FRAGMENTATION, cuda_sdpa_backend
from . import litgpt
from .gradients import embedding_grad_transients, grad_layers
from .logits import logits_bytes
from .lora_targets import with_default_lora_targets
from .mlx import mlx_activations, mlx_full_optimizer_moment
from .mps import MPS_FRAGMENTATION
from .optimizer import optimizer_state_bytes, optimizer_temporary_bytes
from .sharding import apply_sharding  # per-rank terms of DDP / FSDP / ZeRO (no-op for "none")
from .result import BREAKDOWN_ORDER, MemoryEstimate
from .runtime import runtime_overhead_bytes
from .trainable import check_train_spec, trainable_param_count, vision_lora_linears, weights_for_training
from .specs import DTYPE_BYTES, ModelSpec, NF4_BITS, TrainSpec
from .vision import vision_activation_bytes
from .weights import (dequant_transient_bytes, master_weight_bytes, trainable_param_bytes, weight_bits, weight_bytes,
                      weight_copy_bytes)


def _validate(ms, ts, correction) -> None:
    if not isinstance(ms, ModelSpec):
        raise ConfigError("model_spec", "a memguard_core.spec.ModelSpec", type(ms).__name__)
    if not isinstance(ts, TrainSpec):
        raise ConfigError("train_spec", "a memguard_core.spec.TrainSpec", type(ts).__name__)
    if isinstance(correction, bool) or not isinstance(correction, (int, float)) \
            or not (0 < float(correction) < 100) or math.isnan(float(correction)):
        raise ConfigError("correction", "a positive factor (e.g. 1.0)", correction)
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        v = getattr(ms, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"model_spec.{f}", "a positive integer", v)
    if ms.params.total <= 0:
        raise ConfigError("model_spec.params", "parameter counts with a positive total", ms.params)
    if ts.method == "full" and weight_bits(ms, ts) < 16 and ms.weight_bits < ms.dense_bits:
        raise ConfigError("method", "lora or qlora for quantized weights (full fine-tuning cannot "
                          "train 4/8-bit weights)", ts.method)


def estimate(model_spec: ModelSpec, train_spec: TrainSpec, *, correction: float = 1.0) -> MemoryEstimate:
    """Estimate the peak of ``train_spec.device``'s counter for one training process.

    Args:
        model_spec: the architecture (``memguard_core.spec.ModelSpec``).
        train_spec: the training settings (``memguard_core.spec.TrainSpec``).
        correction: multiplicative calibration factor (e.g. from past runs); the difference is
            reported as the ``calibration`` term.

    Returns:
        MemoryEstimate with ``peak_bytes`` and the breakdown of the terms live at the peak moment
        (see the module docstring for the three moments).

    The weights are counted in the dtype ``train_spec`` implies (``train_spec.dtype``, or fp32
    with ``mixed_precision``) unless the spec was read from a live module:
    ``memguard_core.spec.weights_for_training``; ``MemoryEstimate.model_spec`` is that spec.

    Raises:
        ConfigError: a spec of the wrong type, a non-positive shape, a bad correction, full
            fine-tuning of quantized weights, LoRA targets that match nothing; under
            ``model_code="litgpt"`` the settings ``memguard_core.litgpt.check`` refuses.
    """
    _validate(model_spec, train_spec, correction)
    is_litgpt = train_spec.model_code == "litgpt"  # LitGPT's own model code: memguard_core.estimator.litgpt
    if is_litgpt:
        litgpt.check(model_spec, train_spec)
    else:
        train_spec = with_default_lora_targets(model_spec, train_spec)  # PEFT's targets when none given
    notes: List[str] = list(check_train_spec(model_spec, train_spec))
    ts = train_spec
    # images per row: the image tokens of the row over those one image adds (one image at the defaults)
    images = ts.image_tokens / model_spec.image_tokens if ts.image_tokens and model_spec.image_tokens else 0.0
    if ts.image_tokens:  # a vision-language decoder's sequence holds the image tokens too
        ts = ts.replace(seq_length=ts.seq_length + ts.image_tokens, image_tokens=0)
    ms = weights_for_training(model_spec, ts)
    if ms.params.vision and ts.method == "full":
        notes.append("full fine-tune of a vision-language model: the vision tower's weights, gradients "
                     "and optimizer states are counted, its activations are not")
    vision_hits = vision_lora_linears(ms, ts.lora_targets) if ts.method != "full" and not is_litgpt else []
    vision_act = vision_activation_bytes(ms, ts, images)
    if vision_hits:
        notes.append(f"LoRA reaches the vision tower / projector ({len(vision_hits)} linears): their adapters "
                     + (f"and the tower's saved activations for {images:g} image(s) per row are counted"
                        if vision_act else "are counted; no images in the rows (image_tokens 0): no vision activations"))
    elif (ms.params.vision and ms.vision_tower is None and ts.method != "full"
          and any(t.lower() in ("all-linear", "all_linear") for t in ts.lora_targets)):
        notes.append(f"all-linear LoRA also adapts the vision tower of {ms.model_type!r}, whose numbers memguard "
                     "does not read: its adapters and activations are not counted")
    trainable = litgpt.trainable_params(ms, ts) if is_litgpt else trainable_param_count(ms, ts)
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length

    weights = litgpt.weights(ms, ts, trainable) if is_litgpt else weight_bytes(ms, ts, trainable)
    copies = weight_copy_bytes(ms, ts)
    # bitsandbytes: the dense weight one quantized linear materialises while it runs (the first
    # backward op, the top block's, starts while the loss moment's tensors are live)
    dequant = 0 if is_litgpt else dequant_transient_bytes(ms, ts)
    master = master_weight_bytes(ms, ts, trainable)
    pb = 4 if master else trainable_param_bytes(ms, ts)
    grads = pb * trainable if not master else int(ms.dense_bits // 8) * trainable
    states = optimizer_state_bytes(ms, ts, trainable)
    opt_tmp = optimizer_temporary_bytes(ms, ts, trainable)
    if is_litgpt:  # below, from LitGPT's rules
        hidden = scores = lora_act = one_block = logits_peak = 0
    else:
        hidden, scores, lora_act, one_block = activation_bytes(ms, ts)
        logits_peak, _ = logits_bytes(ms, ts)
    if ts.framework == "mlx":  # MLX's lazy graph: see mlx_activations
        hidden, scores, one_time, logits_peak = mlx_activations(ms, ts)
        lora_act, one_block = one_time, 0
    # the final norm's saved input and the head's input (saved when the head trains)
    head_in = 4 * ms.hidden_size * tokens if ts.framework != "mlx" else 0
    if ts.method == "full" and ts.framework != "mlx":
        head_in += e * ms.hidden_size * tokens * 2
    if ms.embedding_dropout > 0 and ts.framework != "mlx":
        head_in += dropout_bytes(ts, e) * ms.hidden_size * tokens  # the embedding dropout's noise
    # eager causal mask (batch x 1 x s x s in the compute dtype), built once per forward
    mask = ts.batch_size * ts.seq_length ** 2 * e if ts.attn_impl == "eager" else 0
    # gradient checkpointing: the recomputed block's working set during the backward
    recompute = one_block if ts.grad_checkpoint else 0
    overhead = runtime_overhead_bytes(ts)

    last_step = bnb_last_step_inputs(ms, ts)
    head_moment = None
    bwd_copies = copies + dequant
    kept_grad = kept_tmp = 0  # a gradient no optimizer holds (LitGPT's QLoRA StableEmbedding)
    if is_litgpt:
        # LitGPT's blocks and head (memguard_core.estimator.litgpt): the loss moment is the largest of the
        # moments its step peaks at (the first loss chunk's backward; the 4-bit head's backward;
        # the next forward beside a kept graph), each adding its head terms to the blocks
        saves, quant = litgpt.block_saves(ms, ts), litgpt.qlora_inputs(ms, ts)
        stable = litgpt.stable_embedding_terms(ms, ts)
        kept_grad, kept_tmp = stable["gradient"], stable["transient"]
        n = ms.num_layers  # LitGPT adapts every block (litgpt.check refuses lora_layers)
        per = (n - 1) * (saves.block + quant.block) + saves.first + quant.first
        scores = int(tokens * n * saves.lse)
        hidden = int(tokens * (per + stable["per_token"])) - scores
        lora_act, one_block = 0, int(tokens * (saves.block + quant.block))
        heads = litgpt.head_moments(ms, ts)
        head_moment = max(heads, key=lambda k: sum(heads[k].values()))
        h = heads[head_moment]
        logits_peak, head_in, copies, last_step = h["logits"], h["activations"], h["weight_copies"], 0
        # the head's dense weight exists only while the head runs; the backward ends in the bottom
        # block, whose 4-bit linears are dequantized one at a time
        bwd_copies = litgpt.block_dequant(ms, ts)

    # moment 1: loss (grads resident only while accumulating)
    grads_at_loss = (grads if ts.grad_accum > 1 else 0) + kept_grad
    # mlx_lm full fine-tune: the update's arrays are not live at the loss (with synchronous
    # evaluation the loss-moment live set of AdamW and SGD steps is the same); the step's update
    # window is the optimizer moment below (``mlx_full_optimizer_moment``). SGD's extra copy of
    # the trainable parameters is MLX SGD's ``v`` buffer, counted as a state.
    loss = dict(weights=weights, weight_copies=copies + dequant, gradients=grads_at_loss,
                optimizer_states=states, master_weights=master, optimizer_temporaries=0,
                backward_transients=0, activations=hidden + lora_act + head_in + recompute + last_step + vision_act,
                attention_scores=scores + mask, logits=logits_peak, runtime_overhead=overhead)
    # moment 2: end of backward: all grads + embedding-grad transient (dense V x h beyond .grad,
    # EMBEDDING_GRAD_COPIES by tied head / accumulation) + the first block's working set.
    emb_tmp, head_tmp = embedding_grad_transients(ms, ts, pb)
    loss["backward_transients"] = head_tmp
    bwd = dict(weights=weights, weight_copies=bwd_copies, gradients=grads + kept_grad,
               backward_transients=emb_tmp + kept_tmp,
               optimizer_states=states, master_weights=master, optimizer_temporaries=0,
               # the vision tower's backward runs after the decoder's: its saved tensors are still live
               activations=(min(one_block, hidden + lora_act + recompute) if grad_layers(ms, ts) else 0) + vision_act,
               attention_scores=0, logits=0, runtime_overhead=overhead)
    # moment 3: optimizer step
    opt = dict(weights=weights, weight_copies=0, gradients=grads + kept_grad, optimizer_states=states,
               master_weights=master, optimizer_temporaries=opt_tmp, backward_transients=0,
               activations=0,
               attention_scores=0, logits=0, runtime_overhead=overhead)
    if ts.framework == "mlx" and ts.method == "full":
        # the update is part of the backward's graph: gradients and new arrays of the last blocks
        # in flight together while the backward still runs below them -- see MLX_UPDATE_ARRAYS
        g_fly, new_fly, acts, sc = mlx_full_optimizer_moment(ms, ts, trainable)
        opt.update(gradients=g_fly, optimizer_temporaries=new_fly, activations=acts,
                   attention_scores=sc)
    phases = {"loss": loss, "backward": bwd, "optimizer": opt}
    totals = {k: sum(v.values()) for k, v in phases.items()}
    traffic = activation_traffic(ms, ts)
    logits_tensor = ts.batch_size * ts.seq_length * ms.vocab_size * 4
    lora_traffic = lora_forward_traffic(ms, ts)
    kind = "full" if ts.method == "full" else "lora"
    for k, v in phases.items():
        if ts.device in ("cuda", "mps"):
            frag = CUDA_FRAGMENTATION if ts.device == "cuda" else MPS_FRAGMENTATION
            slack = int(frag * (totals[k] - overhead))
        elif ts.device == "cpu":
            small_logits = logits_peak if logits_tensor < MMAP_THRESHOLD_MAX else 0
            if ts.grad_checkpoint:
                # the blocks' activations never coexist (one block is recomputed at a time): the
                # arena is what the forward left, or the holes of the last step's gradients when
                # those are larger -- the next forward runs inside them and the new gradients
                # take fresh heap (``heap_gradient_bytes``); the same at every moment. A run that
                # trims the heap at every step's end (``ts.heap_trim``, memguard's guard) handed
                # those pages back after ``zero_grad`` freed the gradients: no such holes remain
                held = 0 if ts.heap_trim else heap_gradient_bytes(ms, ts, grads, pb)
                if kind == "full" and k == "loss" and ts.heap_trim:
                    one = traffic / max(1, grad_layers(ms, ts))
                    slack = int(CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS * one
                                + CPU_HEAP_SLACK_CHECKPOINTED[kind] * small_logits)
                else:
                    slack = max(int(CPU_HEAP_SLACK_CHECKPOINTED[kind] * (traffic + small_logits)), held)
            elif k == "loss":
                slack = int(CPU_HEAP_SLACK_FORWARD[kind] * (traffic + small_logits) + LORA_TEMP_SLACK * lora_traffic)
            else:
                slack = int(CPU_HEAP_SLACK_BACKWARD[kind] * traffic)
        else:
            slack = 0
        v["allocator_slack"] = slack
        totals[k] += slack
    apply_sharding(ms, ts, phases, totals, notes)
    phase = max(totals, key=lambda k: totals[k])
    chosen = phases[phase]
    peak_raw = totals[phase]
    peak = int(math.ceil(peak_raw * float(correction)))
    breakdown = {k: int(chosen.get(k, 0)) for k in BREAKDOWN_ORDER if k != "calibration"}
    breakdown["calibration"] = peak - peak_raw
    if ts.grad_checkpoint:
        notes.append("gradient checkpointing: one block input per layer + one recomputed block")
    if ts.method == "qlora" and ms.weight_bits >= 8:
        notes.append(f"QLoRA: block linears stored as NF4 ({NF4_BITS} bits)")
    if dequant:
        if weight_bits(ms, ts) >= 8 or bnb_4bit_keeps_input(ts):
            notes.append("bitsandbytes: each quantized linear keeps its input for the backward "
                         "(MatMul4Bit/MatMul8bitLt ctx.tensors) and dequantizes one weight at a time")
        else:
            notes.append("bitsandbytes >= 0.43.2: 4-bit linears keep no input; one weight dequantized at a time")
    if last_step:
        notes.append("bitsandbytes: the loop keeps the last step's output, and with it the quantized "
                     "linears' inputs of that step (ctx attributes) into the next forward")
    if ts.paged and ts.device == "cuda":
        notes.append("paged optimizer: states of tensors from 1e5 elements on in CUDA unified memory "
                     "(outside max_memory_allocated / max_memory_reserved)")
    if ts.device == "cuda":
        notes.append(f"cuda: SDPA kernel {cuda_sdpa_backend(ms, ts)}")
    if kept_grad:
        notes.append("LitGPT >= 0.5 QLoRA: the StableEmbedding it swaps in trains outside the optimizer -- its "
                     "dense gradient stays from the first backward on")
    if is_litgpt:
        notes.append("LitGPT's model code: fused qkv LoRA on " + ", ".join(sorted(litgpt.lora_parts(ts)))
                     + f", adapters in {ts.dtype}, head in chunks of {litgpt.LM_HEAD_CHUNK}; the loss moment is "
                     + {"loss": "the first loss chunk's backward", "head_backward": "the 4-bit head's backward",
                        "forward_end": "the end of the forward (Fabric's fp32 copy of the logits)",
                        "next_forward": "the next forward beside the kept graph"}[head_moment])
    return MemoryEstimate(peak_bytes=peak, breakdown=breakdown, counter=ts.device,
                          model_spec=ms, train_spec=train_spec, trainable_params=trainable, phase=phase,
                          phases=totals,
                          phase_breakdowns={k: {t: int(v.get(t, 0)) for t in BREAKDOWN_ORDER
                                                if t != "calibration"} for k, v in phases.items()},
                          correction=float(correction), notes=tuple(notes))
