"""The row the HF adapter's in-process measurement runs on (``memguard_hf.preflight.probe_batch``):
the longest of the training set's first rows, collated by the ``Trainer``'s own collator, with the
random generators as they were. A real ``Trainer`` on CPU over a tiny Llama."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memguard_hf.preflight import PROBE_ROW_CANDIDATES, probe_batch  # noqa: E402
from memguard_testing.hf_tiny import make_trainer, pad_collate  # noqa: E402


class Rows(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.rows = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _trainer(tmp_path, dataset, collate=pad_collate):
    trainer = make_trainer(str(tmp_path), collate=collate)
    trainer.train_dataset = dataset
    return trainer


def test_the_longest_of_the_first_rows_is_measured(tmp_path):
    lengths = [12] * 64
    lengths[5], lengths[9] = 300, 300        # the first of two equally long rows
    lengths[PROBE_ROW_CANDIDATES + 3] = 900  # beyond the rows looked at
    rows = Rows(lengths)
    rows.rows[9]["input_ids"][0] = 7         # tell the two 300-token rows apart
    batch = probe_batch(_trainer(tmp_path, rows))
    assert tuple(batch["input_ids"].shape) == (1, 300)
    assert int(batch["input_ids"][0, 0]) == 1   # row 5, not row 9


def test_rows_tokenized_as_tensors_are_measured_by_their_tokens(tmp_path):
    # a row tokenized with return_tensors="pt" is 1 x tokens: its length is its last dimension
    rows = Rows([20, 300, 50])
    for r in rows.rows:
        r["input_ids"] = torch.tensor([r["input_ids"]])
        r["labels"] = r["input_ids"].clone()

    def collate(batch):
        return {k: torch.cat([r[k] for r in batch]) for k in ("input_ids", "labels")}

    assert probe_batch(_trainer(tmp_path, rows, collate=collate))["input_ids"].shape == (1, 300)


def test_a_short_first_row_no_longer_sets_the_size(tmp_path):
    # the case this guards: both probe sizes (256, 512) would have been cut to 12 tokens
    batch = probe_batch(_trainer(tmp_path, Rows([12, 40, 700, 30])))
    assert batch["input_ids"].shape[1] == 700


def test_rows_without_token_ids_give_the_first_row(tmp_path):
    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"pixel_values": torch.full((3, 4, 4), float(i)), "labels": i}

    def stack(rows):
        return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]),
                "labels": torch.tensor([r["labels"] for r in rows])}

    batch = probe_batch(_trainer(tmp_path, Images(), collate=stack))
    assert batch["labels"].tolist() == [0]


def test_the_generators_are_put_back(tmp_path):
    import numpy as np

    class Noisy(Rows):
        def __getitem__(self, i):   # a dataset that augments at random, as image pipelines do
            torch.rand(1)
            random.random()
            np.random.rand()
            return super().__getitem__(i)

    def seed():
        torch.manual_seed(3)
        random.seed(3)
        np.random.seed(3)

    def draws():
        return torch.rand(2).tolist(), random.random(), float(np.random.rand())

    trainer = _trainer(tmp_path, Noisy([10, 50, 20]))
    seed()
    expected = draws()
    seed()
    assert probe_batch(trainer)["input_ids"].shape[1] == 50
    assert draws() == expected


def test_an_iterable_dataset_gives_no_row(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}

    assert probe_batch(_trainer(tmp_path, Stream())) is None
