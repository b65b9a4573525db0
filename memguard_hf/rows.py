"""How many rows a HF batch holds, for the guarded step and the evaluation split (packed batches:
their sequences); docs/lifecycle.md.
"""

from __future__ import annotations

import torch

from memguard_torch import microbatch as torch_microbatch
from memguard_torch.train_reading import longest_in_rows

__all__ = ["units_of", "rows_of", "target_length_of", "longest_target", "image_size_of", "largest_image"]

#: The columns that hold an encoder-decoder's target tokens (its decoder's length), in the order read:
#: ``DataCollatorForSeq2Seq`` pads ``labels``; a model given ``decoder_input_ids`` runs on those.
TARGET_COLUMNS = ("decoder_input_ids", "labels")


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


def target_length_of(row) -> int:
    """An encoder-decoder's target tokens in one dataset row or collated batch: the last dimension
    of its ``decoder_input_ids``, else of its ``labels`` (a tensor, a list of ids, or a batch of
    such lists: the longest); 0 when it has neither (a mapping is needed: tuple rows name no
    column)."""
    if not hasattr(row, "get"):
        return 0
    for name in TARGET_COLUMNS:
        v = row.get(name)
        if torch.is_tensor(v):
            return int(v.shape[-1]) if v.dim() > 0 else 0
        if isinstance(v, (list, tuple)) and v:
            # a batch of unpadded lists: its longest row
            return max(len(x) for x in v) if isinstance(v[0], (list, tuple)) else len(v)
    return 0


def longest_target(dataset, scan_rows: int = 2048) -> int:
    """The longest target (:func:`target_length_of`) among the first ``scan_rows`` rows of a
    map-style dataset, as ``memguard_torch.train_reading.infer_seq_length`` scans its inputs; 0 for
    none (an iterable dataset, no target column, a row that raises)."""
    return longest_in_rows(dataset, target_length_of, scan_rows)


def image_size_of(row) -> int:
    """The side in pixels of the image in one dataset row or collated batch: the last dimension of
    its ``pixel_values`` (``(channels, height, width)`` or ``(rows, channels, height, width)``, a
    tensor or nested lists); 0 without one (a mapping is needed). A non-square image gives its
    larger side (the patch count then over-counts: an image classifier's config is square)."""
    if not hasattr(row, "get"):
        return 0
    v = row.get("pixel_values")
    if v is None:
        return 0
    if not torch.is_tensor(v):
        v = torch.as_tensor(v)
    return int(max(v.shape[-2:])) if v.dim() >= 2 else 0


#: Rows of an image dataset read for the image side at train start: an image processor gives every
#: row its one size, and each read can decode an image.
IMAGE_SCAN_ROWS = 16


def largest_image(dataset, scan_rows: int = IMAGE_SCAN_ROWS) -> int:
    """The largest image side (:func:`image_size_of`) among the first ``scan_rows`` rows of a
    map-style dataset; 0 for none (an iterable dataset, no ``pixel_values`` column)."""
    return longest_in_rows(dataset, image_size_of, scan_rows)
