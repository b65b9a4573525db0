"""When the preflight runs its in-process measurement (``GuardOptions.preflight_probe``) and at which
sizes; the measuring is the torch adapters' (``memguard_torch.preflight_probe``), the fit the
estimator's (``memguard_core.estimator.probe_fit``). docs/estimator.md, "In-process measurement".
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple, Union

from .estimator.image_blocks import is_image_classifier
from .estimator.specs import ModelSpec, TrainSpec

__all__ = ["PROBE_TOKENS", "AUTO_MAX_SECONDS", "CPU_PROBE_FLOPS", "CPU_MIN_STEP_BYTES", "Measure", "probe_sizes",
           "predicted_seconds", "predicted_step_bytes", "probe_decision"]

#: Tokens of the two one-row probe steps (the issue's "a few hundred tokens; a second size for a slope").
PROBE_TOKENS = (256, 512)
#: ``preflight_probe="auto"`` runs the measurement where it is predicted to cost at most this long.
AUTO_MAX_SECONDS = 3.0
#: FLOP/s a CPU probe step is assumed to reach: a slow one-thread figure on purpose, so that "auto"
#: errs towards not spending the user's time (where it was read: docs/estimator.md, "In-process
#: measurement").
CPU_PROBE_FLOPS = 3e10
#: ``"auto"`` on a CPU also needs the predicted step at the larger probe size to be at least this
#: large: VmHWM is read in pages after a heap that moves by a few MiB between steps, and a tiny
#: model's 30-50 MiB step read 10-25 % apart between runs (docs/estimator.md, "In-process
#: measurement"), a noise the fit would multiply over the run's tokens.
CPU_MIN_STEP_BYTES = 64 * 2**20

#: The adapter's measurement: ``measure(sizes, max_seconds) -> ProbeResult`` (sizes ``(rows,
#: tokens)``); it never raises (``memguard_torch.preflight_probe.measure_steps``).
Measure = Callable[[Sequence[Tuple[int, int]], Optional[float]], object]


def probe_sizes(ts: TrainSpec, ms: Optional[ModelSpec] = None) -> Tuple[Tuple[int, int], ...]:
    """The ``(rows, tokens)`` of the probe steps: one row of each of :data:`PROBE_TOKENS`, capped
    at the run's sequence length (one size when the run's rows are that short or shorter than the
    smaller size: the second then adds no slope). An image classifier (``ms``): one row at its
    patch count (``ModelSpec.patch_tokens``: a batch cannot be cut to fewer), whatever
    ``ts.seq_length`` says."""
    if ms is not None and is_image_classifier(ms):
        return ((1, int(ms.patch_tokens)),)
    seq = int(ts.seq_length)
    sizes = sorted({min(t, seq) for t in PROBE_TOKENS})
    return tuple((1, t) for t in sizes)


def predicted_seconds(ms: ModelSpec, ts: TrainSpec) -> float:
    """The probe's predicted cost on a CPU, seconds: 6 x parameters FLOPs a token (forward 2,
    backward 4: Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1) over
    the probe's tokens, at :data:`CPU_PROBE_FLOPS`."""
    tokens = sum(t * r for r, t in probe_sizes(ts, ms))
    return 6.0 * float(ms.total_params) * tokens / CPU_PROBE_FLOPS


def predicted_step_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """The estimate's step at the larger probe size as the probe reads it (fixed + per-token +
    the CPU heap slack, at the larger of its two step moments), bytes."""
    from .estimator.estimate import estimate
    from .estimator.probe_fit import STEP_MOMENTS, probe_train_spec, step_parts

    rows, tokens = probe_sizes(ts, ms)[-1]
    est = estimate(ms, probe_train_spec(ts, rows, tokens))
    return max(sum(v for k, v in step_parts(est, m).items() if k != "held") for m in STEP_MOMENTS)


def probe_decision(option: Union[bool, str], ms: ModelSpec, ts: TrainSpec) -> Tuple[bool, str]:
    """Whether to run the measurement, and if not why (one clause for the log).

    ``False``: never; ``True``: always; ``"auto"``: on CUDA and MPS (one row of a few hundred
    tokens is a fraction of a training step there), on a CPU when :func:`predicted_seconds` is at
    most :data:`AUTO_MAX_SECONDS` and its step at least :data:`CPU_MIN_STEP_BYTES`, never on other counters (MLX) or with more than one rank (the
    probe's backward would meet the data-parallel hooks)."""
    if option is False:
        return False, "off (preflight_probe=False)"
    if ts.world_size > 1:
        return False, f"not run: {ts.world_size} ranks (the measurement is for one process)"
    if option is True:
        return True, ""
    if ts.device in ("cuda", "mps"):
        return True, ""
    if ts.device == "cpu":
        s = predicted_seconds(ms, ts)
        if s > AUTO_MAX_SECONDS:
            return False, (f"not run: about {s:.0f} s on a CPU for a model of this size (preflight_probe='auto' runs "
                           f"it below {AUTO_MAX_SECONDS:.0f} s; True runs it)")
        step = predicted_step_bytes(ms, ts)
        if step < CPU_MIN_STEP_BYTES:
            return False, (f"not run: its step (~{step / 2**20:.0f} MiB) is within the CPU counter's noise "
                           f"(preflight_probe='auto' needs {CPU_MIN_STEP_BYTES // 2**20} MiB; True runs it)")
        return True, ""
    return False, f"not run on the {ts.device} counter"
