"""``memguard_hf.eval.concat_outputs``: the chunks' ``prediction_step`` outputs put back into
the batch's (the integration tests run it inside a real ``Trainer``; these cover the shapes a tiny
model there does not produce: generated tokens of unequal lengths, scalars, nested outputs, outputs
that cannot be combined)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memguard_hf.eval import concat_outputs  # noqa: E402


def test_rows_are_concatenated_in_order():
    batch = torch.arange(24.0).reshape(4, 3, 2)
    out = concat_outputs([batch[:1], batch[1:3], batch[3:]])
    assert torch.equal(out, batch)


def test_packed_chunks_are_concatenated_along_tokens():
    batch = torch.arange(20).reshape(1, 10, 2)
    assert torch.equal(concat_outputs([batch[:, :4], batch[:, 4:]], axis=1), batch)


def test_unequal_lengths_are_padded_with_minus_100():
    a = torch.tensor([[5, 6, 7]])
    b = torch.tensor([[8, 9]])
    out = concat_outputs([a, b])
    assert out.tolist() == [[5, 6, 7], [8, 9, -100]]


def test_nested_outputs_and_scalars():
    la, lb = torch.ones(2, 3), torch.zeros(1, 3)
    out = concat_outputs([(la, {"aux": torch.tensor(2.0)}), (lb, {"aux": torch.tensor(5.0)})],
                         weights=[0.75, 0.25])
    assert isinstance(out, tuple) and out[0].shape == (3, 3)
    assert out[1]["aux"].item() == pytest.approx(0.75 * 2.0 + 0.25 * 5.0)
    assert concat_outputs([None, None]) is None


@pytest.mark.parametrize("pieces", [[object(), object()], [torch.ones(2), None],
                                    [(torch.ones(1),), (torch.ones(1),) * 2]],
                         ids=["object", "none-in-one", "tuple-lengths"])
def test_uncombinable_outputs_raise_type_error(pieces):
    with pytest.raises(TypeError):
        concat_outputs(pieces)
