"""The seed product's estimate of a bench case: ``ml-memguard``'s ``memory_guard.estimate_training_memory``
(when installed) for the same model and settings, scored beside memguard's (``--seed``).
docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["seed_estimate_bytes"]

MiB = 1 << 20


def seed_estimate_bytes(ms, ts) -> Optional[int]:
    """The seed product's estimate (``ml-memguard``'s ``memory_guard.estimate_training_memory``,
    when installed) for the same model and settings, in bytes; None when it is not installed or
    refuses the input. Mapping: total parameters, hidden / heads / kv heads / layers /
    intermediate size, weight bits, MoE experts; method, micro-batch, sequence, LoRA rank, LoRA
    layers (all blocks unless limited), number of LoRA'd projections per block, optimizer,
    checkpointing, accumulation, mixed precision (= a half compute dtype), flash attention
    (= not eager), MLX lazy evaluation for MLX runs."""
    try:
        import memory_guard as mg  # noqa: F401
        from memory_guard.estimator import (FinetuneMethod, ModelArch, ModelSpec as SMS, TrainSpec as STS,
                                            estimate_training_memory)
    except Exception:
        return None
    try:
        from memguard_core.estimator.trainable import lora_linears

        n_targets = len(lora_linears(ms, ts)) if ts.method != "full" else 0
        moe = ms.num_experts > 1
        sm = SMS(params=int(ms.total_params), hidden_dim=ms.hidden_size, num_heads=ms.num_heads,
                 num_kv_heads=ms.num_kv_heads, num_layers=ms.num_layers,
                 intermediate_dim=ms.moe_intermediate_size or ms.intermediate_size,
                 bits=int(min(32, max(4, round(ms.dense_bits)))),
                 arch=ModelArch.MOE if moe else ModelArch.DENSE,
                 num_experts=max(1, ms.num_experts), num_active_experts=max(1, ms.num_experts_per_tok))
        method = {"full": FinetuneMethod.FULL, "lora": FinetuneMethod.LORA, "qlora": FinetuneMethod.QLORA}[ts.method]
        opt = {"adamw-8bit": "adamw"}.get(ts.optimizer, ts.optimizer)
        st = STS(method=method, batch_size=ts.batch_size, seq_length=ts.seq_length, lora_rank=ts.lora_rank,
                 lora_layers=ts.lora_layers or ms.num_layers, lora_targets=max(1, n_targets),
                 optimizer=opt.replace("sgd-momentum", "sgd"), grad_checkpoint=ts.grad_checkpoint,
                 grad_accumulation=ts.grad_accum, mixed_precision=ts.dtype != "fp32",
                 flash_attention=ts.attn_impl != "eager", lazy_evaluation=ts.framework == "mlx")
        return int(estimate_training_memory(model=sm, train=st).total_mb * MiB)
    except Exception:
        return None
