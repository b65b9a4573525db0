"""What the HF adapter's preflight reads from a ``Trainer``: ``read_specs`` maps its model and
``TrainingArguments`` to a ``ModelSpec`` / ``TrainSpec`` (the mapping: :mod:`memguard_hf.specs`);
``memguard_core.guard.Guard`` estimates, plans and applies (see docs/lifecycle.md).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from memguard_core.estimator.specs import ModelSpec, TrainSpec
from memguard_torch import train_reading as tt
from memguard_torch.block_kinds import with_live_block_kinds
from memguard_torch.module_spec import model_spec_from_module

from .specs import train_spec


def read_specs(trainer: Any, *, seq_length: Optional[int] = None, device: str = "auto") -> Tuple[ModelSpec, TrainSpec]:
    """``(ModelSpec, TrainSpec)`` of ``trainer``'s model (PEFT and 4-bit aware) and run.

    Raises:
        ConfigError: the model's shapes or a setting cannot be read.
    """
    model = tt.unwrap(trainer.model)
    ms = model_spec_from_module(model)
    ts = train_spec(trainer, ms, seq_length=seq_length, device=device)
    return with_live_block_kinds(model, ms, ts), ts
