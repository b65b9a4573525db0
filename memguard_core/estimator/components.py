"""The kind of a parameter inside a transformer block read from its module path (attention, MLP,
experts, shared experts, router): one classifier for every route that counts parameters (a config
built on the meta device, a live torch module, an mlx_lm module), so they split a model alike.
"""

from __future__ import annotations

__all__ = ["component_kind"]

_ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate", "e_score_correction_bias"})
_SHARED_EXPERT_NAMES = frozenset({"shared_expert", "shared_experts", "shared_mlp"})
_MLP_NAMES = frozenset({"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "feedforward"})


def component_kind(parts: list, is_moe: bool) -> str:
    """Kind of a parameter inside a block from its dotted path (numeric parts removed).

    Order matters: router before experts (``mlp.gate``), shared experts before experts.
    """
    if is_moe and any(p in _ROUTER_NAMES for p in parts):
        return "router"
    if any(p in _SHARED_EXPERT_NAMES for p in parts):
        return "shared_experts"
    if "experts" in parts:
        return "experts"
    if any("attn" in p.lower() or "attention" in p.lower() for p in parts):
        return "attention"
    if any(p in _MLP_NAMES or "mlp" in p.lower() or "ffn" in p.lower() for p in parts):
        return "mlp"
    return "other"
