"""What ``memguard bench`` prints on the terminal: the rich table of estimate against measured peak,
one row per case, and the summary lines under it. docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .report import fmt_err, fmt_mib
from .stats import summarize, summary_line

__all__ = ["rich_table", "print_summaries", "print_closing_summaries"]


def rich_table(rows: Sequence[dict]):
    """A ``rich.table.Table`` of the rows: estimate and actual MiB, the error coloured (red: under
    by more than 5 %, yellow: off by more than 10 %), phase, seconds, ml-memguard when scored."""
    from rich.table import Table

    has_seed = any("seed_error" in r for r in rows)
    t = Table(title="memguard bench: estimate vs measured peak (fresh process per case)")
    for col, just in (("case", "left"), ("counter", "left"), ("estimate MiB", "right"), ("actual MiB", "right"),
                      ("error", "right"), ("phase", "left"), ("s", "right")):
        t.add_column(col, justify=just)
    if has_seed:
        t.add_column("ml-memguard MiB", justify="right")
        t.add_column("ml-memguard err", justify="right")
    for r in rows:
        if "error" not in r:
            t.add_row(r["name"], "", "", "", "[red]FAILED[/red]", "", "")
            continue
        e = r["error"]
        col = "red" if e < -0.05 else ("yellow" if abs(e) > 0.10 else "green")
        cells = [r["name"], r["counter"], fmt_mib(r["estimate_bytes"]), fmt_mib(r["actual_bytes"]),
                 f"[{col}]{fmt_err(e)}[/{col}]", r.get("phase", ""), f"{r.get('seconds') or 0:.0f}"]
        if has_seed:
            cells += [fmt_mib(r.get("seed_estimate_bytes")), fmt_err(r.get("seed_error"))]
        t.add_row(*cells)
    return t


def print_summaries(con, rows: Sequence[dict]) -> None:
    """Print the summary lines of the rows on the rich console ``con``: per backend, all, fitted vs
    held out, full depth per backend (without the bf16 MoE cases too)."""
    ok = [r for r in rows if "error" in r]
    for backend in sorted({r["backend"] for r in ok}):
        con.print(summary_line(summarize([r for r in ok if r["backend"] == backend]), f"memguard {backend}"))
    con.print("[bold]" + summary_line(summarize(ok), "memguard all") + "[/bold]")
    if any(r.get("held_out") for r in ok):
        con.print(summary_line(summarize([r for r in ok if not r.get("held_out")]), "memguard fitted matrix"))
        con.print("[bold]" + summary_line(summarize([r for r in ok if r.get("held_out")]), "memguard held out")
                  + "[/bold]")
    fd = [r for r in ok if r.get("full_depth")]
    for backend in sorted({r["backend"] for r in fd}):
        con.print("[bold]" + summary_line(summarize([r for r in fd if r["backend"] == backend]),
                                          f"memguard full depth {backend}") + "[/bold]")
        moe = [r for r in fd if r["backend"] == backend and r.get("cpu_backend_effect")]
        if moe:
            con.print(summary_line(summarize([r for r in fd if r["backend"] == backend and r not in moe]),
                                   f"memguard full depth {backend} without the bf16 MoE cases"))


def print_closing_summaries(con, rows: Sequence[dict], baseline: Optional[dict] = None) -> None:
    """Print the summary lines after :func:`print_summaries`: the small matrix re-scored
    (``baseline``), the seed's on the same rows."""
    ok = [r for r in rows if "error" in r]
    if baseline:
        con.print(summary_line(baseline["all"], f"memguard small matrix ({baseline['date']}, re-scored)"))
    if any("seed_error" in r for r in ok):
        con.print(summary_line(summarize(ok, "seed_error"), "ml-memguard (seed) on the same cases"))
