"""Framework-neutral part of an adapter's preflight: estimate the requested settings, plan against
the budget with only the steps the adapter may take, and sort the plan's changes into those the
adapter applies in place (micro-batch split, activation checkpointing) and those the user must make.

The adapters (``memguard_hf.preflight``, ``memguard_lightning.preflight``, ``memguard_mlx.specs``)
read the model and the framework's settings into a ``ModelSpec`` / ``TrainSpec``;
``memguard_core.guard.Guard.plan`` calls :func:`plan_in_place`. This module imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from .errors import DoesNotFitError, require_fraction
from .estimator.specs import ModelSpec, TrainSpec

__all__ = ["IN_PLACE_FIELDS", "PLAN_ORDER", "Preflight", "default_budget", "plan_in_place"]

#: Plan fields an adapter applies in place, and the ``apply`` option that allows each.
IN_PLACE_FIELDS = {"grad_checkpoint": "grad_checkpoint", "batch_size": "micro_batch",
                   "grad_accum": "micro_batch"}

#: The planner's steps (``memguard_core.plan.STEPS``), in order.
PLAN_ORDER = ("grad_checkpoint", "micro_batch", "seq_length", "lora_rank", "lora_layers")


@dataclass(frozen=True)
class Measurement:
    """What the preflight's in-process measurement did (``memguard_core.probe_policy``).

    Attributes:
        factor: the corrected over the uncorrected estimate of the run's settings, the factor
            every planned estimate takes (in place of the calibration's); None: no correction.
        line: one line for the log: what was measured, its cost and the correction, or why not.
    """

    factor: Optional[float]
    line: str


@dataclass
class Preflight:
    """Outcome of an adapter's preflight.

    Attributes:
        model_spec, train_spec: what was read from the model and the trainer.
        estimate: ``MemoryEstimate`` of the requested settings.
        plan: ``Plan`` chosen (``plan.estimate`` is the chosen settings' estimate).
        budget_bytes: the memory budget (bytes).
        micro_batches: micro-batches per batch k applied in place.
        applied: plan changes applied in place.
        not_applied: plan changes the user must make (with the exact change in ``reason``).
        plan_fraction: the plan targets ``plan_fraction x budget_bytes``.
        resident_extra_bytes: memory the process already held at train start beyond the estimate's
            runtime overhead and weights (model-loading heap, datasets), added to every estimate.
        correction: factor applied to every estimate: the in-process measurement's
            (``measurement.factor``) when it corrected the estimate, else the calibration's
            (``memguard_core.calibration``: median measured / estimated of this machine's
            comparable past runs; 1.0 = none).
        calibration_runs: comparable past runs found in the calibration store.
    """

    model_spec: ModelSpec
    train_spec: TrainSpec
    estimate: Any
    plan: Any
    budget_bytes: int
    micro_batches: int = 1
    applied: List[Any] = field(default_factory=list)
    not_applied: List[Any] = field(default_factory=list)
    plan_fraction: float = 1.0
    resident_extra_bytes: int = 0
    correction: float = 1.0
    calibration_runs: int = 0
    measurement: Optional[Measurement] = None

    def __repr__(self) -> str:
        """One readable line (the dataclass's own repr would print both specs and estimates in full)."""
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        changes = sorted({c.reason for c in self.applied})
        todo = sorted({c.reason for c in self.not_applied})
        return (f"Preflight({self.model_spec.name}: requested {gib(self.requested_peak_bytes)} -> planned "
                f"{gib(self.best_peak_bytes)} of budget {gib(self.budget_bytes)}, micro_batches={self.micro_batches}"
                + (f", applied={changes}" if changes else "") + (f", not_applied={todo}" if todo else "") + ")")

    @property
    def requested_peak_bytes(self) -> int:
        """Estimated peak of the requested settings (bytes), with the same resident memory as
        :attr:`best_peak_bytes`, so the two compare."""
        return int(self.estimate.peak_bytes) + self.resident_extra_bytes

    @property
    def best_peak_bytes(self) -> int:
        """Estimated peak of the planned settings (bytes), with the resident memory the model of
        the estimate does not cover (see ``plan_in_place``)."""
        return int(self.plan.estimate.peak_bytes) + self.resident_extra_bytes

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
                 f"  estimated peak {gib(self.requested_peak_bytes)} ({self.estimate.counter}) vs budget "
                 f"{gib(self.budget_bytes)}: {'fits' if self.requested_peak_bytes <= self.budget_bytes else 'does NOT fit'}"]
        measured = self.measurement is not None and self.measurement.factor is not None
        for name, val in self.estimate.breakdown.items():
            if val:  # terms this run does not have (no optimizer states under SGD, ...) stay out
                name = "measured correction" if measured and name == "calibration" else name
                lines.append(f"    {name:<18} {gib(val)}")
        seen = set()
        for label, changes in (("applied", self.applied), ("CHANGE NEEDED (not applicable in place)", self.not_applied)):
            for c in changes:
                if c.reason not in seen:  # a micro-batch change is two Changes with one reason
                    seen.add(c.reason)
                    lines.append(f"  {label}: {c.reason}")
        if self.measurement is not None:
            lines.append(f"  {self.measurement.line}"
                         + (f": every estimate x{self.correction:.3f}" if measured else ""))
        if not measured and (self.correction != 1.0 or self.calibration_runs):
            from .calibration import MIN_RUNS

            lines.append(f"  calibration: x{self.correction:.3f} from {self.calibration_runs} comparable past runs on "
                         f"this machine" if self.correction != 1.0 else
                         f"  calibration: {self.calibration_runs} comparable past run(s); a correction applies from "
                         f"{MIN_RUNS}")
        from .estimator.runtime import runtime_source

        lines.append(f"  {runtime_source(self.plan.train_spec)}")
        if self.resident_extra_bytes:
            lines.append(f"  + {gib(self.resident_extra_bytes)} already resident at train start beyond runtime and "
                         f"weights (model loading heap, data), counted in every estimate")
        if self.applied or self.not_applied or self.resident_extra_bytes:
            target = f" vs plan target {gib(self.plan.budget_bytes + self.resident_extra_bytes)}"
            if self.plan_fraction < 1:
                target += f" ({self.plan_fraction:.0%} of the budget: below the guard's warning level)"
            lines.append(f"  planned peak {gib(self.best_peak_bytes)}{target}")
        return lines


def default_budget(device: str, safety_ratio: float) -> int:
    """(memory held by this process + memory still available) x ``safety_ratio``, in bytes,
    container-aware (``memguard_core.probes.probe``)."""
    from .probes import probe

    snap = probe(device)
    return int((snap.process_bytes + snap.available_bytes) * safety_ratio)


def allow_steps(apply: Sequence[str]) -> tuple:
    """The planner steps an adapter allows: all but the in-place ones it cannot apply."""
    return tuple(a for a in PLAN_ORDER if a not in ("grad_checkpoint", "micro_batch") or a in apply)


def plan_in_place(model_spec: ModelSpec, train_spec: TrainSpec, budget_bytes: int, *,
                  apply: Sequence[str] = ("grad_checkpoint", "micro_batch"), plan_fraction: float = 1.0,
                  resident_bytes: Optional[int] = None, correction: Optional[float] = None) -> Preflight:
    """Estimate, plan against ``plan_fraction x budget_bytes`` and sort the changes.

    Args:
        model_spec / train_spec: the requested run.
        budget_bytes: bytes the run may use (> 0).
        apply: the in-place steps the adapter can take (``grad_checkpoint``, ``micro_batch``); the
            planner may still choose the other steps (sequence length, LoRA rank / layers), which
            land in ``not_applied`` with the exact change in their reason.
        plan_fraction: the adapters pass the monitor's warning threshold (0.85): a run planned right
            up to the budget would sit at the guard's critical level from its first step and be split
            further for nothing; planning below the warning level keeps the guard quiet unless
            something changes, and absorbs an estimate error of that size.
        resident_bytes: what the process holds at train start (RSS on CPU), when the adapter runs in
            the training process with the model loaded. Beyond the estimate's runtime overhead and
            weights it holds what the estimate cannot see (the heap glibc kept from building the
            model, datasets, other libraries): that surplus is added to every estimate.
        correction: calibration factor for ``estimate(..., correction=...)``; None (default) looks it
            up in the calibration store (``memguard_core.calibration.correction_for``: 1.0 until 3
            comparable runs were recorded on this machine; a failing store gives 1.0).

    Returns:
        ``Preflight`` with ``micro_batches`` = the plan's ``micro_batches`` (>= 1). The caller turns on
        activation checkpointing when ``checkpointing_planned``.

    Raises:
        ConfigError: bad specs or budget (from ``memguard_core.plan.plan``).
        DoesNotFitError: nothing in the allowed search fits.
    """
    from .estimator.estimate import estimate
    from .plan import plan as make_plan

    fraction = require_fraction("plan_fraction", plan_fraction)
    runs = 0
    if correction is None:  # calibration: never raises, 1.0 without 3 comparable runs
        from .calibration import correction_for

        found = correction_for(model_spec, train_spec)
        correction, runs = found.factor, found.runs
    est = estimate(model_spec, train_spec, correction=correction)
    extra = resident_extra(est.breakdown, resident_bytes, train_spec)
    target = int(budget_bytes * fraction) - extra
    if target <= 0:
        raise DoesNotFitError(int(est.peak_bytes) + extra - int(budget_bytes * fraction), int(budget_bytes),
                              int(est.peak_bytes) + extra,
                              ["the process already holds more than the budget before training: raise the budget "
                               "or free memory (other models, datasets) before train()"])
    # a split applied in place leaves the dataloader's batches whole: candidates hold them (pixels)
    planned = (train_spec.replace(collated_rows=train_spec.rows_per_batch)
               if "micro_batch" in apply else train_spec)
    try:
        chosen = make_plan(model_spec, planned, target, allow=allow_steps(apply), correction=correction,
                           shown_offset=extra, target_name=f"{fraction:.0%} of the {budget_bytes / 2**30:.2f} GiB budget")
    except DoesNotFitError as exc:
        # the planner saw only its target: the error names the user's budget and how the target derives
        note = (f"; the plan targets {target / 2**30:.2f} GiB of it ({fraction:.0%}, the monitor's warning level"
                + (f", less {extra / 2**30:.2f} GiB the process already holds beyond the estimate" if extra else "")
                + ")")
        raise DoesNotFitError(int(exc.shortfall_bytes), int(budget_bytes),
                              int(exc.best_peak_bytes) + extra, exc.suggestions, target_note=note) from None
    pf = Preflight(model_spec, train_spec, est, chosen, int(budget_bytes), plan_fraction=fraction,
                   resident_extra_bytes=extra, correction=float(correction), calibration_runs=runs)
    for change in chosen.changes:
        (pf.applied if change.field in IN_PLACE_FIELDS else pf.not_applied).append(change)
    pf.micro_batches = max(1, int(chosen.micro_batches))
    return pf


def resident_extra(estimate_breakdown: dict, resident_bytes: Optional[int],
                   train_spec: Optional[TrainSpec] = None) -> int:
    """What a process holds beyond the estimate's runtime overhead and weights (bytes, >= 0); 0
    when the runtime overhead is this process's own measured figure (``train_spec
    .runtime_held_bytes``), which already holds it."""
    if not resident_bytes or (train_spec is not None and train_spec.runtime_held_bytes is not None
                              and train_spec.device == "cpu"):
        return 0
    static = estimate_breakdown.get("runtime_overhead", 0) + estimate_breakdown.get("weights", 0)
    return max(0, int(resident_bytes) - static)


def budget_that_fits(model_spec: ModelSpec, train_spec: TrainSpec, *, resident_bytes: Optional[int] = None,
                     plan_fraction: float = 0.85, margin: float = 1.03) -> int:
    """The budget (bytes) at which ``train_spec`` just fits an adapter's preflight: its estimate plus
    the resident surplus, over ``plan_fraction``, times ``margin``. The demos use it to pick a budget
    that the requested settings do not fit but a given split does."""
    from .estimator.estimate import estimate

    est = estimate(model_spec, train_spec)
    return int((est.peak_bytes + resident_extra(est.breakdown, resident_bytes, train_spec)) / plan_fraction * margin)


def attn_impl_from(name: Optional[str]) -> str:
    """TrainSpec ``attn_impl`` from a HF ``config._attn_implementation`` (``eager`` keeps the O(s^2)
    scores; ``flash_attention_*`` -> ``flash``; ``sdpa`` and anything else -> ``sdpa``)."""
    name = str(name or "sdpa")
    return "eager" if name == "eager" else "flash" if "flash" in name else "sdpa"


def resident_bytes_for(train_spec: TrainSpec) -> Optional[int]:
    """What this process holds now (RSS) when the estimate predicts the CPU counter, for
    ``plan_in_place(resident_bytes=...)``; ``None`` for other counters or when it cannot be read
    (logged at debug level, never raised)."""
    if train_spec.device != "cpu":
        return None
    try:
        from .probes import probe

        return probe("cpu", cheap=True).process_bytes
    except Exception:
        import logging

        logging.getLogger("memguard.preflight").debug("no RSS reading for the preflight", exc_info=True)
        return None
