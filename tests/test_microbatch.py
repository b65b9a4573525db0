"""Batch cutting and chunk weights (memguard_core.microbatch) on hand-made tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memguard_core.microbatch import split_count
from memguard_torch.microbatch import BatchSplitter, split_batch  # noqa: E402


def padded_batch():
    # 4 rows; valid shifted labels per row: 3, 1, 0, 2  (labels[:, 1:] != -100)
    labels = torch.tensor([
        [5, 6, 7, 8],
        [-100, -100, 7, -100],
        [-100, -100, -100, -100],
        [1, -100, 3, 4],
    ])
    return {"input_ids": torch.arange(16).reshape(4, 4), "labels": labels,
            "attention_mask": torch.ones(4, 4, dtype=torch.long), "return_loss": True}


def test_split_count_ranges_cover_in_order():
    assert split_count([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_count([1] * 5, 2) == [(0, 3), (3, 5)]
    assert split_count([1] * 3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert split_count([10, 1, 1, 10], 2) == [(0, 2), (2, 4)]


def test_token_weights_are_shares_of_valid_shifted_labels():
    chunks = split_batch(padded_batch(), 2)
    # rows 0-1: 3 + 1 valid; rows 2-3: 0 + 2 valid -> weights 4/6, 2/6
    assert [c.rows for c in chunks] == [2, 2]
    assert [c.valid_labels for c in chunks] == [4, 2]
    assert [c.weight for c in chunks] == pytest.approx([4 / 6, 2 / 6])
    assert chunks[0].inputs["input_ids"].tolist() == padded_batch()["input_ids"][:2].tolist()
    assert chunks[0].inputs["return_loss"] is True  # non-tensor values pass through


def test_chunk_without_valid_labels_is_merged_not_skipped():
    chunks = split_batch(padded_batch(), 4)
    # row 2 has no valid label: merged into its predecessor (row 1)
    assert [c.rows for c in chunks] == [1, 2, 1]
    assert sum(c.rows for c in chunks) == 4
    assert [c.valid_labels for c in chunks] == [3, 1, 2]
    assert sum(c.weight for c in chunks) == pytest.approx(1.0)


def test_row_weighting_and_unshifted_labels():
    chunks = split_batch(padded_batch(), 2, weighting="rows")
    assert [c.weight for c in chunks] == pytest.approx([0.5, 0.5])
    sp = BatchSplitter(padded_batch(), shift_labels=False)
    assert sp.valid == [4, 1, 0, 3]


def test_weighted_chunk_means_equal_the_batch_mean():
    """The property the Trainer integration relies on, checked on a real loss."""
    torch.manual_seed(0)
    batch = padded_batch()
    logits = torch.randn(4, 4, 11)
    batch["labels"] = torch.where(batch["labels"] < 0, -100, batch["labels"] % 11)

    def mean_loss(lg, lab):
        return torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, 11), lab[:, 1:].reshape(-1),
                                                 ignore_index=-100)

    full = mean_loss(logits, batch["labels"])
    sp = BatchSplitter(batch)
    for k in (2, 3, 4):
        total = sum(sp.chunk(a, b).weight * mean_loss(logits[a:b], batch["labels"][a:b]) for a, b in sp.ranges(k))
        assert total.item() == pytest.approx(full.item(), rel=1e-6)


def test_packed_batch_is_cut_at_sequence_boundaries():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1]])
    labels = torch.tensor([[-100, 2, 3, -100, 5, -100, 7, 8, 9, -100, 11]])
    batch = {"input_ids": torch.arange(11)[None], "position_ids": pos, "labels": labels,
             "cu_seq_lens_q": torch.tensor([0, 3, 5, 9, 11], dtype=torch.int32), "max_length_q": 4}
    sp = BatchSplitter(batch)
    assert sp.packed and sp.units == 4
    chunks = [sp.chunk(a, b) for a, b in sp.ranges(2)]
    assert [c.inputs["input_ids"].shape[1] for c in chunks] == [5, 6]
    assert chunks[0].inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert chunks[1].inputs["cu_seq_lens_q"].tolist() == [0, 4, 6]
    assert chunks[1].inputs["max_length_q"] == 4
    assert [c.valid_labels for c in chunks] == [3, 4]
    assert sum(c.weight for c in chunks) == pytest.approx(1.0)


def test_ranges_can_restart_after_processed_units():
    sp = BatchSplitter(padded_batch())
    assert sp.ranges(2, start=1) == [(1, 3), (3, 4)]
    with pytest.raises(ValueError):
        sp.ranges(0)
