"""``estimate()``: the peak of one counter, composed from the terms of memory at the three moments of
a step (``loss``, ``backward``, ``optimizer``: ``moments``); each term's rules live in its own module,
each device's allocator rules in ``cpu_heap`` / ``cuda`` / ``mps`` / ``mlx``, LitGPT's in ``litgpt``.
docs/estimator.md, "How the peak is composed".
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigError
from . import cpu_heap, cuda, litgpt, mlx, mps
from .activations import activation_bytes
from .block_terms import block_kind_notes, with_traced_blocks
from .bnb import bnb_4bit_keeps_input, bnb_last_step_inputs
from .gradients import embedding_grad_transients
from .heads import head_of
from .image_blocks import with_patch_tokens
from .logits import head_input_bytes, logits_bytes
from .lora_targets import with_default_lora_targets
from .moments import StepTerms, compose_moments, recompute_beyond_logits
from .optimizer import optimizer_state_bytes, optimizer_temporary_bytes
from .result import BREAKDOWN_ORDER, MemoryEstimate
from .runtime import runtime_overhead_bytes, runtime_source
from .seq2seq_blocks import decoder_lora_params, is_seq2seq
from .sharding import apply_sharding  # per-rank terms of DDP / FSDP / ZeRO (no-op for "none")
from .specs import DTYPE_BYTES, ModelSpec, NF4_BITS, TrainSpec
from .trainable import check_train_spec, trainable_param_count, vision_lora_linears, weights_for_training
from .vision import vision_activation_bytes
from .weights import (dequant_transient_bytes, master_weight_bytes, trainable_param_bytes, weight_bits, weight_bytes,
                      weight_copy_bytes)


def estimate(model_spec: ModelSpec, train_spec: TrainSpec, *, correction: float = 1.0) -> MemoryEstimate:
    """Estimate the peak of ``train_spec.device``'s counter for one training process.

    Args:
        model_spec: the architecture (``memguard_core.estimator.specs.ModelSpec``).
        train_spec: the training settings (``memguard_core.estimator.specs.TrainSpec``).
        correction: multiplicative calibration factor (e.g. from past runs); the difference is
            reported as the ``calibration`` term.

    Returns:
        MemoryEstimate with ``peak_bytes`` and the breakdown of the terms live at the peak moment
        (``loss`` | ``backward`` | ``optimizer``), bytes.

    The weights are counted in the dtype ``train_spec`` implies (``train_spec.dtype``, or fp32
    with ``mixed_precision``) unless the spec was read from a live module:
    ``memguard_core.estimator.trainable.weights_for_training``; ``MemoryEstimate.model_spec`` is that spec.

    Raises:
        ConfigError: a spec of the wrong type, a non-positive shape, a bad correction, full
            fine-tuning of quantized weights, LoRA targets that match nothing; under
            ``model_code="litgpt"`` the settings ``memguard_core.estimator.litgpt.check`` refuses.
    """
    _validate(model_spec, train_spec, correction)
    train_spec = with_patch_tokens(model_spec, train_spec)  # an image classifier's rows are its patch tokens
    if train_spec.model_code == "litgpt":
        litgpt.check(model_spec, train_spec)
    else:
        train_spec = with_default_lora_targets(model_spec, train_spec)  # PEFT's targets when none given
    ms, ts, images, notes = _prepare(model_spec, train_spec)
    is_litgpt = ts.model_code == "litgpt"
    trainable = litgpt.trainable_params(ms, ts) if is_litgpt else _trainable(ms, ts)
    terms, head_moment = _step_terms(ms, ts, trainable, images)
    phases = compose_moments(ms, ts, terms)
    if ts.framework == "mlx" and ts.method == "full":  # the update runs inside the backward's graph
        phases["optimizer"].update(mlx.optimizer_moment(ms, ts, trainable))
    totals = {k: sum(v.values()) for k, v in phases.items()}
    floors = _slack_floors(ms, ts, terms)
    for k, slack in _allocator_slack(ms, ts, totals, terms, floors).items():
        phases[k]["allocator_slack"] = slack
        totals[k] += slack
    apply_sharding(ms, ts, phases, totals, notes, slack_floors=floors)
    if floors.get("loss") and phases["loss"].get("allocator_slack") == floors["loss"]:
        notes.append(f"cuda: {floors['loss'] / 2**30:.2f} GiB of the loss moment's slack is cached blocks no request "
                     "there fits (freed half-precision logits; under checkpointing the forward's block tensors): "
                     "reserved, not allocated")
    phase = max(totals, key=lambda k: totals[k])
    peak_raw = totals[phase]
    peak = int(math.ceil(peak_raw * float(correction)))
    breakdown = {k: int(phases[phase].get(k, 0)) for k in BREAKDOWN_ORDER if k != "calibration"}
    breakdown["calibration"] = peak - peak_raw
    notes.extend(_closing_notes(ms, ts, terms, head_moment))
    return MemoryEstimate(peak_bytes=peak, breakdown=breakdown, counter=ts.device,
                          model_spec=ms, train_spec=train_spec, trainable_params=trainable, phase=phase,
                          phases=totals,
                          phase_breakdowns={k: {t: int(v.get(t, 0)) for t in BREAKDOWN_ORDER
                                                if t != "calibration"} for k, v in phases.items()},
                          correction=float(correction), notes=tuple(notes), slack_floors=floors)


def _trainable(ms: ModelSpec, ts: TrainSpec) -> int:
    """``trainable_param_count``, plus an encoder-decoder's decoder adapters where the count is
    derived from the shapes (``trainable`` counts the encoder's blocks, ``ModelSpec.block_linears``);
    a live module's own count (every adapter of both stacks) is taken as it is."""
    n = trainable_param_count(ms, ts)
    if is_seq2seq(ms) and ts.method != "full":
        live = (ms.trainable_params is not None and ms.lora_rank_found is not None
                and ts.lora_rank == ms.lora_rank_found and ts.lora_layers is None)
        if not live:
            n += decoder_lora_params(ms, ts)
    return n


def _validate(ms, ts, correction) -> None:
    if not isinstance(ms, ModelSpec):
        raise ConfigError("model_spec", "a memguard_core.estimator.specs.ModelSpec", type(ms).__name__)
    if not isinstance(ts, TrainSpec):
        raise ConfigError("train_spec", "a memguard_core.estimator.specs.TrainSpec", type(ts).__name__)
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


def _prepare(model_spec: ModelSpec, train_spec: TrainSpec) -> Tuple[ModelSpec, TrainSpec, float, List[str]]:
    """The specs as counted (image tokens in the row, weights in their training dtype), images per
    row, and the notes on what is (not) counted."""
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
    vision_hits = vision_lora_linears(ms, ts.lora_targets) if ts.method != "full" and ts.model_code != "litgpt" else []
    if vision_hits:
        notes.append(f"LoRA reaches the vision tower / projector ({len(vision_hits)} linears): their adapters "
                     + (f"and the tower's saved activations for {images:g} image(s) per row are counted"
                        if vision_activation_bytes(ms, ts, images)
                        else "are counted; no images in the rows (image_tokens 0): no vision activations"))
    elif (ms.params.vision and ms.vision_tower is None and ts.method != "full"
          and any(t.lower() in ("all-linear", "all_linear") for t in ts.lora_targets)):
        notes.append(f"all-linear LoRA also adapts the vision tower of {ms.model_type!r}, whose numbers memguard "
                     "does not read: its adapters and activations are not counted")
    return ms, ts, images, notes


def _step_terms(ms: ModelSpec, ts: TrainSpec, trainable: int, images: float) -> Tuple[StepTerms, Optional[str]]:
    """The step's terms under ``ts.model_code``'s rules, and LitGPT's peak head moment (else None)."""
    master = master_weight_bytes(ms, ts, trainable)
    pb = 4 if master else trainable_param_bytes(ms, ts)
    emb_tmp, head_tmp = embedding_grad_transients(ms, ts, pb)
    shared = dict(gradients=(pb if not master else int(ms.dense_bits // 8)) * trainable, param_bytes=pb,
                  optimizer_states=optimizer_state_bytes(ms, ts, trainable), master_weights=master,
                  optimizer_temporaries=optimizer_temporary_bytes(ms, ts, trainable),
                  vision=vision_activation_bytes(ms, ts, images),
                  # eager causal mask (batch x 1 x s x s in the compute dtype), built once per forward
                  mask=_eager_masks(ms, ts) if ts.attn_impl == "eager" else 0,
                  runtime_overhead=runtime_overhead_bytes(ts), embedding_transient=emb_tmp, head_transient=head_tmp)
    if ts.model_code == "litgpt":
        return litgpt.step_terms(ms, ts, trainable, shared)
    if ts.framework == "mlx":  # MLX's lazy graph
        acts = mlx.activation_terms(ms, ts)
    else:
        hidden, scores, lora, one_block = with_traced_blocks(ms, ts, *activation_bytes(ms, ts))
        acts = dict(blocks=hidden, scores=scores, lora=lora, one_block=one_block,
                    logits=logits_bytes(ms, ts)[0], head_inputs=head_input_bytes(ms, ts))
    # bitsandbytes: the dense weight one quantized linear materialises while it runs (the first
    # backward op, the top block's, starts while the loss moment's tensors are live)
    copies = weight_copy_bytes(ms, ts) + dequant_transient_bytes(ms, ts)
    return StepTerms(weights=weight_bytes(ms, ts, trainable), weight_copies=copies, backward_weight_copies=copies,
                     recompute=acts["one_block"] if ts.grad_checkpoint else 0,
                     last_step=bnb_last_step_inputs(ms, ts), **acts, **shared), None


def _eager_masks(ms: ModelSpec, ts: TrainSpec) -> int:
    """Eager attention's additive masks, bytes: ``batch x 1 x s x s`` in the compute dtype; an
    encoder-decoder's three (encoder S x S, decoder T x T, cross-attention T x S: transformers
    ``masking_utils`` ``create_bidirectional_mask`` / ``create_causal_mask``)."""
    s, t = ts.seq_length, ts.decoder_tokens
    area = s * s + t * t + t * s if is_seq2seq(ms) else s * s
    return ts.batch_size * area * DTYPE_BYTES[ts.dtype]


def _slack_floors(ms: ModelSpec, ts: TrainSpec, t: StepTerms) -> Dict[str, int]:
    """moment -> the least allocator slack of that moment, bytes: on cuda the loss moment's cached
    blocks no request there fits (``cuda.unusable_cache_bytes``); the forward's cached block
    tensors count only beyond a recompute the loss moment already holds (it reuses them)."""
    if ts.device != "cuda":
        return {}
    cached = max(0, t.one_block - recompute_beyond_logits(ms, ts, t)) if ts.grad_checkpoint else 0
    floor = cuda.unusable_cache_bytes(ms, ts, cached)
    return {"loss": floor} if floor else {}


def _allocator_slack(ms: ModelSpec, ts: TrainSpec, totals: Dict[str, int], t: StepTerms,
                     floors: Dict[str, int]) -> Dict[str, int]:
    """moment -> the device allocator's slack on top of the live set, bytes (``floors``: the least
    slack of a moment, :func:`_slack_floors`)."""
    if ts.device == "cuda":
        return cuda.allocator_slack(totals, t.runtime_overhead, floors=floors)
    if ts.device == "mps":
        return mps.allocator_slack(totals, t.runtime_overhead)
    if ts.device == "cpu":
        return cpu_heap.heap_slack(ms, ts, gradients=t.gradients, param_bytes=t.param_bytes, logits=t.logits)
    return {k: 0 for k in totals}  # mlx: mx.get_peak_memory() counts the buffers alone


def _closing_notes(ms: ModelSpec, ts: TrainSpec, t: StepTerms, head_moment: Optional[str]) -> List[str]:
    """The assumptions behind this estimate's rules, in report order."""
    notes = block_kind_notes(ms, ts)
    head = head_of(ms)
    if not head.is_lm:
        notes.append(f"head: {head.kind.replace('_', ' ')}, {head.num_labels} output features (no vocabulary logits)")
    if ts.grad_checkpoint:
        notes.append("gradient checkpointing: one block input per layer + one recomputed block")
    if ts.method == "qlora" and ms.weight_bits >= 8:
        notes.append(f"QLoRA: block linears stored as NF4 ({NF4_BITS} bits)")
    if ts.model_code != "litgpt" and dequant_transient_bytes(ms, ts):
        if weight_bits(ms, ts) >= 8 or bnb_4bit_keeps_input(ts):
            notes.append("bitsandbytes: each quantized linear keeps its input for the backward "
                         "(MatMul4Bit/MatMul8bitLt ctx.tensors) and dequantizes one weight at a time")
        else:
            notes.append("bitsandbytes >= 0.43.2: 4-bit linears keep no input; one weight dequantized at a time")
    if t.last_step:
        notes.append("bitsandbytes: the loop keeps the last step's output, and with it the quantized "
                     "linears' inputs of that step (ctx attributes) into the next forward")
    if ts.paged and ts.device == "cuda":
        notes.append("paged optimizer: states of tensors from 1e5 elements on in CUDA unified memory "
                     "(outside max_memory_allocated / max_memory_reserved)")
    if ts.device == "cuda":
        notes.append(f"cuda: SDPA kernel {cuda.cuda_sdpa_backend(ms, ts)}")
    if ts.device == "cpu" and ts.framework != "mlx":
        notes.append(cpu_heap.slack_note(ts))
    if t.kept_gradient:
        notes.append("LitGPT >= 0.5 QLoRA: the StableEmbedding it swaps in trains outside the optimizer -- its "
                     "dense gradient stays from the first backward on")
    if head_moment is not None:
        notes.append(litgpt.note(ts, head_moment))
    notes.append(runtime_source(ts))
    return notes
