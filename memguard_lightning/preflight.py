"""What the Lightning adapter's preflight reads: ``read_specs`` maps the ``LightningModule``, the
trainer and the first batch to a ``ModelSpec`` / ``TrainSpec`` (the ``TrainSpec`` from
``memguard_lightning.specs.train_spec``); ``memguard_core.guard.Guard`` estimates, plans and
applies (see docs/lifecycle.md).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from memguard_core.estimator.specs import ModelSpec, TrainSpec
from memguard_torch.block_kinds import with_live_block_kinds
from memguard_torch.module_spec import model_spec_from_module

from .specs import find_model, train_spec


def read_specs(trainer, pl_module, batch: Any, *, seq_length: Optional[int] = None,
               device: str = "auto") -> Tuple[ModelSpec, TrainSpec]:
    """``(ModelSpec, TrainSpec)`` of the Lightning run (the model found by :func:`find_model`).

    Raises:
        ConfigError: the model's shapes cannot be read (no config, no embedding + blocks).
    """
    model = find_model(pl_module)
    ms = model_spec_from_module(model)
    ts = train_spec(trainer, pl_module, batch, ms, seq_length=seq_length, device=device)
    return with_live_block_kinds(model, ms, ts), ts
