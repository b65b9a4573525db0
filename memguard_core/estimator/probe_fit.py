"""The in-process measurement's arithmetic: what the device's own counter saw
of one or two forward + backward steps at small sizes (``memguard_torch.preflight_probe``), set
against what the estimate predicts the same counter sees of the same steps, gives a correction of
the estimate's per-token and fixed parts of a step, applied at the run's size. Pure arithmetic, no
framework. docs/estimator.md, "In-process measurement".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from ..errors import ConfigError
from . import cuda, mps
from .estimate import estimate
from .result import MemoryEstimate
from .specs import MiB, ModelSpec, TrainSpec

__all__ = ["ProbeStep", "ProbeResult", "ProbeFit", "PROBE_COUNTERS", "PER_TOKEN_RATIO_BOUNDS",
           "FIXED_CUT_SHARE", "probe_train_spec", "step_parts", "fit_probe", "correct_estimate",
           "corrected_peak"]

#: device kind -> the counter the probe reads there (what ``ProbeResult.counter`` names).
PROBE_COUNTERS = {"cpu": "VmHWM", "cuda": "max_memory_allocated", "mps": "driver_allocated_memory"}
#: The per-token ratio is kept within these bounds (docs/estimator.md, "In-process measurement"):
#: below, an estimate would be lowered by more than a quarter on a reading that can under-read
#: (a lower estimate is the direction that ends in an OOM); above, a slope read at a few hundred
#: tokens would be multiplied over the run's tokens on a reading that also holds what is not
#: per-token (an allocation the first step made once). Assumptions, not fitted.
PER_TOKEN_RATIO_BOUNDS = (0.75, 4.0)
#: The fixed part may be lowered by at most this share of it (same reason as the lower ratio bound).
FIXED_CUT_SHARE = 0.25

#: The estimate's terms by what they do in a step (``result.BREAKDOWN_ORDER``): held before the
#: step (the counter's reading before it covers them), a step's fixed part (the same bytes at any
#: number of tokens), its per-token part.
HELD_TERMS = ("weights", "optimizer_states", "master_weights", "runtime_overhead")
FIXED_TERMS = ("weight_copies", "gradients", "backward_transients", "optimizer_temporaries")
PER_TOKEN_TERMS = ("activations", "attention_scores", "logits")
#: The moments a forward + backward passes through (the probe never steps the optimizer).
STEP_MOMENTS = ("loss", "backward")


@dataclass(frozen=True)
class ProbeStep:
    """One measured forward + backward.

    Attributes:
        rows / tokens: the micro-batch measured: rows, tokens per row (as cut from the batch).
        held_bytes: the counter right before the step (after the free heap / cache was returned).
        peak_bytes: the counter's peak over the step.
        retained_bytes: what the counter still read after the step, its outputs and gradients
            dropped, over ``held_bytes`` (negative when the step freed something held): what the
            step allocated once and kept (cuBLAS workspaces, oneDNN caches, lazily built buffers).
        seconds: wall time of the step, its reads included.
    """

    rows: int
    tokens: int
    held_bytes: int
    peak_bytes: int
    retained_bytes: int
    seconds: float

    @property
    def step_bytes(self) -> int:
        """What the step added over the memory held before it and gave back at its end, bytes:
        ``peak - held`` less what it kept (``retained_bytes`` > 0) -- the part the estimate's step
        terms predict; what it kept is in the estimate's runtime overhead."""
        return int(self.peak_bytes - self.held_bytes - max(0, self.retained_bytes))


@dataclass(frozen=True)
class ProbeResult:
    """What the in-process measurement saw (``memguard_torch.preflight_probe.measure_steps``).

    Attributes:
        measured: True when at least one step was measured; False with ``reason`` otherwise.
        device: ``cpu`` | ``cuda:N`` | ``mps``.
        counter: :data:`PROBE_COUNTERS` of the device ("" when nothing was read).
        steps: the steps measured, in the order run (increasing size).
        seconds: what the measurement cost in all, the restoring of the run's state included.
        reason: why nothing (or fewer steps than asked) was measured; "" when all were.
    """

    measured: bool
    device: str
    counter: str
    steps: Tuple[ProbeStep, ...] = ()
    seconds: float = 0.0
    reason: str = ""

    def sizes(self) -> str:
        """``1 x 256, 1 x 512 tokens``: the sizes measured."""
        return ", ".join(f"{s.rows} x {s.tokens}" for s in self.steps) + " tokens"


@dataclass(frozen=True)
class ProbeFit:
    """The correction and the run's corrected peak.

    Attributes:
        peak_bytes: the corrected peak of the run's estimate (its own peak when not ``applied``).
        estimate_peak_bytes: the run's estimate before the correction.
        per_token_ratio: the factor on the step's per-token part (1.0: none).
        fixed_delta_bytes: bytes added to the step's fixed part (0: none).
        ratio_read: the ratio the measurement read before the bounds (None: not read).
        applied: False where nothing was measured or the reading was unusable.
        explanation: one line for the log.
        moment: the step moment the measured peaks were compared with (``loss`` | ``backward``;
            "" when nothing was fitted): the one moment ``fixed_delta_bytes`` applies to.
    """

    peak_bytes: int
    estimate_peak_bytes: int
    per_token_ratio: float
    fixed_delta_bytes: int
    ratio_read: Optional[float]
    applied: bool
    explanation: str
    moment: str = ""

    def apply(self, est: MemoryEstimate) -> int:
        """This correction applied to ``est`` (another micro-batch size of the same run), bytes:
        :func:`corrected_peak` at :attr:`moment`."""
        if not self.applied:
            return int(est.peak_bytes)
        return corrected_peak(est, self.per_token_ratio, self.fixed_delta_bytes,
                              fixed_moments=(self.moment,) if self.moment else STEP_MOMENTS)


def probe_train_spec(ts: TrainSpec, rows: int, tokens: int) -> TrainSpec:
    """The run's ``TrainSpec`` as the probe steps it: ``rows`` x ``tokens``, no gradient
    accumulation (the probe's backward starts with every ``.grad`` None), and on a CPU the heap
    trimmed (the probe returns the free heap before each step, ``TrainSpec.heap_trim``).

    Raises:
        ConfigError: ``rows`` / ``tokens`` not a positive integer.
    """
    return ts.replace(batch_size=rows, seq_length=tokens, grad_accum=1, collated_rows=None,
                      heap_trim=True if ts.device == "cpu" else ts.heap_trim)


def step_parts(est: MemoryEstimate, moment: str) -> Dict[str, int]:
    """The estimate's ``moment`` (``loss`` | ``backward`` | ``optimizer``) in the parts the probe
    corrects, bytes: ``held`` (:data:`HELD_TERMS`), ``fixed`` (:data:`FIXED_TERMS`),
    ``per_token`` (:data:`PER_TOKEN_TERMS`), ``slack`` (the allocator's); they sum to the moment's
    total (``est.phases``)."""
    b = est.phase_breakdowns[moment]
    return {"held": sum(b.get(k, 0) for k in HELD_TERMS), "fixed": sum(b.get(k, 0) for k in FIXED_TERMS),
            "per_token": sum(b.get(k, 0) for k in PER_TOKEN_TERMS), "slack": b.get("allocator_slack", 0)}


def _seen(est: MemoryEstimate) -> Tuple[int, int, str]:
    """``(fixed, per-token, moment)`` of the step as the probe's counter on ``est.counter`` sees
    it, at the step moment where it is largest (bytes; the moment's name). cpu: VmHWM sees the heap
    slack the step's traffic leaves (counted per token); cuda: ``max_memory_allocated`` sees no
    allocator slack; mps: the driver's figure sees the cache the step leaves, which the measured
    figure is divided by instead (:func:`_live_scale`)."""
    best = None
    for m in STEP_MOMENTS:
        p = step_parts(est, m)
        v = p["per_token"] + (p["slack"] if est.counter == "cpu" else 0)
        if best is None or p["fixed"] + v > best[0] + best[1]:
            best = (p["fixed"], v, m)
    return best


def _live_scale(counter: str) -> float:
    """The driver figure's share over the live bytes on mps (its cache: ``mps.MPS_FRAGMENTATION``)."""
    return 1.0 + mps.MPS_FRAGMENTATION if counter == "mps" else 1.0


def corrected_peak(est: MemoryEstimate, per_token_ratio: float, fixed_delta_bytes: int,
                   fixed_moments: Sequence[str] = STEP_MOMENTS) -> int:
    """``est``'s peak with each step moment (``loss``, ``backward``) rebuilt as held + fixed
    (+ ``fixed_delta_bytes`` at the moments in ``fixed_moments``) + ``per_token_ratio`` x
    per-token, bytes: the per-token tensors (activations, logits) are the same tensors at both
    moments, each moment's fixed part is its own (the loss's: weight copies; the backward's:
    gradients and its transients too). On cuda / mps the allocator slack is recomputed from the
    new live total (``cuda.allocator_slack`` / ``mps.allocator_slack``), at least the moment's
    ``est.slack_floors`` (cached per-token tensors) scaled with the per-token part; on
    cpu the heap slack scales with the per-token part. The optimizer moment is kept; the estimate's calibration
    factor (``est.correction``) applies on top.

    Raises:
        ConfigError: a ratio that is not a positive number, or a moment not in :data:`STEP_MOMENTS`.
    """
    r = per_token_ratio
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
        raise ConfigError("per_token_ratio", "a positive number", per_token_ratio)
    if any(m not in STEP_MOMENTS for m in fixed_moments):
        raise ConfigError("fixed_moments", " and / or ".join(STEP_MOMENTS), fixed_moments)
    totals = dict(est.phases)
    overhead = est.phase_breakdowns["loss"].get("runtime_overhead", 0)
    for m in STEP_MOMENTS:
        p = step_parts(est, m)
        d = fixed_delta_bytes if m in fixed_moments else 0
        if est.counter == "cpu":
            totals[m] = p["held"] + p["fixed"] + d + r * (p["per_token"] + p["slack"])
            continue
        live = p["held"] + p["fixed"] + d + r * p["per_token"]
        rule = {"cuda": cuda.allocator_slack, "mps": mps.allocator_slack}.get(est.counter)
        if rule is None:
            totals[m] = live
            continue
        floor = est.slack_floors.get(m, 0)   # cached per-token tensors (cuda.unusable_cache_bytes)
        totals[m] = live + max(rule({m: live}, overhead)[m], int(r * floor))
    return int(math.ceil(max(totals.values()) * est.correction))


def _check(probe: ProbeResult, at_probe: Sequence[MemoryEstimate], run: MemoryEstimate) -> str:
    kind = probe.device.split(":")[0]
    if kind not in PROBE_COUNTERS:
        raise ConfigError("probe.device", " | ".join(PROBE_COUNTERS), probe.device)
    if not isinstance(run, MemoryEstimate) or run.counter != kind:
        raise ConfigError("run", f"a MemoryEstimate of the {kind} counter", getattr(run, "counter", run))
    if len(at_probe) != len(probe.steps):
        raise ConfigError("at_probe", f"one estimate per measured step ({len(probe.steps)})", len(at_probe))
    for i, (e, s) in enumerate(zip(at_probe, probe.steps)):
        size = (e.train_spec.batch_size, e.train_spec.seq_length) if isinstance(e, MemoryEstimate) else None
        if size != (s.rows, s.tokens) or e.counter != kind:
            raise ConfigError(f"at_probe[{i}]", f"an estimate of the {kind} counter at {s.rows} x {s.tokens} "
                              f"tokens (the probe's step {i + 1})", size or e)
    return kind


def fit_probe(probe: ProbeResult, at_probe: Sequence[MemoryEstimate], run: MemoryEstimate) -> ProbeFit:
    """The correction the measured steps give, applied to the run's estimate.

    Args:
        probe: the measurement (``memguard_torch.preflight_probe.measure_steps``).
        at_probe: per measured step, the estimate at its size (:func:`probe_train_spec`).
        run: the estimate at the run's size.

    With one step: the per-token ratio ``(measured - fixed) / per-token``, the fixed part kept.
    With two or more (the smallest and the largest are used): the per-token ratio from the
    difference between them, the fixed part from what is left. The measured figure is
    :attr:`ProbeStep.step_bytes` against :func:`_seen`'s parts. Both bounded: the ratio within
    :data:`PER_TOKEN_RATIO_BOUNDS`, the fixed part lowered by at most :data:`FIXED_CUT_SHARE` of
    the larger predicted one and raised by at most the whole predicted step at the largest size.

    A peak is one moment's reading, compared with the moment the estimate has largest at the
    probe's size (:func:`_seen`). The fixed delta applies to that moment only: a full fine-tune's
    one-row step peaks in its backward (gradients, weight copies), the run at its loss
    (activations, logits), and what the backward's reading says of its fixed part does not hold
    for the loss's. The per-token ratio applies to both moments, but is read only where that
    moment's per-token part is at least :data:`FIXED_CUT_SHARE` of its fixed part: below, a
    fixed-part error the bounds allow is as large as the whole per-token part, and a slope read
    there (a backward peak after most activations are freed) says nothing of the activations the
    loss moment holds; the ratio is then 1 and the step's difference goes to the fixed delta. Where
    the two sizes peak at different moments, the larger size alone is fitted.

    Returns:
        ProbeFit; ``applied`` False (the run's own peak) where nothing was measured or what was
        measured is unusable (no step above the memory held before it).

    Raises:
        ConfigError: estimates that do not match the probe's steps or device.
    """
    base = int(run.peak_bytes)
    if not probe.measured or not probe.steps:
        return ProbeFit(base, base, 1.0, 0, None, False, f"in-process measurement: not measured ({probe.reason})")
    _check(probe, at_probe, run)
    scale = _live_scale(run.counter)
    pts = sorted(((s.rows * s.tokens, s.step_bytes / scale) + _seen(e) for s, e in zip(probe.steps, at_probe)))
    head = (f"measured {len(probe.steps)} forward+backward step{'s' if len(probe.steps) > 1 else ''} "
            f"({probe.sizes()}) in {probe.seconds:.1f} s ({probe.counter})")
    if all(p[1] <= 0 for p in pts):
        return ProbeFit(base, base, 1.0, 0, None, False, f"{head}: nothing above the held memory, estimate kept")
    moment = pts[-1][4]
    if pts[0][4] != moment:   # the sizes peak at different moments: no slope between them
        pts = pts[-1:]
    (_, m1, f1, v1, _), (_, m2, f2, v2, _) = pts[0], pts[-1]
    lo, hi = PER_TOKEN_RATIO_BOUNDS
    if v2 < FIXED_CUT_SHARE * f2:   # a fixed-dominated peak: no per-token reading (above)
        read, r = None, 1.0
        d = int(min(max(m2 - f2 - v2, -FIXED_CUT_SHARE * f2), f2 + v2))
    elif len(pts) > 1 and v2 != v1:
        read = ((m2 - f2) - (m1 - f1)) / (v2 - v1)
        r = min(max(read, lo), hi)
        d = ((m1 - f1 - r * v1) + (m2 - f2 - r * v2)) / 2
        d = int(min(max(d, -FIXED_CUT_SHARE * max(f1, f2)), f2 + v2))
    else:
        read = (m2 - f2) / v2 if v2 > 0 else 1.0
        r, d = min(max(read, lo), hi), 0
    peak = corrected_peak(run, r, d, fixed_moments=(moment,))
    ratio = ("per-token not read (a fixed-dominated peak)" if read is None else
             f"per-token x{r:.2f}" + (f" (bounded; read x{read:.2f})" if r != read else ""))
    return ProbeFit(peak, base, float(r), int(d), None if read is None else float(read), True,
                    f"{head}: {ratio}, fixed {d / MiB:+.0f} MiB at the {moment} moment; peak "
                    f"{base / 2**30:.2f} -> {peak / 2**30:.2f} GiB", moment)


def correct_estimate(model_spec: ModelSpec, train_spec: TrainSpec, probe: ProbeResult, *,
                     correction: float = 1.0) -> ProbeFit:
    """:func:`fit_probe` with the estimates made here: ``estimate(model_spec, probe_train_spec(...))``
    at each measured size, and ``estimate(model_spec, train_spec)`` for the run.

    Raises:
        ConfigError: what ``estimate`` raises for the specs; a probe of another device.
    """
    run = estimate(model_spec, train_spec, correction=correction)
    if not probe.measured:
        return fit_probe(probe, [], run)
    at = [estimate(model_spec, probe_train_spec(train_spec, s.rows, s.tokens), correction=correction)
          for s in probe.steps]
    return fit_probe(probe, at, run)
