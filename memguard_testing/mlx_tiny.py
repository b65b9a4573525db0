"""Tiny real mlx_lm models and data for the MLX integration tests (random weights, no hub).

Shapes are Llama / Qwen2 layouts (GQA, SwiGLU, RMSNorm; Qwen2 with q/k/v biases and a tied head)
at test scale: MLX's CPU backend runs matmuls at a few GFLOP/s on this machine.
"""

from __future__ import annotations

import numpy as np

import mlx.core as mx
import mlx.optimizers as optim
from mlx_lm.models import llama, qwen2
from mlx_lm.tuner.utils import linear_to_lora_layers

ARCHS = {
    "llama": (llama, dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                          tie_word_embeddings=False)),
    "qwen2": (qwen2, dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=256,
                          tie_word_embeddings=True)),
}


def build_model(arch: str = "llama", *, seed: int = 0, lora_rank: int = 4, lora_layers: int = 2,
                **overrides):
    """A LoRA'd mlx_lm model (mlx_lm's own ``linear_to_lora_layers``: every linear of the last
    ``lora_layers`` blocks), base frozen, as ``mlx_lm.lora`` builds it."""
    mod, cfg = ARCHS[arch]
    cfg = dict(cfg, **overrides)
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs(**cfg))
    model.freeze()
    if lora_rank:
        linear_to_lora_layers(model, lora_layers, {"rank": lora_rank, "scale": 10.0, "dropout": 0.0})
    mx.eval(model.parameters())
    return model


class TokenRows:
    """mlx_lm dataset protocol: ``ds[i] -> (tokens, offset)``, rows of varied lengths (so padding
    and masking matter), with an optional prompt offset (masked prompt tokens)."""

    def __init__(self, n: int = 48, *, vocab: int = 256, min_len: int = 6, max_len: int = 31,
                 seed: int = 1, offsets: bool = True):
        rng = np.random.default_rng(seed)
        self.rows = []
        for i in range(n):
            L = int(rng.integers(min_len, max_len + 1))
            off = int(rng.integers(0, L // 2)) if offsets else 0
            self.rows.append((rng.integers(3, vocab, size=L).tolist(), off))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def schedule_optimizer(lr: float = 1e-2, steps: int = 20):
    """AdamW with a warmup + cosine schedule (mlx_lm ``build_schedule`` style), so the LR differs at
    every update and a shifted update count would show."""
    warm = optim.linear_schedule(0.0, lr, 3)
    cos = optim.cosine_decay(lr, steps)
    return optim.AdamW(learning_rate=optim.join_schedules([warm, cos], [3]))
