"""What the plain-loop adapter's preflight reads: ``read_specs`` maps the live model, optimizer and
first batch of a plain PyTorch / accelerate loop to a ``ModelSpec`` / ``TrainSpec`` (the mapping:
:mod:`memguard_torch.specs`); ``memguard_core.guard.Guard`` estimates, plans and applies
(docs/lifecycle.md).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from memguard_core.estimator.specs import ModelSpec, TrainSpec

from . import train_reading as tt
from .block_kinds import with_live_block_kinds
from .module_spec import model_spec_from_module
from .specs import train_spec


def read_specs(model: Any, optimizer: Any, batch: Any, *, seq_length: Optional[int] = None,
               grad_accum: Optional[int] = None, accelerator: Any = None,
               device: str = "auto") -> Tuple[ModelSpec, TrainSpec]:
    """``(ModelSpec, TrainSpec)`` of a plain loop (the mapping: :mod:`memguard_torch.specs`).

    Raises:
        ConfigError: the model's shapes cannot be read, or a setting the ``TrainSpec`` rejects.
    """
    inner = tt.unwrap(model)
    ms = model_spec_from_module(inner)
    ts = train_spec(model, optimizer, batch, ms, seq_length=seq_length, grad_accum=grad_accum,
                    accelerator=accelerator, device=device)
    return with_live_block_kinds(inner, ms, ts), ts
