"""Model and training specifications: what the estimator and the planner reason about.

``ModelSpec`` describes the architecture (shapes and exact parameter counts by kind);
``TrainSpec`` the training settings. Build a ``ModelSpec`` by introspection, never by hand:
``model_spec_from_hf_config`` (a config.json path, a dict or an ``AutoConfig``, counted exactly on
the meta device), ``model_spec_from_module`` (a live ``torch.nn.Module``, PEFT and bitsandbytes
aware) or ``model_spec_from_numbers`` (the seed's ``preflight(...)`` fields).

This module imports no framework at import time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from .errors import ConfigError, require_choice, require_positive_int

METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adafactor", "adamw-8bit")
DTYPES = ("fp32", "bf16", "fp16")
FRAMEWORKS = ("hf", "lightning", "mlx")
DEVICES = ("cpu", "cuda", "mlx")
ATTN_IMPLS = ("eager", "sdpa", "flash")
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class LinearShape:
    """One linear projection inside a transformer block.

    Attributes:
        name: module name as frameworks spell it (``q_proj``, ``c_attn``, ``gate_proj``, ...).
        in_features / out_features: weight shape is ``(out_features, in_features)``.
        count: how many such modules one block holds (``num_experts`` for expert weights).
        kind: ``attention`` | ``mlp`` | ``experts`` | ``router`` | ``shared_experts``.
        bias: whether the projection has a bias vector.
    """

    name: str
    in_features: int
    out_features: int
    count: int = 1
    kind: str = "attention"
    bias: bool = False

    @property
    def params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts by kind (elements, not bytes). Tied weights are counted once
    (``lm_head`` is 0 when the head is tied to the input embedding).

    ``attention``, ``mlp``, ``experts``, ``router`` and ``norms`` cover all blocks together;
    ``norms`` also holds the final norm; ``embeddings`` holds token (and learned position) embeddings.
    """

    embeddings: int = 0
    attention: int = 0
    mlp: int = 0
    experts: int = 0
    router: int = 0
    norms: int = 0
    lm_head: int = 0
    other: int = 0

    # norms of the blocks only (a subset of ``norms``, without the final norm)
    norms_in_blocks: int = 0

    @property
    def total(self) -> int:
        return (self.embeddings + self.attention + self.mlp + self.experts + self.router
                + self.norms + self.lm_head + self.other)

    @property
    def blocks(self) -> int:
        """Parameters inside the transformer blocks (what mlx_lm's full fine-tune trains)."""
        return self.attention + self.mlp + self.experts + self.router + self.norms_in_blocks

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("norms_in_blocks")
        return d


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as the memory estimator needs it.

    Attributes:
        name: free-form label (model id or config path).
        model_type: HF ``model_type`` (``llama``, ``gpt2``, ``qwen2``, ``mixtral``, ...).
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim:
            the usual config numbers (``num_kv_heads < num_heads`` is GQA).
        num_experts / num_experts_per_tok / moe_intermediate_size: MoE routing (0 for dense).
        tie_word_embeddings: lm_head shares the input embedding.
        params: exact counts by kind (see ``ParamCounts``).
        block_linears: the linear projections of ONE block (used for LoRA sizes and LoRA
            input buffers); blocks are assumed homogeneous.
        weight_bits: storage bits of the block linear weights (32, 16, 8, 4.5 for NF4,
            4.127 for NF4 with double quantization). Embeddings, head and norms are never
            quantized and are stored in ``dense_bits``.
        dense_bits: storage bits of non-quantized weights (32 for fp32, 16 for bf16/fp16).
        trainable_params: exact count of trainable parameters when known from a live module
            (``None``: derive it from the TrainSpec).
        lora_rank_found: LoRA rank found on a live PEFT module (``None`` if none).
        source: ``hf-config`` | ``module`` | ``numbers``.
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: ParamCounts
    block_linears: tuple = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    weight_bits: float = 16.0
    dense_bits: float = 16.0
    trainable_params: Optional[int] = None
    lora_rank_found: Optional[int] = None
    source: str = "numbers"

    @property
    def total_params(self) -> int:
        return self.params.total

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TrainSpec:
    """Training settings that drive memory.

    Attributes:
        batch_size: micro-batch size (rows one forward pass sees), >= 1.
        seq_length: tokens per row (padded length), >= 1.
        grad_accum: gradient accumulation steps (effective batch = batch_size x grad_accum x ranks).
        method: ``full`` | ``lora`` | ``qlora``.
        lora_rank: LoRA rank r.
        lora_targets: module names LoRA wraps, or ``("all-linear",)``.
        lora_layers: LoRA on the last N blocks only (mlx_lm's ``num_layers``); ``None`` = all.
        optimizer: ``adam`` | ``adamw`` | ``sgd`` (no momentum, as HF's ``sgd``) | ``sgd-momentum`` |
            ``adafactor`` | ``adamw-8bit``.
        dtype: compute dtype: ``fp32`` | ``bf16`` | ``fp16``.
        mixed_precision: weights kept in fp32 with autocast to ``dtype`` (HF ``bf16=True`` on fp32
            weights). False: weights are already stored in ``dtype``.
        grad_checkpoint: activation (gradient) checkpointing per block.
        attn_impl: ``eager`` (O(s^2) scores kept) | ``sdpa`` | ``flash`` (O(s)).
        framework: ``hf`` | ``lightning`` | ``mlx`` (whose conventions apply).
        device: which counter the estimate predicts: ``cpu`` (peak RSS, VmHWM), ``cuda`` (peak
            device memory incl. context), ``mlx`` (``mx.get_peak_memory()``).
        ranks: data-parallel ranks (only for the effective batch).
    """

    batch_size: int = 1
    seq_length: int = 512
    grad_accum: int = 1
    method: str = "lora"
    lora_rank: int = 8
    lora_targets: tuple = DEFAULT_LORA_TARGETS
    lora_layers: Optional[int] = None
    optimizer: str = "adamw"
    dtype: str = "bf16"
    mixed_precision: bool = False
    grad_checkpoint: bool = False
    attn_impl: str = "sdpa"
    framework: str = "hf"
    device: str = "cpu"
    ranks: int = 1

    def __post_init__(self) -> None:
        require_positive_int("batch_size", self.batch_size)
        require_positive_int("seq_length", self.seq_length)
        require_positive_int("grad_accum", self.grad_accum)
        require_positive_int("ranks", self.ranks)
        object.__setattr__(self, "method", require_choice("method", self.method, METHODS))
        object.__setattr__(self, "optimizer", require_choice("optimizer", self.optimizer, OPTIMIZERS))
        object.__setattr__(self, "dtype", require_choice("dtype", self.dtype, DTYPES))
        object.__setattr__(self, "attn_impl", require_choice("attn_impl", self.attn_impl, ATTN_IMPLS))
        object.__setattr__(self, "framework", require_choice("framework", self.framework, FRAMEWORKS))
        object.__setattr__(self, "device", require_choice("device", self.device, DEVICES))
        if self.method != "full":
            require_positive_int("lora_rank", self.lora_rank)
        if self.lora_layers is not None:
            require_positive_int("lora_layers", self.lora_layers)
        targets = self.lora_targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError("lora_targets", "a non-empty list of module names or 'all-linear'",
                              self.lora_targets)
        object.__setattr__(self, "lora_targets", tuple(targets))

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step: micro-batch x accumulation x ranks."""
        return self.batch_size * self.grad_accum * self.ranks

    def replace(self, **changes: Any) -> "TrainSpec":
        return dataclasses.replace(self, **changes)
