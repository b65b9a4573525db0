"""The gradients term: which blocks the backward passes through and the dense embedding-gradient
copies beyond ``.grad``. docs/estimator.md, "Embedding-gradient copies".
"""

from __future__ import annotations

from typing import Tuple

from .trainable import num_lora_layers
from .specs import ModelSpec, TrainSpec


#: Dense V x h gradients beyond ``.grad`` by (tied head, accumulating): autograd's AccumulateGrad / InputBuffer,
#: docs/estimator.md#embedding-gradient-copies.
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
