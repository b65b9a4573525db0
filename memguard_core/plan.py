"""Planner: the least-degrading training settings that fit a memory budget.

``plan(model_spec, train_spec, budget_bytes)`` returns the requested settings unchanged when their
estimate fits; otherwise it downgrades in a quality-preserving order: checkpointing and a smaller
micro-batch first (searched together for the shortest predicted step time,
:func:`relative_step_time`), then a halved sequence length, LoRA rank, LoRA layers. ``allow``
limits the steps; when nothing fits, ``DoesNotFitError`` carries the shortfall and suggestions.
The order and its rules: docs/design.md, "The budget and the plan".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional, Tuple

from .errors import ConfigError, DoesNotFitError, require_fraction, require_positive_int
from .estimator.estimate import estimate
from .estimator.image_blocks import is_image_classifier, with_patch_tokens
from .estimator.lora_targets import with_default_lora_targets
from .estimator.result import MemoryEstimate
from .estimator.specs import NF4_BITS, ModelSpec, TrainSpec

__all__ = ["Change", "Plan", "plan", "budget_from_available", "relative_step_time", "STEPS",
           "DEFAULT_SAFETY_RATIO", "MICRO_BATCH_OVERHEAD_TOKENS"]

#: The downgrade steps in the order they are tried.
STEPS = ("grad_checkpoint", "micro_batch", "seq_length", "lora_rank", "lora_layers")

#: Fraction of the available memory the planner may use (the rest stays free as headroom).
DEFAULT_SAFETY_RATIO = 0.8

#: Fixed cost of one micro-batch (its forward and backward launch, Python and framework work, the
#: weights read once per micro-batch) in tokens' worth of compute: a micro-batch of M tokens runs at
#: M / (M + MICRO_BATCH_OVERHEAD_TOKENS) of full efficiency. Fitted to CPU runs of an HF Trainer
#: full fine-tune split into 2 and 4 micro-batches (bench/fit_quality.py). GPUs lose more to small
#: micro-batches (kernel launches, occupancy); the value there is an assumption, not measured.
MICRO_BATCH_OVERHEAD_TOKENS = 256

#: Floors of the halving steps.
MIN_SEQ_LENGTH = 64
MIN_LORA_RANK = 1
MIN_LORA_LAYERS = 1


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Change:
    """One setting the planner changed.

    Attributes:
        field: the TrainSpec field (``grad_checkpoint``, ``batch_size``, ``seq_length``,
            ``lora_rank``, ``lora_layers``; a micro-batch change lists ``batch_size`` and
            ``grad_accum`` as two Changes with the same reason).
        old / new: the values before and after.
        reason: a human sentence with the estimates that led to it.
    """

    field: str
    old: Any
    new: Any
    reason: str

    def to_dict(self) -> dict:
        return {"field": self.field, "old": self.old, "new": self.new, "reason": self.reason}


@dataclass(frozen=True)
class Plan:
    """The planner's answer.

    Attributes:
        fits: the chosen settings' estimate is within the budget (always True on return:
            ``plan`` raises ``DoesNotFitError`` otherwise).
        train_spec: the chosen settings.
        original: the requested settings.
        estimate: the estimate of the chosen settings.
        budget_bytes: the budget planned against.
        changes: what changed and why, in the order applied.
        micro_batches: original micro-batch / chosen micro-batch (an integer >= 1): adapters cut
            each batch into this many row-chunks in place.
    """

    fits: bool
    train_spec: TrainSpec
    original: TrainSpec
    estimate: MemoryEstimate
    budget_bytes: int
    changes: List[Change] = field(default_factory=list)
    micro_batches: int = 1

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "budget_bytes": int(self.budget_bytes),
            "peak_bytes": int(self.estimate.peak_bytes),
            "micro_batches": int(self.micro_batches),
            "changes": [c.to_dict() for c in self.changes],
            "estimate": self.estimate.to_dict(),
        }


def budget_from_available(available_bytes: int, safety_ratio: float = DEFAULT_SAFETY_RATIO) -> int:
    """Budget = available x safety ratio (:data:`DEFAULT_SAFETY_RATIO` unless given).

    Args:
        available_bytes: memory the device offers now (bytes, >= 0).
        safety_ratio: fraction in (0, 1].

    Raises:
        ConfigError: negative/non-integer available bytes, ratio outside (0, 1].
    """
    avail = require_positive_int("available_bytes", available_bytes, allow_zero=True)
    ratio = require_fraction("safety_ratio", safety_ratio)
    return int(avail * ratio)


def _divisors_desc(n: int) -> List[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def _validate(ms, ts, budget_bytes, allow, min_batch) -> Tuple[int, Tuple[str, ...], int]:
    if not isinstance(ms, ModelSpec):
        raise ConfigError("model_spec", "a memguard_core.estimator.specs.ModelSpec", type(ms).__name__)
    if not isinstance(ts, TrainSpec):
        raise ConfigError("train_spec", "a memguard_core.estimator.specs.TrainSpec", type(ts).__name__)
    budget = require_positive_int("budget_bytes", budget_bytes)
    if isinstance(allow, str):
        allow = (allow,)
    try:
        allow = tuple(allow)
    except TypeError:
        raise ConfigError("allow", "a list of " + ", ".join(STEPS), allow) from None
    bad = [a for a in allow if a not in STEPS]
    if bad:
        raise ConfigError("allow", "a list of " + ", ".join(STEPS), bad)
    min_batch = require_positive_int("min_batch", min_batch)
    return budget, allow, min_batch


def relative_step_time(model_spec: ModelSpec, train_spec: TrainSpec, reference: TrainSpec) -> float:
    """Predicted time of one optimizer step under ``train_spec`` relative to ``reference`` (same
    model, same effective batch), for choosing between changes that cost no quality.

    Compute per token: a forward F = 2 x active parameters (Kaplan et al. 2020, "Scaling Laws for
    Neural Language Models", C_forward ~ 2N); a backward of 2F when the weights train (input and
    weight gradients) and of ~F when they are frozen (LoRA / QLoRA: only input gradients flow
    through the base weights). Gradient checkpointing adds one forward of the blocks (Chen et al.
    2016, "Training Deep Nets with Sublinear Memory Cost"): x (1 + F / (F + B)), i.e. 4/3 for a full
    fine-tune and 3/2 for LoRA. A micro-batch of M tokens runs at efficiency M / (M +
    ``MICRO_BATCH_OVERHEAD_TOKENS``), so splitting is nearly free while micro-batches stay large.

    Returns:
        the ratio (> 1: slower than the reference).
    """
    def cost(t: TrainSpec) -> float:
        backward = 2.0 if t.method == "full" else 1.0
        ckpt = 1.0 + 1.0 / (1.0 + backward) if t.grad_checkpoint else 1.0
        micro_tokens = max(1, t.batch_size * t.seq_length)
        return ckpt * (1.0 + MICRO_BATCH_OVERHEAD_TOKENS / micro_tokens)

    return cost(train_spec) / cost(reference)


class _Search:
    def __init__(self, ms, ts, budget, correction, shown_offset=0, target_name="budget"):
        self.ms, self.budget, self.correction = ms, budget, correction
        # reasons quote peak and target with ``shown_offset`` added back (the preflight plans against
        # its target less what the process already holds; the user reads both with it included)
        self.off, self.target_name = int(shown_offset), target_name
        self.cur = ts
        self.est = estimate(ms, ts, correction=correction)
        self.changes: List[Change] = []
        self.cache = {}

    def est_of(self, ts: TrainSpec) -> MemoryEstimate:
        if ts not in self.cache:
            self.cache[ts] = estimate(self.ms, ts, correction=self.correction)
        return self.cache[ts]

    def fits(self, ts: Optional[TrainSpec] = None) -> bool:
        e = self.est if ts is None else self.est_of(ts)
        return e.peak_bytes <= self.budget

    def apply(self, ts: TrainSpec, fields: Iterable[str], reason: str) -> None:
        for f in fields:
            self.changes.append(Change(f, getattr(self.cur, f), getattr(ts, f), reason))
        self.cur, self.est = ts, self.est_of(ts)

    def verdict(self, ts: TrainSpec) -> str:
        p = self.est_of(ts).peak_bytes
        rel = "<=" if p <= self.budget else ">"
        held = f" ({_gib(self.off)} of it already held)" if self.off else ""
        return f"estimated peak {_gib(p + self.off)}{held} {rel} {_gib(self.budget + self.off)}, {self.target_name}"

    # ---- steps -------------------------------------------------------------------------------

    def quality_preserving(self, original: TrainSpec, min_batch: int, allow: Tuple[str, ...]) -> None:
        """Checkpointing and the micro-batch together: the fitting combination with the shortest
        ``relative_step_time``; when none fits, checkpointing and the smallest micro-batch."""
        c = self.cur
        ob, oa = original.batch_size, original.grad_accum
        # LitGPT's finetune/lora.py has no activation checkpointing to switch on
        ckpts = [c.grad_checkpoint] + ([True] if "grad_checkpoint" in allow and not c.grad_checkpoint
                                       and c.model_code != "litgpt" else [])
        if "micro_batch" in allow:
            divs = [d for d in _divisors_desc(ob) if d >= min(min_batch, ob) and d <= c.batch_size]
        else:
            divs = [c.batch_size]
        cands = [c.replace(grad_checkpoint=g, batch_size=d, grad_accum=oa * (ob // d) if d != c.batch_size
                           else c.grad_accum) for g in ckpts for d in divs]
        fitting = [t for t in cands if self.fits(t)]
        if fitting:
            best = min(fitting, key=lambda t: (relative_step_time(self.ms, t, c), -t.batch_size))
        else:
            best = c.replace(grad_checkpoint=ckpts[-1], batch_size=divs[-1],
                             grad_accum=oa * (ob // divs[-1]) if divs[-1] != c.batch_size else c.grad_accum)
        others = ""
        if fitting and len(fitting) > 1:
            # the runner-up by the same rule as the choice (a tie on time goes to the larger micro-batch)
            alt = min((t for t in fitting if t != best), key=lambda t: (relative_step_time(self.ms, t, c), -t.batch_size))
            tb, ta = relative_step_time(self.ms, best, c), relative_step_time(self.ms, alt, c)
            others = (f"; predicted step time x{tb:.2f} of the requested settings vs x{ta:.2f} for the next "
                      f"option that fits ({_describe(alt, c)})"
                      + ("; as fast, so the larger micro-batch" if f"{tb:.2f}" == f"{ta:.2f}" else ""))
        if best.grad_checkpoint != c.grad_checkpoint:
            t = c.replace(grad_checkpoint=True)
            self.apply(t, ("grad_checkpoint",),
                       "gradient checkpointing keeps one block input per layer and recomputes the "
                       f"rest in the backward; {self.verdict(t)}"
                       + (others if best.batch_size == c.batch_size else ""))
        if best.batch_size != self.cur.batch_size:
            self._apply_micro(best, others)

    def _apply_micro(self, t: TrainSpec, extra: str = "") -> None:
        c = self.cur
        eff = t.batch_size * t.grad_accum
        tail = self.verdict(t)
        bigger = [d for d in _divisors_desc(c.batch_size * 1) if d > t.batch_size]
        if bigger and t.batch_size != c.batch_size:
            nxt = min(d for d in _divisors_desc(c.batch_size) if d > t.batch_size)
            e_n = self.est_of(c.replace(batch_size=nxt, grad_accum=eff // nxt))
            if e_n.peak_bytes > self.budget:
                tail += f" (at {nxt}: {_gib(e_n.peak_bytes + self.off)} > {_gib(self.budget + self.off)})"
        reason = (f"micro-batch {c.batch_size} -> {t.batch_size} with gradient accumulation "
                  f"{c.grad_accum} -> {t.grad_accum} keeps the effective batch of {eff}; {tail}{extra}")
        self.apply(t, ("batch_size", "grad_accum"), reason)

    def remaximise_micro(self, original: TrainSpec) -> None:
        """After a later step fits, take the largest micro-batch that still fits."""
        ob, oa = original.batch_size, original.grad_accum
        for d in _divisors_desc(ob):
            if d <= self.cur.batch_size:
                return
            t = self.cur.replace(batch_size=d, grad_accum=oa * (ob // d))
            if self.fits(t):
                c = self.cur
                reason = (f"micro-batch {c.batch_size} -> {d} with gradient accumulation "
                          f"{c.grad_accum} -> {t.grad_accum} (the largest that fits after the "
                          f"changes above; effective batch {d * t.grad_accum}); {self.verdict(t)}")
                self.apply(t, ("batch_size", "grad_accum"), reason)
                return

    def halve(self, fld: str, floor: int, what: str) -> None:
        """Halve ``fld`` until the estimate fits or the floor is reached."""
        while not self.fits():
            v = getattr(self.cur, fld)
            if v is None:
                v = self.ms.num_layers
            nv = max(v // 2, floor)
            if nv >= v:
                return
            t = self.cur.replace(**{fld: nv})
            self.apply(t, (fld,), f"{what} {v} -> {nv}: {self.verdict(t)}")


def plan(model_spec: ModelSpec, train_spec: TrainSpec, budget_bytes: int, *,
         allow: Iterable[str] = STEPS, min_batch: int = 1, correction: float = 1.0,
         shown_offset: int = 0, target_name: str = "the budget") -> Plan:
    """Find the least-degrading settings whose estimated peak fits ``budget_bytes``.

    Args:
        model_spec / train_spec: what to train and how (requested settings).
        budget_bytes: bytes the run may use (``budget_from_available(available, ratio)``).
        allow: which steps may be taken, a subset of ``STEPS``.
        min_batch: smallest micro-batch the planner may choose.
        correction: calibration factor passed to ``estimate``.
        shown_offset, target_name: for the reasons only: bytes added back to every peak and to
            ``budget_bytes`` when quoted, and what ``budget_bytes`` is called (the preflight plans
            against a target derived from the user's budget: see ``preflight.plan_in_place``).

    Returns:
        Plan (``fits=True``); unchanged settings and no changes when the request already fits.

    Raises:
        ConfigError: bad specs, budget <= 0, unknown step in ``allow``, min_batch < 1.
        DoesNotFitError: no allowed combination fits; with shortfall (best peak - budget), the
            budget, the best peak and the suggestions not already applied.
    """
    budget, allow, min_batch = _validate(model_spec, train_spec, budget_bytes, allow, min_batch)
    ms, ts = model_spec, with_default_lora_targets(model_spec, train_spec)  # PEFT's targets when none given
    ts = with_patch_tokens(ms, ts)   # an image classifier's tokens are its patches, whatever was asked
    s = _Search(ms, ts, budget, correction, shown_offset, target_name)

    def done() -> Plan:
        if s.changes and any(c.field not in ("batch_size", "grad_accum") for c in s.changes) \
                and "micro_batch" in allow:
            s.remaximise_micro(ts)
        return Plan(fits=True, train_spec=s.cur, original=ts, estimate=s.est, budget_bytes=budget,
                    changes=list(s.changes), micro_batches=ts.batch_size // s.cur.batch_size)

    if s.fits():
        return done()
    lora = ts.method != "full"
    if "grad_checkpoint" in allow or "micro_batch" in allow:
        s.quality_preserving(ts, min_batch, allow)
        if s.fits():
            return done()
    for step in STEPS[2:]:
        if step not in allow:
            continue
        if step == "seq_length":
            if is_image_classifier(ms):   # an image's patches cannot be made fewer here
                continue
            s.halve("seq_length", min(MIN_SEQ_LENGTH, s.cur.seq_length), "sequence length")
        elif step == "lora_rank" and lora:
            s.halve("lora_rank", MIN_LORA_RANK, "LoRA rank")
        elif step == "lora_layers" and lora and ts.model_code != "litgpt":  # LitGPT adapts every block
            s.halve("lora_layers", MIN_LORA_LAYERS, "LoRA layers (last N blocks)")
        if s.fits():
            return done()

    raise DoesNotFitError(s.est.peak_bytes - budget, budget, s.est.peak_bytes,
                          _suggestions(ms, ts, s.cur, allow))


def _describe(t: TrainSpec, requested: TrainSpec) -> str:
    """An option of the micro-batch search, saying checkpointing only where it is a change."""
    return f"micro-batch {t.batch_size}" + (" + checkpointing" if t.grad_checkpoint and not requested.grad_checkpoint
                                            else "")


#: A suggestion whose estimated saving is below this share of the best plan's peak is not listed
#: (an 8-bit optimizer for a LoRA run whose optimizer states are a few MiB): it cannot close a
#: shortfall, and listing it sends users after changes that do nothing.
SUGGESTION_MIN_SAVING = 0.01


def _suggestions(ms: ModelSpec, original: TrainSpec, cur: TrainSpec, allow) -> List[str]:
    """The changes that lower the peak further, in the planner's order, minus what is already
    applied, each with what it alone would save on top of the best plan (``estimate`` of the
    changed settings), so a user sees which can close the shortfall; a change that saves less than
    :data:`SUGGESTION_MIN_SAVING` of the peak is left out. Spelt in the run's framework (HF keywords
    for ``hf``)."""
    hf, mlx = cur.framework == "hf", cur.framework == "mlx"
    candidates: List[Tuple[str, Optional[Tuple[ModelSpec, TrainSpec]]]] = []
    if cur.method != "qlora" and ms.weight_bits >= 8:
        how = (" (load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True)" if hf
               else " (mlx_lm.convert --quantize)" if mlx else " (bitsandbytes NF4)")
        candidates.append(("quantize the base model to 4-bit and train QLoRA" + how,
                           (ms.replace(weight_bits=NF4_BITS), cur.replace(method="qlora"))))
    if not cur.grad_checkpoint and cur.model_code != "litgpt":
        candidates.append(("enable gradient checkpointing", (ms, cur.replace(grad_checkpoint=True))))
    if cur.batch_size > 1:
        candidates.append((f"use micro-batch 1 with gradient accumulation {cur.batch_size * cur.grad_accum}",
                           (ms, cur.replace(batch_size=1, grad_accum=cur.batch_size * cur.grad_accum))))
    if cur.seq_length > 64 and not is_image_classifier(ms):
        candidates.append((f"use shorter sequences (now {cur.seq_length} tokens; half shown)",
                           (ms, cur.replace(seq_length=cur.seq_length // 2))))
    if cur.method != "full" and cur.lora_rank > 1:
        candidates.append((f"use a smaller LoRA rank (now {cur.lora_rank}; half shown)",
                           (ms, cur.replace(lora_rank=max(1, cur.lora_rank // 2)))))
    if cur.method != "full" and cur.model_code != "litgpt":
        n = cur.lora_layers or ms.num_layers
        if n > 1:
            candidates.append((f"put LoRA on fewer layers (now {n}; half shown)",
                               (ms, cur.replace(lora_layers=max(1, n // 2)))))
    if cur.method == "full":
        candidates.append(("train LoRA adapters instead of the full model", (ms, cur.replace(method="lora"))))
    if cur.optimizer in ("adam", "adamw") and not mlx:
        how = " (optim='adamw_bnb_8bit')" if hf else " (bitsandbytes.optim.AdamW8bit)"
        candidates.append(("use an 8-bit optimizer" + how, (ms, cur.replace(optimizer="adamw-8bit"))))
    if cur.attn_impl == "eager":
        how = "attn_implementation='sdpa'" if hf else "SDPA attention"
        candidates.append((f"use {how} (O(s) attention memory)", (ms, cur.replace(attn_impl="sdpa"))))
    if cur.dtype == "fp32" or cur.mixed_precision:
        candidates.append(("load the weights in bf16 (half the weight memory)",
                           (ms, cur.replace(dtype="bf16", mixed_precision=False))))
    out = []
    base = _peak_or_none(ms, cur)
    for text, changed in candidates:
        after = _peak_or_none(*changed) if changed is not None and base is not None else None
        if after is None:
            out.append(text)
        elif base - after >= SUGGESTION_MIN_SAVING * base:
            out.append(f"{text}: saves about {(base - after) / 2**30:.2f} GiB")
    out.append("use a smaller model")
    out.append("run on a machine (or container limit) with more memory")
    return out


def _peak_or_none(ms: ModelSpec, ts: TrainSpec) -> Optional[int]:
    """The estimated peak of a suggestion's settings; None where the estimator cannot price them
    (the suggestion is then listed without a figure)."""
    try:
        return estimate(ms, ts).peak_bytes
    except Exception:
        return None
