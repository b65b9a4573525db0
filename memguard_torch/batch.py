"""A loop batch as the flat mapping ``memguard_torch.microbatch.BatchSplitter`` cuts, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict

import torch

from .microbatch import BatchSplitter

__all__ = ["LoopBatch", "batch_units"]


class LoopBatch:
    """A loop batch as the flat mapping ``BatchSplitter`` cuts, and the way back: dict batches are
    cut as they are; a tuple / list of tensors (``(x, y)``) is cut along dimension 0 with its labels
    at ``label_key`` (an index; default the last element); a bare tensor is rows."""

    def __init__(self, batch: Any, label_key: Any):
        self.batch = batch
        if isinstance(batch, Mapping):
            self.kind, self.mapping = "map", dict(batch)
            self.label_name = label_key if isinstance(label_key, str) else "labels"
        elif isinstance(batch, (tuple, list)) and batch and all(torch.is_tensor(v) for v in batch):
            self.kind, self.mapping = "seq", {f"_{i}": v for i, v in enumerate(batch)}
            idx = label_key if isinstance(label_key, int) else (len(batch) - 1 if len(batch) >= 2 else None)
            self.label_name = "labels"
            if idx is not None and -len(batch) <= idx < len(batch):
                self.mapping["labels"] = batch[idx]
        elif torch.is_tensor(batch):
            self.kind, self.mapping, self.label_name = "tensor", {"_0": batch}, "labels"
        else:
            raise ValueError(f"cannot cut a batch of type {type(batch).__name__}")

    def rebuild(self, inputs: Dict[str, Any]) -> Any:
        if self.kind == "map":
            return inputs if isinstance(self.batch, dict) else type(self.batch)(inputs)
        if self.kind == "tensor":
            return inputs["_0"]
        items = [inputs[f"_{i}"] for i in range(len(self.batch))]
        return type(self.batch)(items) if isinstance(self.batch, list) else tuple(items)



def batch_units(batch: Any) -> int:
    """Units a batch can be cut into: rows (packed dict batches: sequences); 1 when it has no batch
    dimension."""
    try:
        flat = LoopBatch(batch, None)
        return BatchSplitter(flat.mapping, weighting="rows", shift_labels=False).units
    except Exception:
        return 1
