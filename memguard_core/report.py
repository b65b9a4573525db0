"""Readable tables (rich) for estimates, plans and probes, and the parts the
``memguard demo`` runs (HF ``Trainer``, Lightning, mlx_lm) share: the shipped text as byte-token
rows, the budget choice, the co-tenant squeeze and the result table. No framework import here:
the callers pass in what they measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from rich.console import Console
from rich.table import Table

GiB = 2**30
MiB = 2**20
_console: Optional[Console] = None


def console() -> Console:
    global _console
    if _console is None:
        _console = Console(highlight=False)
    return _console


def gib(n: Optional[float]) -> str:
    """Bytes as GiB with 2 decimals; ``-`` for None."""
    return "-" if n is None else f"{n / GiB:,.2f} GiB"


def mib(n: Optional[float]) -> str:
    """Bytes as MiB with 3 decimals (figures of tens of MiB, which ``gib`` shows as 0.00 GiB); ``-``
    for None."""
    return "-" if n is None else f"{n / MiB:,.3f} MiB"


def yes_no(ok: bool) -> str:
    """A green ``yes`` or a red ``NO`` (rich markup)."""
    return "[green]yes[/green]" if ok else "[red]NO[/red]"


def estimate_table(est, budget_bytes: Optional[int] = None, title: str = "memguard estimate") -> Table:
    """A table of an estimate's breakdown (and the verdict against ``budget_bytes``)."""
    ms, ts = est.model_spec, est.train_spec
    t = Table(title=title, caption=(
        f"{ms.name}: {ms.total_params / 1e6:,.1f}M params, weights {weights_label(ms)}, {ts.method}"
        f"{f' r={ts.lora_rank}' if ts.method != 'full' else ''}"
        f"{f' dropout {ts.lora_dropout:g}' if ts.method != 'full' and getattr(ts, 'lora_dropout', 0) else ''}"
        f", micro-batch {ts.batch_size} x accum "
        f"{ts.grad_accum}, seq {ts.seq_length}, {ts.optimizer}, compute {ts.dtype}"
        f"{' (autocast)' if ts.mixed_precision else ''}, ckpt {'on' if ts.grad_checkpoint else 'off'}, "
        f"attn {ts.attn_impl}, framework {ts.framework}"
        f"{f', model code {ts.model_code}' if getattr(ts, 'model_code', 'transformers') != 'transformers' else ''}"
        f"{f', image tokens {ts.image_tokens}/row' if getattr(ts, 'image_tokens', 0) else ''}"
        f"{f', vision tower {ms.params.vision / 1e6:,.1f}M' if getattr(ms.params, 'vision', 0) else ''}"
        f"; predicts {COUNTER_LABELS.get(est.counter, est.counter)}"))
    t.add_column(f"term (at the {est.phase} peak)")
    t.add_column("GiB", justify="right")
    t.add_column("share", justify="right")
    for name, val in est.breakdown.items():
        if val:
            t.add_row(name, f"{val / GiB:,.2f}", f"{val / max(1, est.peak_bytes):.0%}")
        elif name == "gradients" and est.trainable_params:
            # no gradient is held yet at the loss moment: say so, with the backward moment's figure
            at_backward = (getattr(est, "phase_breakdowns", {}) or {}).get("backward", {}).get("gradients", 0)
            size = f"{at_backward / GiB:,.2f} GiB" if at_backward >= GiB / 100 else f"{at_backward / 2**20:,.1f} MiB"
            t.add_row(f"gradients (none yet at the {est.phase} moment; {size} at the backward moment)", "0.00", "0%")
    t.add_section()
    t.add_row(f"[b]peak ({est.counter}), at the {est.phase} moment[/b]", f"[b]{est.peak_bytes / GiB:,.2f}[/b]", "")
    for phase, val in est.phases.items():
        t.add_row(f"  {phase} moment", f"{val / GiB:,.2f}", "" if phase != est.phase else "peak")
    for note in getattr(est, "notes", ()):
        t.add_row(f"[dim]note: {note}[/dim]", "", "")
    if budget_bytes is not None:
        ok = est.peak_bytes <= budget_bytes
        t.add_row("budget", f"{budget_bytes / GiB:,.2f}", f"{est.peak_bytes / budget_bytes:.0%} used")
        t.add_row("verdict", "[green]fits[/green]" if ok else "[red]does not fit[/red]", "")
    return t


#: What each counter measures, as the table names it.
COUNTER_LABELS = {
    "cpu": "cpu: the process's peak RSS (VmHWM)",
    "cuda": "cuda: peak device memory (allocator reserved + CUDA context)",
    "mlx": "mlx: mx.get_peak_memory()",
}


def weights_label(ms) -> str:
    """The stored weights' dtype of a spec, as the estimate counts them (``bf16``, ``fp32``,
    ``NF4 + bf16``: quantized block linears and the rest)."""
    def name(bits: float) -> str:
        return {32.0: "fp32", 16.0: ms.weight_dtype if ms.weight_dtype in ("bf16", "fp16") else "16-bit"}.get(
            float(bits), f"{bits:g}-bit")
    if ms.weight_bits < 16:
        from .estimator.specs import GROUP64_OVERHEAD_BITS, NF4_BITS, NF4_DOUBLE_QUANT_BITS

        # plain numbers (--model-bits 2 / 3 / 4 ...) carry group-64 scales, a model read from a config
        # or a module at 4.5 / 4.127 bits is bitsandbytes' NF4
        nominal = ms.weight_bits - GROUP64_OVERHEAD_BITS
        if ms.weight_bits in (NF4_BITS, NF4_DOUBLE_QUANT_BITS) and ms.source != "numbers":
            q = "NF4"
        elif ms.source == "numbers" and float(nominal).is_integer():
            q = f"{nominal:g}-bit"
        else:
            q = f"{ms.weight_bits:g}-bit"
        return f"{q} + {name(ms.dense_bits)}"
    return name(ms.dense_bits)


def print_estimate(est, budget_bytes: Optional[int] = None) -> None:
    console().print(estimate_table(est, budget_bytes))


def plan_table(plan, preflight: Any = None) -> Table:
    """The plan's changes, its peak and what it was planned against. With the ``preflight`` that made
    it, the peak includes what the process already held and the target is named as the share of the
    budget the user set (the figures the preflight's log lines quote)."""
    t = Table(title="memguard plan (quality-preserving order)")
    t.add_column("setting")
    t.add_column("requested", justify="right")
    t.add_column("planned", justify="right")
    t.add_column("why")
    rows = {}
    for c in plan.changes:  # a micro-batch change is two Changes (batch_size, grad_accum), one reason
        if c.reason in rows:
            f, o, n = rows[c.reason]
            rows[c.reason] = (f"{f} x {c.field}", f"{o} x {c.old}", f"{n} x {c.new}")
        else:
            rows[c.reason] = (c.field, str(c.old), str(c.new))
    for reason, (f, o, n) in rows.items():
        t.add_row(f, o, n, reason)
    t.add_section()
    if preflight is not None:
        pf = preflight
        t.add_row("peak", gib(pf.requested_peak_bytes), gib(pf.best_peak_bytes),
                  f"target {gib(int(pf.budget_bytes * pf.plan_fraction))}: {pf.plan_fraction:.0%} of the "
                  f"{gib(pf.budget_bytes)} budget")
    else:
        t.add_row("peak", "", gib(plan.estimate.peak_bytes), f"budget {gib(plan.budget_bytes)}")
    eff_old = plan.original.effective_batch
    eff_new = plan.train_spec.effective_batch
    t.add_row("effective batch", str(eff_old), str(eff_new), "kept" if eff_old == eff_new else "CHANGED")
    return t


def print_plan(plan) -> None:
    console().print(plan_table(plan))


def probe_table(snap) -> Table:
    from .probes import display_rows

    t = Table(title=f"memguard probe ({snap.source})")
    t.add_column("what")
    t.add_column("value", justify="right")
    for what, value in display_rows(snap, gib):
        t.add_row(what, value)
    return t


def print_probe(snap) -> None:
    console().print(probe_table(snap))


# ---------------------------------------------------------------------------------- the demos
#: The text shipped for the demos (package data of ``memguard_core``, shared by every adapter's demo).
DEMO_CORPUS = Path(__file__).resolve().parent / "data" / "demo_corpus.txt"
#: Byte ``b`` of the text is token ``b + BYTE_OFFSET`` (ids 0..2 are the special tokens of the
#: demo models' configs: SmolLM2's bos 1, eos/pad 2).
BYTE_OFFSET = 3


def demo_rows(seq_length: int) -> List[List[int]]:
    """The shipped text, tokenised byte-wise (no tokenizer download), as non-overlapping windows of
    ``seq_length`` tokens (the last partial window dropped)."""
    ids = [b + BYTE_OFFSET for b in DEMO_CORPUS.read_text(encoding="utf-8").encode("utf-8")]
    return [ids[i:i + seq_length] for i in range(0, len(ids) - seq_length + 1, seq_length)]

Format = Callable[[Optional[float]], str]


def demo_budget(model_spec, train_spec, budget_gib: Optional[float] = None, *,
                resident_bytes: Optional[int] = None, margin: float = 1.03, what: str = "micro-batch",
                fmt: Format = gib) -> int:
    """The budget of a ``memguard demo`` run (bytes), printed with why it was chosen.

    ``budget_gib`` GiB when given (the ``--budget-gib`` flag; None or 0: choose). Else a budget the
    requested ``train_spec`` does not fit but half its micro-batch does (the same effective batch:
    half the rows, twice the accumulation): that spec's estimate plus what this process holds
    beyond it (``resident_bytes``, the CPU counter's RSS; None where the counter does not see the
    process, as ``mx.get_peak_memory``), over the guard's warning level (``Thresholds().warning``,
    which the preflights plan against), times ``margin``
    (``memguard_core.preflight.budget_that_fits``).
    """
    if budget_gib:
        return int(budget_gib * GiB)
    from .monitor import Thresholds
    from .preflight import budget_that_fits

    warning = Thresholds().warning
    half = train_spec.replace(batch_size=max(1, train_spec.batch_size // 2), grad_accum=train_spec.grad_accum * 2)
    budget = budget_that_fits(model_spec, half, resident_bytes=resident_bytes, plan_fraction=warning, margin=margin)
    held = ", plus what this process already holds," if resident_bytes else ""
    console().print(f"budget: {fmt(budget)} (chosen so the requested {what} does not fit: half of it{held} fits "
                    f"below the guard's {warning:.0%} warning level, which the preflight plans against, "
                    f"with a {margin - 1:.0%} margin)")
    return budget


def demo_squeeze(monitor, fraction: float, when: str, fmt: Format = gib) -> None:
    """Take ``fraction`` of ``monitor.budget_bytes`` away, as a co-tenant arriving in the same
    container would, and say so (``when``: e.g. ``step 2``)."""
    old = monitor.budget_bytes
    monitor.budget_bytes = int(old * (1 - fraction))
    console().print(f"[yellow]demo: a co-tenant arrives at {when}: the budget drops "
                    f"{fmt(old)} -> {fmt(monitor.budget_bytes)}[/yellow]")


def print_applied_plan(preflight) -> None:
    """Print the plan of an adapter's preflight (``memguard_core.preflight.Preflight``) when it
    changed anything; nothing for None (no preflight ran) or an empty plan."""
    if preflight is not None and preflight.plan.changes:
        console().print(plan_table(preflight.plan, preflight))


def demo_result_table(title: str, rows: Sequence[Tuple[str, str]], *, requested_peak_bytes: int,
                      summary: Optional[Mapping[str, Any]], measured: str, budget_bytes: int,
                      end_budget_bytes: Optional[int], wall_s: float, extra_rows: Sequence[Tuple[str, str]] = (),
                      fmt: Format = gib) -> Table:
    """The result table of a ``memguard demo`` run: the framework's own ``rows`` (what / value),
    then the estimates against the measured peak, the budget at the start and at the end, the
    training wall time, then ``extra_rows``.

    ``summary``: the guard's ``summary`` (``estimated_peak_bytes``: the planned settings' estimate,
    ``measured_peak_bytes``: the peak measured by ``measured``, e.g. ``VmHWM, training steps``);
    None or missing keys show as ``-``. The estimate error is (estimated - measured) / measured.
    """
    s = summary or {}
    est, meas = s.get("estimated_peak_bytes"), s.get("measured_peak_bytes")
    # the summary's requested estimate counts what the process held, as the planned one does
    requested_peak_bytes = s.get("requested_peak_bytes") or requested_peak_bytes
    t = Table(title=title)
    t.add_column("what")
    t.add_column("value", justify="right")
    for what, value in rows:
        t.add_row(what, value)
    t.add_row("estimated peak, requested settings", fmt(requested_peak_bytes))
    t.add_row("estimated peak, planned settings", fmt(est))
    t.add_row(f"measured peak ({measured})", fmt(meas))
    if est and meas:
        t.add_row("estimate error (planned vs measured)", f"{(est - meas) / meas:+.1%}")
    t.add_row("budget (start / end)", f"{fmt(budget_bytes)} / {fmt(end_budget_bytes)}")
    t.add_row("training wall time", f"{wall_s:.0f} s")
    for what, value in extra_rows:
        t.add_row(what, value)
    return t
