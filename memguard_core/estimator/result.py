"""``MemoryEstimate``, the estimator's result, and the order of its breakdown. docs/estimator.md,
"How the peak is composed".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

from .block_terms import how_counted
from .specs import ModelSpec, TrainSpec


#: Breakdown keys in report order.
BREAKDOWN_ORDER = ("weights", "weight_copies", "gradients", "optimizer_states", "master_weights",
                   "optimizer_temporaries", "backward_transients", "activations", "attention_scores", "logits",
                   "runtime_overhead", "allocator_slack", "calibration")


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted peak of one counter, with the terms live at that peak.

    Attributes:
        peak_bytes: predicted peak of ``counter`` in bytes (after ``correction``).
        breakdown: name -> bytes, in ``BREAKDOWN_ORDER``; values sum to ``peak_bytes``.
        counter: ``cpu`` (VmHWM of the training process) | ``cuda`` (context + reserved) | ``mlx``
            (``mx.get_peak_memory()``).
        phase: the moment of the peak: ``loss`` | ``backward`` | ``optimizer``.
        phases: peak bytes of each moment (before correction).
        phase_breakdowns: the breakdown of each moment (name -> bytes).
        model_spec / train_spec: the inputs.
        trainable_params: trainable parameter count (elements).
        correction: multiplicative calibration factor applied.
        notes: assumptions that applied to this estimate.
        slack_floors: moment -> bytes of cached blocks the device allocator cannot use then (cuda:
            ``cuda.unusable_cache_bytes``), the least ``allocator_slack`` of that moment; per-token
            bytes, so a correction of the per-token part scales them (``probe_fit.corrected_peak``).
    """

    peak_bytes: int
    breakdown: Dict[str, int]
    counter: str
    model_spec: ModelSpec
    train_spec: TrainSpec
    trainable_params: int
    phase: str = "loss"
    phases: Dict[str, int] = field(default_factory=dict)
    phase_breakdowns: Dict[str, Dict[str, int]] = field(default_factory=dict)
    correction: float = 1.0
    notes: Tuple[str, ...] = ()
    slack_floors: Dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-safe dict: ``peak_bytes`` (int), ``breakdown`` (name -> int), ``counter``, ``phase``,
        ``phases``, ``trainable_params``, ``correction``, ``notes``, ``block_kinds`` (per kind of block:
        name, count, how it was counted -- ``rules`` | ``traced`` | ``rules (not modelled, not
        traced)`` -- and the census figure, bytes per token per block), ``model`` and ``train`` (the
        spec fields)."""
        import dataclasses

        def plain(v):
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if dataclasses.is_dataclass(v):
                return {k: plain(x) for k, x in dataclasses.asdict(v).items()}
            if isinstance(v, dict):
                return {str(k): plain(x) for k, x in v.items()}
            return v

        return {
            "peak_bytes": int(self.peak_bytes),
            "breakdown": {k: int(v) for k, v in self.breakdown.items()},
            "counter": self.counter,
            "phase": self.phase,
            "phases": {k: int(v) for k, v in self.phases.items()},
            "trainable_params": int(self.trainable_params),
            "correction": float(self.correction),
            "notes": list(self.notes),
            "block_kinds": [{"name": k.name, "count": k.count,
                             "counted": how_counted(k, self.train_spec),
                             "saved_bytes_per_token": k.saved_per_token, "traced_under": k.traced_under or None}
                            for k in self.model_spec.block_kinds],
            "model": plain(self.model_spec),
            "train": plain(self.train_spec),
        }
