"""What the HF adapter's preflight reads from a ``Trainer``: ``read_specs`` maps its model and
``TrainingArguments`` to a ``ModelSpec`` / ``TrainSpec`` (the mapping: :mod:`memguard_hf.specs`);
``memguard_core.guard.Guard`` estimates, plans and applies (see docs/lifecycle.md).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from memguard_core.estimator.specs import ModelSpec, TrainSpec
from memguard_torch import train_reading as tt
from memguard_torch.block_kinds import with_live_block_kinds

from . import _compat
from .model_spec import live_model_spec, with_seq2seq_fields
from .specs import train_spec


def read_specs(trainer: Any, *, seq_length: Optional[int] = None, device: str = "auto") -> Tuple[ModelSpec, TrainSpec]:
    """``(ModelSpec, TrainSpec)`` of ``trainer``'s model (PEFT and 4-bit aware) and run; an
    encoder-decoder's (T5, BART: ``model_spec.with_seq2seq_fields``) with its decoder stack and its
    target length (``specs.target_length``: the training rows' ``labels`` / ``decoder_input_ids``).

    Raises:
        ConfigError: the model's shapes or a setting cannot be read; (one line) an
            encoder-decoder family the estimator does not count.
    """
    model = tt.unwrap(trainer.model)
    ms = with_seq2seq_fields(model, live_model_spec(model, getattr(trainer, "train_dataset", None)))
    ts = train_spec(trainer, ms, seq_length=seq_length, device=device)
    return with_live_block_kinds(model, ms, ts), ts


#: Rows at the start of the training set the in-process measurement chooses its row from: the one
#: with the most tokens, so that a short first row does not cut both of its sizes (256 and 512
#: tokens) to that row's length, which leaves one size and no slope.
PROBE_ROW_CANDIDATES = 32


def probe_batch(trainer: Any) -> Optional[Any]:
    """One row of the training set, collated as the ``Trainer`` collates it, for the in-process
    measurement (``memguard_torch.preflight_probe``): of the first :data:`PROBE_ROW_CANDIDATES`
    rows, the one with the most tokens (``train_reading.longest_row`` by ``row_length``: the first
    of them on a tie, and the first row where no row has ``input_ids``, or where the dataset has no
    length); None for a dataset without indexable rows (an ``IterableDataset``). The
    random number generators (torch's CPU one, Python's, NumPy's global one) are put back
    afterwards (a dataset or a collator may draw from them: augmentation, masking, padding to a
    random multiple), so the run's own batches are unchanged.

    Raises:
        whatever the dataset or the collator raises (the measurement reports it, never the run).
    """
    import random
    import sys

    import torch

    ds = getattr(trainer, "train_dataset", None)
    if ds is None or not hasattr(ds, "__getitem__") or isinstance(ds, torch.utils.data.IterableDataset):
        return None
    state, py = torch.random.get_rng_state(), random.getstate()
    np = sys.modules.get("numpy")   # augmentation often draws from NumPy's global generator
    np_state = np.random.get_state() if np is not None else None
    try:
        rows = _compat.training_columns(trainer, ds)
        best, _ = tt.longest_row(rows, tt.row_length, PROBE_ROW_CANDIDATES)
        return trainer.data_collator([rows[0] if best is None else best])
    finally:
        torch.random.set_rng_state(state)
        random.setstate(py)
        if np_state is not None:
            np.random.set_state(np_state)
