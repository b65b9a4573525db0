"""The blocks of a model whose kinds the rules do not model (:attr:`ModelSpec.block_kinds`): their
saved activations from the census figure a trace measured, in place of the rules' figure for those
blocks, and the notes that name every such kind. docs/estimator.md, "Block kinds".
"""

from __future__ import annotations

from typing import List, Tuple

from .specs import BlockKind, ModelSpec, TrainSpec, trace_key

__all__ = ["with_traced_blocks", "how_counted", "block_kind_notes"]


def with_traced_blocks(ms: ModelSpec, ts: TrainSpec, hidden: int, scores: int, lora: int,
                       one_block: int) -> Tuple[int, int, int, int]:
    """The activation terms of :func:`memguard_core.estimator.activations.activation_bytes` with the
    traced blocks counted from their census.

    Without checkpointing, the rules' ``hidden`` / ``scores`` / ``lora`` (which count every block as
    a modelled one) keep the share of the blocks the census did not measure, and the traced blocks
    add ``count x saved_per_token x tokens`` (the census counts the LoRA inputs and the attention
    tensors such a block saves, so all three rule terms give way). With checkpointing every block
    keeps its input (the rules' figure stands) and the recomputed block is the largest of one rule
    block and one traced block.

    Args:
        ms / ts: the specs; ``hidden`` ... ``one_block``: bytes, as ``activation_bytes`` returns them.

    Returns:
        ``(hidden, scores, lora, one_block)`` in bytes for the micro-batch.
    """
    traced = [k for k in ms.block_kinds if how_counted(k, ts) == "traced"]
    if not traced:
        return hidden, scores, lora, one_block
    tokens = ts.batch_size * ts.seq_length
    one_traced = max(int(k.saved_per_token * tokens) for k in traced)
    one = max(one_block, one_traced)
    if ts.grad_checkpoint:
        return hidden, scores, lora, one
    n_traced = sum(k.count for k in traced)
    keep = max(ms.num_layers - n_traced, 0) / ms.num_layers
    added = sum(k.count * k.saved_per_token for k in traced) * tokens
    return int(hidden * keep + added), int(scores * keep), int(lora * keep), one


def how_counted(k: BlockKind, ts: TrainSpec) -> str:
    """How the estimate counts one block kind: ``rules`` (modelled), ``traced`` (its own figure,
    from a census of the model's code on fake tensors under PyTorch, or measured on MLX's backend
    under mlx_lm: ``traced_under`` ends in ``mlx``) or ``rules (not modelled, not traced)`` (no figure
    for this framework: counted as a decoder block of the rules, never as zero)."""
    if k.modelled:
        return "rules"
    if k.saved_per_token is None or (ts.framework == "mlx") != (k.traced_under or "").endswith(" mlx"):
        return "rules (not modelled, not traced)"
    return "traced"


def block_kind_notes(ms: ModelSpec, ts: TrainSpec) -> List[str]:
    """One note per block kind the rules do not model: traced (with its figure, how it was taken,
    and whether it was traced under other settings) or counted as a rule block (never as zero)."""
    notes = []
    mlx = ts.framework == "mlx"
    for k in ms.block_kinds:
        if k.modelled:
            continue
        if how_counted(k, ts) != "traced":
            why = ("no measurement of it on MLX's backend" if mlx else
                   "give a transformers config or the live model to trace it")
            notes.append(f"not modelled, not traced: {k.name} x {k.count} counted as a decoder block of the "
                         f"rules ({why})")
            continue
        how = ("one block's value_and_grad measured on MLX's backend" if mlx else
               "a census of the model's code on fake tensors")
        note = f"traced: {k.name} x {k.count} ({k.saved_per_token / 1024:.1f} KiB saved per token per block, {how})"
        if not mlx and k.traced_under and k.traced_under != trace_key(ts):
            note += f"; traced under other settings ({k.traced_under})"
        notes.append(note)
    return notes
