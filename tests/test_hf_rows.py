"""memguard_hf.rows: what the HF guard reads of a dataset row or collated batch for an
encoder-decoder's target length and an image classifier's side, on real rows (lists, tensors)."""

import torch

from memguard_hf.rows import image_size_of, longest_target, target_length_of


def test_target_length_of_rows_and_batches():
    assert target_length_of({"labels": [5, 6, 7]}) == 3
    assert target_length_of({"labels": torch.zeros(2, 9, dtype=torch.long)}) == 9
    # decoder_input_ids first, then labels
    assert target_length_of({"decoder_input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 6)}) == 4
    # a batch of unpadded lists: its longest row, not its first
    assert target_length_of({"labels": [[1, 2], [1, 2, 3, 4, 5], [1]]}) == 5
    assert target_length_of({"input_ids": [1, 2]}) == 0 and target_length_of((1, 2)) == 0
    assert target_length_of({"labels": torch.tensor(3)}) == 0


def test_longest_target_scans_the_rows():
    rows = [{"labels": list(range(n))} for n in (3, 11, 7)]
    assert longest_target(rows) == 11
    assert longest_target(rows, scan_rows=1) == 3


def test_image_size_of_a_row_and_a_batch():
    assert image_size_of({"pixel_values": torch.zeros(3, 160, 160)}) == 160
    assert image_size_of({"pixel_values": torch.zeros(2, 3, 96, 96)}) == 96
    assert image_size_of({"input_ids": [1]}) == 0


def test_a_scan_puts_the_random_states_back():
    # a dataset whose rows draw (random crops, masking): scanning it at train start must not shift
    # the run's draws in torch, Python's random or numpy
    import random

    import numpy as np

    class Augmenting:
        def __len__(self):
            return 32

        def __getitem__(self, i):
            torch.rand(3), random.random(), np.random.rand()
            return {"labels": list(range(1 + i % 5))}

    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert longest_target(Augmenting()) == 5
    after = (torch.rand(1).item(), random.random(), np.random.rand())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    assert after == (torch.rand(1).item(), random.random(), np.random.rand())
