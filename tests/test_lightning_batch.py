"""Cutting Lightning batches of every shape the dataloader may yield (dict, tuple, namedtuple, bare
tensor, nested, with row lists of strings), and the callback's argument checks."""

from __future__ import annotations

from collections import namedtuple

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

from memguard_core.errors import ConfigError  # noqa: E402
from memguard_lightning import MemGuardCallback  # noqa: E402
from memguard_lightning.batch import LightningBatchSplitter, batch_units  # noqa: E402


def _cut(batch, k, **kw):
    sp = LightningBatchSplitter(batch, **kw)
    return [sp.chunk(a, b) for a, b in sp.ranges(k)]


def test_tuple_batch_keeps_structure_and_weights_by_label_tokens():
    x = torch.arange(4 * 3).reshape(4, 3)
    y = torch.tensor([[1, 1, 1], [1, -100, -100], [1, 1, -100], [-100, -100, 1]])  # 3, 1, 2, 1 valid
    chunks = _cut((x, y), 2)
    assert [type(c) for c, _, _ in chunks] == [tuple, tuple]
    assert torch.equal(torch.cat([c[0] for c, _, _ in chunks]), x)
    assert torch.equal(torch.cat([c[1] for c, _, _ in chunks]), y)
    assert [w for _, w, _ in chunks] == pytest.approx([4 / 7, 3 / 7])  # rows 0-1: 4 of 7 labels


def test_rows_weighting_and_namedtuple():
    B = namedtuple("B", "x y")
    b = B(torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2]))
    chunks = _cut(b, 3, weighting="rows")
    assert all(isinstance(c, B) for c, _, _ in chunks)
    assert [c.x.shape[0] for c, _, _ in chunks] == [2, 2, 2]
    assert [w for _, w, _ in chunks] == pytest.approx([1 / 3] * 3)


def test_dict_with_nested_and_row_lists():
    batch = {"input_ids": torch.ones(4, 5, dtype=torch.long), "labels": torch.ones(4, 5, dtype=torch.long),
             "text": ["a", "b", "c", "d"], "meta": {"ids": torch.arange(4), "scale": 2.0}, "step": 7}
    chunks = _cut(batch, 2)
    first = chunks[0][0]
    assert first["text"] == ["a", "b"] and first["meta"]["ids"].tolist() == [0, 1]
    assert first["meta"]["scale"] == 2.0 and first["step"] == 7
    assert first["input_ids"].shape == (2, 5)
    assert set(first) == set(batch)


def test_label_key_index_and_bare_tensor():
    x, y, z = torch.randn(4, 2), torch.tensor([[1, 1], [1, 1], [1, -100], [-100, -100]]), torch.zeros(4)
    chunks = _cut([y, x, z], 2, label_key=0)
    assert isinstance(chunks[0][0], list)
    assert sum(w for _, w, _ in chunks) == pytest.approx(1.0)
    # rows 0-1 hold 4 of the 5 valid labels
    assert chunks[0][1] == pytest.approx(4 / 5)
    t = torch.randn(5, 3)
    assert [c.shape[0] for c, _, _ in _cut(t, 2, weighting="rows")] == [3, 2]
    assert batch_units(t) == 5 and batch_units({"a": 1}) == 0


def test_packed_batch_is_cut_at_sequence_boundaries():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = torch.arange(9).unsqueeze(0)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}
    assert batch_units(batch) == 3
    chunks = _cut(batch, 3, shift_labels=True)
    assert [c["input_ids"].shape[1] for c, _, _ in chunks] == [3, 2, 4]


@pytest.mark.parametrize("kwargs,field", [
    ({"budget_bytes": -1}, "budget_bytes"), ({"loss_weighting": "mean"}, "loss_weighting"),
    ({"split": 0}, "split"), ({"micro_batches": 0}, "micro_batches"), ({"apply": ("seq_length",)}, "apply"),
    ({"label_key": 1.5}, "label_key"),
    ({"seq_length": 0}, "seq_length"), ({"monitor_interval_s": -1}, "monitor_interval_s"),
    ({"safety_ratio": 1.5}, "safety_ratio"), ({"shift_labels": "yes"}, "shift_labels"),
    ({"thresholds": 0.9}, "thresholds"), ({"device": "gpu"}, "device"), ({"fail_fast": "no"}, "fail_fast"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as ei:
        MemGuardCallback(**kwargs)
    assert ei.value.field == field


def test_the_plan_hint_under_manual_optimization_names_chunks_not_accumulate_grad_batches():
    # issue 34 item 6: Lightning refuses accumulate_grad_batches under manual optimization
    from memguard_lightning.callback import plan_hint

    manual = plan_hint(automatic_optimization=False)
    assert "guard.chunks(batch)" in manual and "Trainer(accumulate_grad_batches" not in manual
    assert "Trainer(accumulate_grad_batches=...)" in plan_hint(automatic_optimization=True)
