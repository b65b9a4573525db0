"""The three moments of a training step (``loss``, ``backward``, ``optimizer``) and which of a step's
terms are live at each. docs/estimator.md, "How the peak is composed".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .gradients import grad_layers
from .specs import ModelSpec, TrainSpec

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
    # moment 1: loss (gradients resident only while accumulating)
    loss = dict(weights=t.weights, weight_copies=t.weight_copies,
                gradients=(t.gradients if ts.grad_accum > 1 else 0) + t.kept_gradient,
                optimizer_states=t.optimizer_states, master_weights=t.master_weights, optimizer_temporaries=0,
                backward_transients=t.head_transient,
                activations=t.blocks + t.lora + t.head_inputs + t.recompute + t.last_step + t.vision,
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
