"""Cutting one torch training batch into micro-batches whose accumulated gradient equals the
unsplit batch's: padded rows cut along the batch dimension, padding-free / packed batches (one row,
``position_ids`` restarting at 0) cut at sequence boundaries with the flash-attention
``cu_seq_lens_*`` / ``max_length_*`` keys rebuilt, preference batches cut by pairs; each micro-batch
weighted by its share of valid labels or rows. The design: docs/lifecycle.md, "Splitting a batch".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from memguard_core.microbatch import merge_empty, split_count

__all__ = ["Chunk", "BatchSplitter", "split_batch", "batch_rows", "sequence_starts", "IGNORE_INDEX"]

IGNORE_INDEX = -100
_FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass
class Chunk:
    """One micro-batch chunk: its inputs, its loss weight and its size."""

    inputs: Dict[str, Any]
    weight: float
    rows: int
    valid_labels: int


def batch_rows(inputs: Mapping[str, Any]) -> int:
    """Rows (dim 0) of the batch: of ``input_ids`` if present, else of the first tensor.

    Raises:
        ValueError: no tensor with a batch dimension in ``inputs``.
    """
    t = inputs.get("input_ids")
    if not torch.is_tensor(t) or t.dim() == 0:
        t = next((v for v in inputs.values() if torch.is_tensor(v) and v.dim() > 0), None)
    if t is None:
        raise ValueError("batch has no tensor with a batch dimension; cannot split it")
    return int(t.shape[0])


def sequence_starts(inputs: Mapping[str, Any]) -> Optional[List[int]]:
    """Token offsets where packed sequences start, when the batch is padding-free/packed.

    A batch is packed when it has one row and ``position_ids`` restart at 0 more than once.
    Returns ``None`` for an ordinary padded batch.
    """
    pos = inputs.get("position_ids")
    if not torch.is_tensor(pos) or pos.dim() != 2 or pos.shape[0] != 1:
        return None
    starts = torch.nonzero(pos[0] == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return starts if len(starts) > 1 else None


def _shifted_valid(labels: Any, shift: bool) -> Any:
    """Per-position validity of the labels the loss uses (shifted by one for causal LMs)."""
    lab = labels[..., 1:] if shift else labels
    return lab.ne(IGNORE_INDEX)


def _slice_rows(inputs: Mapping[str, Any], a: int, b: int, rows: int) -> Dict[str, Any]:
    out = {}
    for key, v in inputs.items():
        if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows:
            out[key] = v[a:b]
        else:
            out[key] = v
    return out


def _slice_pairs(inputs: Mapping[str, Any], a: int, b: int, pairs: int) -> Dict[str, Any]:
    """Pairs ``a..b`` of a batch that stacks ``pairs`` first rows, then their ``pairs`` partners
    (rows ``a..b`` and ``pairs+a..pairs+b``); per-pair tensors (``pairs`` rows) give rows ``a..b``."""
    out = {}
    for key, v in inputs.items():
        if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == 2 * pairs:
            out[key] = torch.cat((v[a:b], v[pairs + a:pairs + b]))
        elif torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == pairs:
            out[key] = v[a:b]
        else:
            out[key] = v
    return out


def _slice_tokens(inputs: Mapping[str, Any], a: int, b: int, tokens: int) -> Dict[str, Any]:
    out = {}
    for key, v in inputs.items():
        if key in _FLASH_KEYS:
            continue
        if torch.is_tensor(v) and v.dim() >= 2 and v.shape[0] == 1 and v.shape[1] == tokens:
            out[key] = v[:, a:b]
        else:
            out[key] = v
    if any(k in inputs for k in _FLASH_KEYS) and "position_ids" in out:
        pos = out["position_ids"][0]
        starts = torch.nonzero(pos == 0).flatten()
        cu = torch.cat([starts, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max().item())
        for key in _FLASH_KEYS:
            if key in inputs:
                out[key] = cu if key.startswith("cu_") else longest
    return out


class BatchSplitter:
    """Cuts one batch into contiguous unit ranges (rows, or packed sequences) and weights them.

    The weight of a unit is fixed once per batch (its share of valid shifted labels, or of rows),
    and the weight of a chunk is the sum over its units. Any partition of the units therefore
    accumulates the same gradient, which is what lets an OOM retry re-cut only the units not yet
    processed.

    Args:
        inputs: the batch dict as the Trainer passes it (tensors of shape ``(B, S, ...)``, or
            ``(1, T)`` packed with ``position_ids``).
        weighting: ``tokens`` (share of valid shifted labels: token-mean losses such as HF causal
            LM) or ``rows`` (share of rows / sequences: per-sample mean losses).
        shift_labels: labels are shifted by one inside the loss (causal LM); never for labels of
            one dimension (one label per row).
        label_key: key of the labels tensor.
        paired: the rows are pairs stacked in halves (``2P`` rows: ``P`` first rows, then their
            partners, as TRL's preference trainers stack chosen and rejected): a unit is a pair.

    Raises:
        ValueError: unknown ``weighting``, no batch dimension, or ``paired`` with an odd number of rows.
    """

    def __init__(self, inputs: Mapping[str, Any], *, weighting: str = "tokens",
                 shift_labels: bool = True, label_key: str = "labels", paired: bool = False):
        if weighting not in ("tokens", "rows"):
            raise ValueError(f"weighting must be 'tokens' or 'rows', got {weighting!r}")
        self.inputs = inputs
        labels = inputs.get("shift_labels")
        shift = shift_labels
        if torch.is_tensor(labels):
            shift = False
        else:
            labels = inputs.get(label_key)
        self.has_labels = torch.is_tensor(labels)
        if self.has_labels and labels.dim() < 2:
            shift = False
        self.rows = batch_rows(inputs)
        self.paired = paired
        if paired and self.rows % 2:
            raise ValueError(f"a paired batch needs an even number of rows, got {self.rows}")
        starts = None if paired else sequence_starts(inputs)
        self.packed = starts is not None
        if paired:
            pairs = self.rows // 2
            self.bounds = [(p, p + 1) for p in range(pairs)]
            self.valid = [1] * pairs
            self.size = [1] * pairs
            self.has_labels = False
        elif self.packed:
            self.tokens = int(inputs["position_ids"].shape[1])
            self.bounds = list(zip(starts, starts[1:] + [self.tokens]))
            if self.has_labels:
                valid = labels[0].ne(IGNORE_INDEX)
                off = 1 if shift else 0
                self.valid = [int(valid[a + off:b].sum().item()) for a, b in self.bounds]
            else:
                self.valid = [b - a for a, b in self.bounds]
            self.size = [b - a for a, b in self.bounds]
        else:
            self.bounds = [(r, r + 1) for r in range(self.rows)]
            if self.has_labels and labels.dim() >= 1 and labels.shape[0] == self.rows:
                self.valid = _shifted_valid(labels, shift).reshape(self.rows, -1).sum(dim=1).tolist()
            else:
                self.valid = [1] * self.rows
            self.size = [1] * self.rows
        total_valid = sum(self.valid)
        if weighting == "tokens" and self.has_labels and total_valid > 0:
            self.unit_weight = [v / total_valid for v in self.valid]
        else:
            self.unit_weight = [1.0 / len(self.bounds)] * len(self.bounds)

    @property
    def units(self) -> int:
        """Number of units: rows, or packed sequences."""
        return len(self.bounds)

    def ranges(self, k: int, start: int = 0) -> List[Tuple[int, int]]:
        """Unit ranges ``[(u0, u1), ...]`` covering units ``start..units`` in at most ``k`` chunks of
        near-equal size; ranges without valid labels are merged into a neighbour."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        sub = split_count(self.size[start:], k)
        ranges = [(a + start, b + start) for a, b in sub]
        if self.has_labels and len(ranges) > 1:
            valid = [sum(self.valid[a:b]) for a, b in ranges]
            ranges, _ = merge_empty(ranges, valid)
        return ranges

    def chunk(self, u0: int, u1: int) -> Chunk:
        """The inputs of units ``u0..u1`` and their loss weight."""
        if u0 == 0 and u1 == self.units:
            inputs = dict(self.inputs)
        elif self.paired:
            inputs = _slice_pairs(self.inputs, u0, u1, self.units)
        elif self.packed:
            inputs = _slice_tokens(self.inputs, self.bounds[u0][0], self.bounds[u1 - 1][1], self.tokens)
        else:
            inputs = _slice_rows(self.inputs, u0, u1, self.rows)
        return Chunk(inputs, float(sum(self.unit_weight[u0:u1])), u1 - u0, int(sum(self.valid[u0:u1])))


def split_batch(inputs: Mapping[str, Any], k: int, *, weighting: str = "tokens",
                shift_labels: bool = True, label_key: str = "labels") -> List[Chunk]:
    """Cut a batch into at most ``k`` chunks whose loss weights sum to 1 (see ``BatchSplitter``).

    Fewer than ``k`` chunks come back when there are fewer units (rows or packed sequences) or
    when chunks without valid labels were merged.

    Raises:
        ValueError: ``k < 1``, unknown ``weighting``, or no batch dimension.
    """
    sp = BatchSplitter(inputs, weighting=weighting, shift_labels=shift_labels, label_key=label_key)
    return [sp.chunk(a, b) for a, b in sp.ranges(k)]
