"""The three moments of a training step (``loss``, ``backward``, ``optimizer``) and which of a step's
terms are live at each. docs/estimator.md, "How the peak is composed".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .gradients import grad_layers
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec

#: The moments, in step order.
MOMENTS = ("loss", "backward", "optimizer")


@dataclass(frozen=True)
class StepTerms:
    """The terms of one step of one process holding the whole model, bytes.

    The model-code rules fill it (``estimate`` for transformers + PEFT, ``litgpt.step_terms`` for
    LitGPT); :func:`compose_moments` places each term at the moments it is live.
    """

    weights: int
    weight_copies: int            #: at the loss moment: autocast copies + a dequantized weight
    backward_weight_copies: int   #: at the end of the backward
    gradients: int
    param_bytes: int              #: bytes of one trainable element as the heap sees it (4 under fp32 masters)
    optimizer_states: int
    master_weights: int
    optimizer_temporaries: int
    blocks: int                   #: the blocks' saved activations, attention scores apart
    lora: int                     #: LoRA inputs saved (MLX: the backward's one-time window)
    one_block: int                #: one block's working set (recomputed under checkpointing)
    head_inputs: int              #: the final norm's and the head's saved inputs
    recompute: int                #: the recomputed block under checkpointing
    last_step: int                #: the last step's quantized-linear inputs a loop keeps
    vision: int                   #: the vision tower's saved activations
    scores: int                   #: the attention scores / logsumexp saved
    mask: int                     #: eager attention's causal mask
    logits: int                   #: the logits and loss working set at the loss moment
    runtime_overhead: int
    embedding_transient: int = 0  #: dense embedding gradients beyond ``.grad`` (end of backward)
    head_transient: int = 0       #: the head's new gradient before ``+=`` (start of backward)
    kept_gradient: int = 0        #: a gradient no optimizer holds (LitGPT's QLoRA StableEmbedding)
    kept_transient: int = 0       #: the new gradient a later backward adds into it


def compose_moments(ms: ModelSpec, ts: TrainSpec, t: StepTerms) -> Dict[str, Dict[str, int]]:
    """moment -> breakdown term -> bytes, for the terms ``t`` (no allocator slack yet)."""
    # moment 1: loss (gradients resident only while accumulating); under checkpointing it also
    # stands for the top block's recompute, which holds the same block inputs (see below)
    loss = dict(weights=t.weights, weight_copies=t.weight_copies,
                gradients=(t.gradients if ts.grad_accum > 1 else 0) + t.kept_gradient,
                optimizer_states=t.optimizer_states, master_weights=t.master_weights, optimizer_temporaries=0,
                backward_transients=t.head_transient,
                activations=t.blocks + t.lora + t.head_inputs + recompute_beyond_logits(ms, ts, t) + t.last_step
                + t.vision,
                attention_scores=t.scores + t.mask, logits=t.logits, runtime_overhead=t.runtime_overhead)
    # moment 2: end of the backward: every gradient, the embedding-gradient transients and the
    # bottom block's working set; the vision tower's backward runs after the decoder's
    one = min(t.one_block, t.blocks + t.lora + t.recompute) if grad_layers(ms, ts) else 0
    bwd = dict(weights=t.weights, weight_copies=t.backward_weight_copies, gradients=t.gradients + t.kept_gradient,
               backward_transients=t.embedding_transient + t.kept_transient,
               optimizer_states=t.optimizer_states, master_weights=t.master_weights, optimizer_temporaries=0,
               activations=one + t.vision, attention_scores=0, logits=0, runtime_overhead=t.runtime_overhead)
    # moment 3: the optimizer step
    opt = dict(weights=t.weights, weight_copies=0, gradients=t.gradients + t.kept_gradient,
               optimizer_states=t.optimizer_states, master_weights=t.master_weights,
               optimizer_temporaries=t.optimizer_temporaries, backward_transients=0, activations=0,
               attention_scores=0, logits=0, runtime_overhead=t.runtime_overhead)
    return {"loss": loss, "backward": bwd, "optimizer": opt}


def top_block_gradient_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of the gradient of the top block's output (batch x tokens x hidden, in the dtype of
    the hidden states between blocks: fp32 under autocast of an fp32 model, else the compute
    dtype): what the backward holds, beside the checkpointed block inputs, while it recomputes the
    top block. For an encoder-decoder the top block is the decoder's last, over the target tokens
    (``TrainSpec.decoder_tokens``)."""
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    tokens = ts.decoder_tokens if ms.decoder_layers else ts.seq_length
    return int(ts.batch_size * tokens * ms.hidden_size * (4 if amp else e))


def recompute_beyond_logits(ms: ModelSpec, ts: TrainSpec, t: StepTerms) -> int:
    """Under activation checkpointing, what the top block's recompute (``t.recompute``) plus the
    gradient of its output (:func:`top_block_gradient_bytes`) hold beyond the logits' working set
    (``t.logits``), bytes; 0 without a recompute (no checkpointing, MLX, LitGPT's terms).

    The two never coexist: torch ``utils/checkpoint.py`` (non-reentrant, as transformers
    ``modeling_utils.py`` ``_activation_checkpointing_enable`` sets ``use_reentrant=False``)
    recomputes a block when the backward first unpacks one of its saved tensors, and for the top
    block that is after the head's backward; by then ``Trainer.training_step`` has dropped the
    model output (``compute_loss`` returns the loss only), so the logits, the loss's fp32 copy and
    ``log_softmax``'s output and gradient are freed. The loss moment, which holds the block inputs
    the recompute holds too, takes the larger of the two working sets: docs/estimator.md,
    "Checkpointed LoRA at full depth". On ``cuda`` the logits' freed segments and the
    checkpointed forward's cached blocks stay reserved beside the live set
    (``cuda.unusable_cache_bytes``), not in it."""
    if not t.recompute:
        return 0
    return max(0, t.recompute + top_block_gradient_bytes(ms, ts) - t.logits)
