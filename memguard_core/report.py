"""Readable tables (rich) for estimates, plans and probes."""

from __future__ import annotations

from typing import Optional

from rich.console import Console
from rich.table import Table

GiB = 2**30
_console: Optional[Console] = None


def console() -> Console:
    global _console
    if _console is None:
        _console = Console(highlight=False)
    return _console


def gib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / GiB:,.2f} GiB"


def estimate_table(est, budget_bytes: Optional[int] = None, title: str = "memguard estimate") -> Table:
    """A table of an estimate's breakdown (and the verdict against ``budget_bytes``)."""
    ms, ts = est.model_spec, est.train_spec
    t = Table(title=title, caption=(
        f"{ms.name}: {ms.total_params / 1e6:,.1f}M params, {ts.method}"
        f"{f' r={ts.lora_rank}' if ts.method != 'full' else ''}, micro-batch {ts.batch_size} x accum "
        f"{ts.grad_accum}, seq {ts.seq_length}, {ts.optimizer}, {ts.dtype}"
        f"{' mixed' if ts.mixed_precision else ''}, ckpt {'on' if ts.grad_checkpoint else 'off'}, "
        f"attn {ts.attn_impl}, framework {ts.framework}"))
    t.add_column("term")
    t.add_column("bytes", justify="right")
    t.add_column("share", justify="right")
    for name, val in est.breakdown.items():
        if val:
            t.add_row(name, gib(val), f"{val / max(1, est.peak_bytes):.0%}")
    t.add_section()
    t.add_row(f"[b]peak ({est.counter})[/b]", f"[b]{gib(est.peak_bytes)}[/b]", "")
    if budget_bytes is not None:
        ok = est.peak_bytes <= budget_bytes
        t.add_row("budget", gib(budget_bytes), f"{est.peak_bytes / budget_bytes:.0%} used")
        t.add_row("verdict", "[green]fits[/green]" if ok else "[red]does not fit[/red]", "")
    return t


def print_estimate(est, budget_bytes: Optional[int] = None) -> None:
    console().print(estimate_table(est, budget_bytes))


def plan_table(plan) -> Table:
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
    t.add_row("peak", "", gib(plan.estimate.peak_bytes), f"budget {gib(plan.budget_bytes)}")
    eff_old = plan.original.effective_batch
    eff_new = plan.train_spec.effective_batch
    t.add_row("effective batch", str(eff_old), str(eff_new), "kept" if eff_old == eff_new else "CHANGED")
    return t


def print_plan(plan) -> None:
    console().print(plan_table(plan))


def probe_table(snap) -> Table:
    t = Table(title=f"memguard probe ({snap.source})")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("device", snap.device)
    t.add_row("total", gib(snap.total_bytes))
    t.add_row("available", gib(snap.available_bytes))
    t.add_row("container limit", gib(snap.limit_bytes) if snap.limit_bytes else "none")
    t.add_row("limit source", snap.limit_source)
    t.add_row("this process", gib(snap.process_bytes))
    t.add_row("this process, peak", gib(snap.process_peak_bytes))
    t.add_row("pressure (PSI some avg10 %)" if snap.source == "linux" else "pressure",
              "-" if snap.pressure is None else f"{snap.pressure:.2f}")
    t.add_row("used", f"{snap.used_fraction:.0%}")
    return t


def print_probe(snap) -> None:
    console().print(probe_table(snap))
