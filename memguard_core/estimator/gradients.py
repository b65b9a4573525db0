"""The gradients term: which blocks the backward passes through and the dense embedding-gradient
copies beyond ``.grad``. docs/estimator.md, "Embedding-gradient copies".
"""

from __future__ import annotations

from typing import Tuple

from .trainable import num_lora_layers
from .specs import ModelSpec, TrainSpec


#: Dense V x h gradient tensors beyond ``.grad`` in an HF full fine-tune (torch autograd; see
#: ``embedding_grad_transients``), by (tied head, accumulating gradients):
#: * tied: the head's and the embedding's uses of the one weight share one ``AccumulateGrad`` node,
#:   so the head's V x h gradient waits in the node's input buffer the whole backward; at the end
#:   ``embedding_dense_backward`` makes a dense V x h gradient and the buffer sums the two
#:   (``torch/csrc/autograd/input_buffer.cpp``): 2 tensors beyond the one ``.grad`` counts.
#: * untied, not accumulating: ``AccumulateGrad`` steals the fresh head gradient and the fresh
#:   embedding gradient into ``.grad`` (``torch/csrc/autograd/functions/accumulate_grad.h``: the
#:   new gradient becomes ``.grad`` when none exists): nothing beyond ``.grad``.
#: * untied, accumulating (``grad_accum > 1``, from the 2nd micro-batch on): each new V x h
#:   gradient is added into the existing ``.grad`` (``variable_grad += new_grad``) -- one copy, at
#:   the end of the backward (the embedding) and at its start (the head, while the activations and
#:   the logits' gradients are still alive: counted at the ``loss`` moment).
#: Checked against bench cases (a tied and an untied model); docs/estimator.md, "Embedding-gradient
#: copies".
EMBEDDING_GRAD_COPIES = {(True, False): 2, (True, True): 2, (False, False): 0, (False, True): 1}


def grad_layers(ms: ModelSpec, ts: TrainSpec) -> int:
    """Blocks the backward passes through: all blocks when anything below the top needs a gradient
    (full fine-tune of the embeddings; HF + gradient checkpointing makes the embedding output require
    grad via ``enable_input_require_grads``), else from the lowest trainable block up."""
    if ts.method == "full" and ts.framework != "mlx":
        return ms.num_layers
    if ts.grad_checkpoint and ts.framework == "hf":
        return ms.num_layers
    return num_lora_layers(ms, ts)


def embedding_grad_transients(ms: ModelSpec, ts: TrainSpec, pb: int) -> Tuple[int, int]:
    """Dense V x h gradients beyond ``.grad`` of an HF/Lightning full fine-tune, bytes:
    (end of the backward, start of the backward). ``EMBEDDING_GRAD_COPIES[(tied, accumulating)]``
    x V x h x ``pb`` (the trainable parameter's bytes) at the end; at the start, one copy when the
    head is untied and gradients accumulate (its new gradient before ``+=`` into ``.grad``).
    Zero for LoRA (frozen embeddings) and MLX (mlx_lm does not train the embeddings)."""
    if ts.method != "full" or ts.framework == "mlx":
        return 0, 0
    vh = ms.vocab_size * ms.hidden_size * pb
    tied = bool(ms.tie_word_embeddings)
    acc = ts.grad_accum > 1
    return EMBEDDING_GRAD_COPIES[(tied, acc)] * vh, (vh if (acc and not tied) else 0)
