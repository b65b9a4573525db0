"""How many rows a HF batch holds, for the guarded step and the evaluation split (packed batches:
their sequences); docs/lifecycle.md.
"""

from __future__ import annotations

import torch

from memguard_torch import microbatch as torch_microbatch

__all__ = ["units_of", "rows_of"]


def units_of(inputs) -> int:
    """Units a batch can be cut into: rows, or packed sequences (1 when it cannot be cut)."""
    try:
        seqs = torch_microbatch.sequence_starts(inputs)
        return len(seqs) if seqs is not None else torch_microbatch.batch_rows(inputs)
    except Exception:
        return 1


def rows_of(inputs) -> int:
    """Rows of a forward (packed: sequences). A packed batch on an accelerator is counted on
    the device (a 0-dim tensor, resolved at ``on_step_end``): ``sequence_starts`` would copy
    its ``position_ids`` to the host and synchronise the device at every micro-batch."""
    try:
        rows = torch_microbatch.batch_rows(inputs)
    except ValueError:
        return 0
    pos = inputs.get("position_ids")
    if rows == 1 and torch.is_tensor(pos) and pos.dim() == 2 and pos.device.type != "cpu":
        p = pos[0]
        return ((p == 0).sum() + (p[0] != 0).long()).clamp(min=1)
    seqs = torch_microbatch.sequence_starts(inputs)
    return rows if seqs is None else len(seqs)
