"""The HF adapter's loss-weight rules (memguard_hf.loss_weights): the count probe sees a loss that
computes with ``num_items_in_batch`` and not one that only carries or ignores it; TRL's paired
layout and the DPO losses a split cannot reproduce. The equivalence runs themselves are in
integration_tests/test_split_equivalence.py."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memguard_torch.microbatch import BatchSplitter  # noqa: E402
from memguard_hf import _compat  # noqa: E402
from memguard_hf.loss_weights import LossWeights, watch_items  # noqa: E402


def test_the_probe_sees_a_division_through_moves():
    loss = torch.tensor(6.0, requires_grad=True)
    n, used = watch_items(torch.tensor(3))
    moved = torch.as_tensor(n.to(loss.device)).detach()
    assert used == [False]                   # moves and copies only carry the count
    out = loss / moved
    assert used == [True]
    assert type(out) is torch.Tensor         # nothing downstream is a probe
    out.backward()
    assert loss.grad.item() == pytest.approx(1 / 3)


def test_the_probe_stays_unused_when_ignored_or_only_read():
    n, used = watch_items(torch.tensor(5))
    _ = (n.shape, n.dtype, n.device, n.dim(), repr(n))
    assert used == [False]
    n.item()
    assert used == [True]                    # taking its value is using it


def test_no_probe_for_numbers_or_none():
    assert watch_items(None) == (None, None)
    assert watch_items(7) == (7, None)


def test_python_number_count_falls_back_to_the_trainers_rule():
    rules = LossWeights(types.SimpleNamespace(loss_is_scaled_for_ga=None, model_accepts_loss_kwargs=True,
                                              compute_loss_func=None), "auto")
    inputs = {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)}
    assert rules.weight(0.25, None, 40, inputs) == 1.0
    assert rules.weight(0.25, [False], 40, inputs) == 0.25
    assert rules.weight(0.25, [True], 40, inputs) == 1.0


def test_paired_batches_keep_pairs_together():
    ids = torch.arange(8)[:, None].repeat(1, 3)          # rows 0-3 chosen, 4-7 rejected
    margin = torch.tensor([0.1, 0.2, 0.3, 0.4])
    sp = BatchSplitter({"input_ids": ids, "margin": margin}, weighting="rows", paired=True)
    assert sp.units == 4
    chunk = sp.chunk(1, 3)
    assert chunk.inputs["input_ids"][:, 0].tolist() == [1, 2, 5, 6]
    assert chunk.inputs["margin"].tolist() == pytest.approx([0.2, 0.3])
    assert chunk.weight == pytest.approx(0.5)
    with pytest.raises(ValueError, match="even number of rows"):
        BatchSplitter({"input_ids": torch.ones(3, 2)}, paired=True)


def test_one_label_per_row_is_never_shifted():
    sp = BatchSplitter({"input_ids": torch.ones(4, 5, dtype=torch.long), "labels": torch.tensor([0, 1, -100, 2])},
                       weighting="tokens", shift_labels=True)
    assert sp.valid == [1, 1, 0, 1]


def test_dpo_losses_that_couple_pairs_are_refused():
    trl = pytest.importorskip("trl")

    def fake(loss_types, aux=False):
        # a DPOTrainer without its __init__ (which needs a model and data): only the attributes read
        t = trl.DPOTrainer.__new__(trl.DPOTrainer)
        t.loss_types, t.aux_loss_enabled = loss_types, aux
        return t

    assert _compat.trl_pair_trainer(fake(["sigmoid"])) == "dpo"
    assert _compat.trl_unsplittable_loss(fake(["sigmoid", "ipo"])) is None
    assert "aot" in _compat.trl_unsplittable_loss(fake(["sigmoid", "aot"]))
    assert "sft" in _compat.trl_unsplittable_loss(fake(["sft"]))
    assert "router" in _compat.trl_unsplittable_loss(fake(["sigmoid"], aux=True))
    assert _compat.trl_pair_trainer(object()) is None
