"""Cutting a Lightning batch (any nesting of dicts, tuples, lists and tensors) into row-chunks.

Lightning passes ``training_step`` whatever the dataloader yields: a dict (HF style, with
``input_ids`` / ``labels`` / ``position_ids``), a tuple ``(x, y)``, a namedtuple, a bare tensor, or
a nesting of these. ``memguard_torch.microbatch.BatchSplitter`` cuts a flat mapping and computes the
loss weights; this module flattens the batch into such a mapping, and rebuilds a batch of the
original structure from each chunk.

Flattening: every tensor with a batch dimension, and every list of non-tensor values (e.g. the
strings ``default_collate`` leaves as a list), is a leaf. Leaves directly under a top-level mapping
keep their key (so ``input_ids``, ``labels``, ``position_ids`` are recognised and packed batches are
cut at sequence boundaries); other leaves are named ``_0``, ``_1``, ... The labels used for token
weights are the leaf named by ``label_key`` (a key of a top-level mapping or an index into a
top-level tuple/list); by default ``labels`` of a mapping, or the last element of a tuple/list of
two or more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple, Union

from memguard_torch import microbatch

LabelKey = Union[str, int, None]


def _is_row_list(obj: Any) -> bool:
    import torch

    return isinstance(obj, list) and bool(obj) and not any(
        torch.is_tensor(v) or isinstance(v, (Mapping, list, tuple)) for v in obj)


class FlatBatch:
    """A batch flattened to named leaves, and rebuilt from sliced leaves.

    Args:
        batch: what the dataloader yielded (after Lightning's transfer to the device).
        label_key: which leaf holds the labels (see the module docstring); ``None`` = default.

    Attributes:
        items: name -> leaf (tensors and row lists), plus a ``labels`` alias when labels are found.
        labels_found: a labels tensor was found.
    """

    def __init__(self, batch: Any, label_key: LabelKey = None):
        import torch

        self.batch = batch
        self.items: Dict[str, Any] = {}
        self._counter = 0
        self._spec = self._walk(batch, top=True)
        labels = None
        if isinstance(batch, Mapping):
            key = label_key if label_key is not None else "labels"
            labels = batch.get(key) if isinstance(key, str) else None
        elif isinstance(batch, (tuple, list)) and not _is_row_list(batch):
            idx = label_key if isinstance(label_key, int) else (len(batch) - 1 if label_key is None and len(batch) >= 2 else None)
            if idx is not None and -len(batch) <= idx < len(batch):
                labels = batch[idx]
        self.labels_found = torch.is_tensor(labels)
        if self.labels_found and "labels" not in self.items:
            self.items["labels"] = labels  # alias, sliced along, ignored when rebuilding

    def _leaf(self, obj: Any, name: Optional[str] = None) -> tuple:
        if name is None or name in self.items:
            name = f"_{self._counter}"
            self._counter += 1
        self.items[name] = obj
        return ("leaf", name)

    def _walk(self, obj: Any, top: bool) -> tuple:
        import torch

        if torch.is_tensor(obj):
            return self._leaf(obj) if obj.dim() > 0 else ("const", obj)
        if _is_row_list(obj):
            return self._leaf(obj)
        if isinstance(obj, Mapping):
            children = []
            for k, v in obj.items():
                if top and isinstance(k, str) and not k.startswith("_") and (
                        (torch.is_tensor(v) and v.dim() > 0) or _is_row_list(v)):
                    children.append((k, self._leaf(v, k)))
                else:
                    children.append((k, self._walk(v, False)))
            return ("map", obj, children)
        if isinstance(obj, (tuple, list)):
            return ("seq", obj, [self._walk(v, False) for v in obj])
        return ("const", obj)

    def rebuild(self, sliced: Mapping[str, Any]) -> Any:
        """A batch of the original structure whose leaves are taken from ``sliced`` (name -> leaf)."""
        return self._build(self._spec, sliced)

    def _build(self, spec: tuple, sliced: Mapping[str, Any]) -> Any:
        kind = spec[0]
        if kind == "leaf":
            return sliced[spec[1]]
        if kind == "const":
            return spec[1]
        orig = spec[1]
        if kind == "map":
            data = {k: self._build(s, sliced) for k, s in spec[2]}
            try:
                return type(orig)(data)
            except Exception:
                return data
        values = [self._build(s, sliced) for s in spec[2]]
        if isinstance(orig, tuple) and hasattr(orig, "_fields"):  # namedtuple
            return type(orig)(*values)
        try:
            return type(orig)(values)
        except Exception:
            return values


class LightningBatchSplitter:
    """Cuts a Lightning batch into unit ranges (rows, or packed sequences) with loss weights.

    Wraps ``memguard_torch.microbatch.BatchSplitter`` (weights: ``tokens`` = share of valid labels,
    ``rows`` = share of rows; see there) over a :class:`FlatBatch`.

    Args:
        batch: the batch ``training_step`` receives.
        weighting: ``tokens`` or ``rows``.
        shift_labels: labels are shifted by one inside the loss (HF causal LMs).
        label_key: see :class:`FlatBatch`.

    Raises:
        ValueError: no tensor with a batch dimension, or an unknown ``weighting``.
    """

    def __init__(self, batch: Any, *, weighting: str = "tokens", shift_labels: bool = False,
                 label_key: LabelKey = None):
        self.flat = FlatBatch(batch, label_key)
        if not any(_tensor_dim(v) for v in self.flat.items.values()):
            raise ValueError("batch has no tensor with a batch dimension; cannot split it")
        tensors = {k: v for k, v in self.flat.items.items() if _tensor_dim(v)}
        self.core = microbatch.BatchSplitter(tensors, weighting=weighting, shift_labels=shift_labels)

    @property
    def units(self) -> int:
        return self.core.units

    @property
    def rows(self) -> int:
        return self.core.rows

    def ranges(self, k: int, start: int = 0) -> List[Tuple[int, int]]:
        return self.core.ranges(k, start)

    def chunk(self, u0: int, u1: int) -> Tuple[Any, float, int]:
        """``(batch_of_units_u0_to_u1, loss_weight, units)``; the batch has the original structure."""
        c = self.core.chunk(u0, u1)
        sliced = dict(c.inputs)
        for name, v in self.flat.items.items():
            if name in sliced:
                continue
            if isinstance(v, list) and not self.core.packed and len(v) == self.core.rows:
                sliced[name] = v[u0:u1]
            else:
                sliced[name] = v
        return self.flat.rebuild(sliced), c.weight, c.rows


def _tensor_dim(v: Any) -> bool:
    import torch

    return torch.is_tensor(v) and v.dim() > 0


def batch_units(batch: Any) -> int:
    """Rows of a batch (packed: sequences); 0 when it has no batch dimension."""
    try:
        flat = FlatBatch(batch)
        tensors = {k: v for k, v in flat.items.items() if _tensor_dim(v)}
        if not tensors:
            return 0
        seqs = microbatch.sequence_starts(tensors)
        return len(seqs) if seqs is not None else microbatch.batch_rows(tensors)
    except Exception:
        return 0
