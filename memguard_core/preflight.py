"""Framework-neutral part of an adapter's preflight: estimate the requested settings, plan against
the budget with only the steps the adapter may take, and sort the plan's changes into those the
adapter applies in place (micro-batch split, activation checkpointing) and those the user must make.

The adapters (``memguard_hf.preflight``, ``memguard_lightning.preflight``) read the model and the
framework's settings into a ``ModelSpec`` / ``TrainSpec`` and call :func:`plan_in_place`; this
module imports no framework (the HF and Lightning adapters must not import each other's framework).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Sequence

from .spec import ModelSpec, TrainSpec

__all__ = ["IN_PLACE_FIELDS", "PLAN_ORDER", "Preflight", "default_budget", "plan_in_place"]

#: Plan fields an adapter applies in place, and the ``apply`` option that allows each.
IN_PLACE_FIELDS = {"grad_checkpoint": "grad_checkpoint", "batch_size": "micro_batch",
                   "grad_accum": "micro_batch"}

#: The planner's steps (``memguard_core.plan.STEPS``), in order.
PLAN_ORDER = ("grad_checkpoint", "micro_batch", "seq_length", "lora_rank", "lora_layers")


@dataclass
class Preflight:
    """Outcome of an adapter's preflight.

    Attributes:
        model_spec, train_spec: what was read from the model and the trainer.
        estimate: ``MemoryEstimate`` of the requested settings.
        plan: ``Plan`` chosen (``plan.estimate`` is the chosen settings' estimate).
        budget_bytes: the memory budget (bytes).
        split_factor: micro-batch split k applied in place.
        applied: plan changes applied in place.
        not_applied: plan changes the user must make (with the exact change in ``reason``).
    """

    model_spec: ModelSpec
    train_spec: TrainSpec
    estimate: Any
    plan: Any
    budget_bytes: int
    split_factor: int = 1
    applied: List[Any] = field(default_factory=list)
    not_applied: List[Any] = field(default_factory=list)

    @property
    def best_peak_bytes(self) -> int:
        """Estimated peak of the planned settings (bytes)."""
        return int(self.plan.estimate.peak_bytes)

    @property
    def shortfall_bytes(self) -> int:
        """Bytes the planned settings still exceed the budget by (0 when they fit)."""
        return max(0, self.best_peak_bytes - self.budget_bytes)

    @property
    def checkpointing_planned(self) -> bool:
        """The plan turns activation checkpointing on (it was off)."""
        return bool(self.plan.train_spec.grad_checkpoint and not self.train_spec.grad_checkpoint)

    def report_lines(self) -> List[str]:
        """Human lines for the framework's logger."""
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        ts = self.train_spec
        lines = [f"memguard preflight: {self.model_spec.name} ({self.model_spec.total_params / 1e6:.1f}M params, "
                 f"{ts.method}, micro-batch {ts.batch_size} x accumulation {ts.grad_accum}, seq {ts.seq_length}, "
                 f"{ts.optimizer}, {ts.dtype}{' mixed' if ts.mixed_precision else ''}, "
                 f"checkpointing {'on' if ts.grad_checkpoint else 'off'})",
                 f"  estimated peak {gib(self.estimate.peak_bytes)} ({self.estimate.counter}) vs budget "
                 f"{gib(self.budget_bytes)}: {'fits' if self.estimate.peak_bytes <= self.budget_bytes else 'does NOT fit'}"]
        for name, val in self.estimate.breakdown.items():
            lines.append(f"    {name:<18} {gib(val)}")
        seen = set()
        for label, changes in (("applied", self.applied), ("CHANGE NEEDED (not applicable in place)", self.not_applied)):
            for c in changes:
                if c.reason not in seen:  # a micro-batch change is two Changes with one reason
                    seen.add(c.reason)
                    lines.append(f"  {label}: {c.reason}")
        if self.applied or self.not_applied:
            lines.append(f"  planned peak {gib(self.plan.estimate.peak_bytes)} vs budget {gib(self.budget_bytes)}")
        return lines


def default_budget(device: str, safety_ratio: float) -> int:
    """(memory held by this process + memory still available) x ``safety_ratio``, in bytes,
    container-aware (``memguard_core.probes.probe``)."""
    from .probes import probe

    snap = probe(device)
    return int((snap.process_bytes + snap.available_bytes) * safety_ratio)


def plan_in_place(model_spec: ModelSpec, train_spec: TrainSpec, budget_bytes: int, *,
                  apply: Sequence[str] = ("grad_checkpoint", "micro_batch")) -> Preflight:
    """Estimate, plan against ``budget_bytes`` and sort the changes.

    Args:
        model_spec / train_spec: the requested run.
        budget_bytes: bytes the run may use (> 0).
        apply: the in-place steps the adapter can take (``grad_checkpoint``, ``micro_batch``); the
            planner may still choose the other steps (sequence length, LoRA rank / layers), which
            land in ``not_applied`` with the exact change in their reason.

    Returns:
        ``Preflight`` with ``split_factor`` = the plan's ``split_factor`` (>= 1). The caller turns on
        activation checkpointing when ``checkpointing_planned``.

    Raises:
        ConfigError: bad specs or budget (from ``memguard_core.plan.plan``).
        DoesNotFitError: nothing in the allowed search fits.
    """
    from .estimate import estimate
    from .plan import plan as make_plan

    est = estimate(model_spec, train_spec)
    allow = tuple(a for a in PLAN_ORDER if a not in ("grad_checkpoint", "micro_batch") or a in apply)
    chosen = make_plan(model_spec, train_spec, budget_bytes, allow=allow)
    pf = Preflight(model_spec, train_spec, est, chosen, int(budget_bytes))
    for change in chosen.changes:
        (pf.applied if change.field in IN_PLACE_FIELDS else pf.not_applied).append(change)
    pf.split_factor = max(1, int(chosen.split_factor))
    return pf
