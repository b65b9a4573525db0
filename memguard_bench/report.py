"""The bench's reports: the markdown report (``--markdown``, ``--submit``: one row per case, the
summaries, the full-depth section with the small matrix beside it, the per-step peaks) and the JSON
record of a run (``--json``). docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

from .provenance import repo_root, today
from .score import CPU_BF16_MOE
from .stats import summarize, summary_line

__all__ = ["fmt_mib", "fmt_err", "markdown_report", "write_json"]

MiB = 1 << 20


def fmt_mib(b: Optional[int]) -> str:
    """Bytes as MiB with one decimal; "-" for None."""
    return "-" if b is None else f"{b / MiB:,.1f}"


def fmt_err(e: Optional[float]) -> str:
    """A signed fraction as a percentage with one decimal; "-" for None."""
    return "-" if e is None else f"{e * 100:+.1f}%"


_FULL_DEPTH_INTRO = (
    "**No constant of the estimator was fitted on the full-depth cases.** The constants were "
    "fitted on the small matrix (`bench/results/bench_cpu.json`: 2-12 blocks of most architectures; "
    "SmolLM2-135M's 30 and OPT-125M's 12 blocks at 128-256 tokens; two checkpointed cases cut to 2 "
    "and 8 blocks at 2048 tokens; docs/estimator.md, \"Where the "
    "constants come from\"). HF CPU runs, here and there, return glibc's free heap at every optimizer "
    "step's end as a guarded run does (`GuardOptions.trim_heap`). These cases are held out by scale (every block of the published config; "
    "512-2048 tokens per micro-batch on HF) and, where the block type is not in the fitted matrix "
    "of that backend (granitemoe on HF, GPT-2 on mlx_lm), by architecture as well. The estimator "
    "scored here is the commit in the machine line.")

_CPU_BF16_MOE_NOTE = (
    "The experts' row slices, bf16-matmul transients and gradients take new sizes every "
    "step (tokens per expert follow the routing) and oneDNN's per-shape caches place new "
    "entries among them, so under glibc's defaults the freed space stays resident as holes "
    "and the peak grows step after step while the bytes in use stay flat. These runs did "
    "what a guarded run does (`GuardOptions.trim_heap`): glibc's mmap threshold fixed at "
    "4 MiB at train start and the free heap handed back at every step's end; compare the "
    "per-step peaks below (last / first step). A plain run of such a model on a CPU needs "
    "the headroom of the growth (docs/estimator.md, \"MoE in bf16 on CPU\"; "
    "docs/monitor.md, \"The CPU heap between steps\").")


def family_group(row: dict) -> str:
    """How a full-depth row's architecture relates to the estimator: ``fitted`` (its block type is in
    the matrix the constants were fitted on), ``rules`` (a block rule was written from its code while
    looking at it, nothing fitted on it) or ``held-out`` (neither: a family no one looked at)."""
    if row.get("arch_fitted"):
        return "fitted"
    return "rules" if row.get("arch_rules") else "held-out"


def _full_depth_backend_lines(fd: Sequence[dict], backend: str) -> List[str]:
    """The full-depth summary of one backend, split by :func:`family_group` (fitted, rules written
    for it, held out by architecture) and with the bf16 MoE cases apart."""
    b = [r for r in fd if r["backend"] == backend]
    out = ["- " + summary_line(summarize(b), f"full depth, {backend}")]
    for group, label in (("fitted", "architecture in the fitted matrix (held out by scale)"),
                         ("rules", "block rule written from the family's code, no constant fitted on it "
                                   "(held out by scale)"),
                         ("held-out", "no rule written for the family, not in the fitted matrix (held out by "
                                      "architecture and scale)")):
        sub = [r for r in b if family_group(r) == group]
        if sub:
            out.append("  - " + summary_line(summarize(sub), label))
    moe = [r for r in b if r.get("cpu_backend_effect") == CPU_BF16_MOE]
    if moe:
        out.append("  - " + summary_line(summarize([r for r in b if r not in moe]),
                                         "without the bf16 MoE cases (what the estimator models)"))
        out.append("  - " + summary_line(summarize(moe), "MoE in bf16 on the CPU (run as the guard runs "
                                                         "them: glibc's mmap threshold fixed, below)"))
    return out


def _full_depth_section(rows: Sequence[dict], baseline: Optional[dict]) -> List[str]:
    """The markdown of the full-depth summaries: (a) the full-depth set per backend, split by
    :func:`family_group`; (b) the small / truncated matrix;
    the per-step peaks."""
    fd = [r for r in rows if r.get("full_depth") and "error" in r]
    dates = sorted({r.get("date") for r in fd if r.get("date")})
    out = ["### Summaries", "", _FULL_DEPTH_INTRO, "", f"(a) **full-depth set**, measured {', '.join(dates) or '-'}:"]
    for backend in ("hf", "mlx"):
        out += _full_depth_backend_lines(fd, backend)
    out.append("- " + summary_line(summarize(fd), "**full depth, all**"))
    if baseline:
        out += ["", f"(b) **the small / truncated matrix** (`{os.path.relpath(baseline['path'], repo_root())}`, "
                    f"measured {baseline['date']} ({baseline['date_source']}), re-scored by this estimator):"]
        for k in ("hf", "mlx", "all"):
            out.append("- " + summary_line(baseline[k], f"small matrix, {k}"))
    moe = [r["name"] for r in fd if r.get("cpu_backend_effect") == CPU_BF16_MOE]
    if moe:
        out += ["", f"**MoE in bf16 on the CPU ({', '.join(moe)}): counted in every summary above.** "
                    + _CPU_BF16_MOE_NOTE]
    steps = _per_step_table(rows)
    return out + ([""] + steps if steps else [])


def _per_step_table(rows: Sequence[dict]) -> List[str]:
    """The per-step peaks of the rows that recorded them (markdown lines; none when no row did)."""
    steps = [r for r in rows if r.get("step_peak_bytes")]
    if not steps:
        return []
    out = ["Per-step peaks (the counter's peak inside each optimizer step, MiB; the whole-run peak "
               "is the largest of these and the readings before, between and after the steps):", "",
           "| case | steps | per-step peak MiB | whole run MiB | last / first step |", "|---|---|---|---|---|"]
    for r in steps:
        sp = r["step_peak_bytes"]
        out.append(f"| {r['name']} | {len(sp)} | {', '.join(f'{b / MiB:,.0f}' for b in sp)} | "
                   f"{fmt_mib(r.get('actual_bytes'))} | {sp[-1] / sp[0]:.3f} |")
    return out


def _case_table(rows: Sequence[dict]) -> List[str]:
    """The markdown table, one row per case (seconds with full-depth rows, ml-memguard when scored)."""
    has_seed = any("seed_error" in r for r in rows)
    has_s = any(r.get("full_depth") for r in rows)
    hdr = ("| case | counter | estimate MiB | actual MiB | error | phase |" + (" s |" if has_s else "")
           + (" ml-memguard MiB | ml-memguard error |" if has_seed else ""))
    out = [hdr, "|" + "---|" * (hdr.count("|") - 1)]
    for r in rows:
        line = (f"| {r['name']} | {r.get('counter', '')} | {fmt_mib(r.get('estimate_bytes'))} | "
                f"{fmt_mib(r.get('actual_bytes'))} | {fmt_err(r.get('error')) if 'error' in r else 'FAILED'} | "
                f"{r.get('phase', '')} |")
        if has_s:
            line += f" {r['seconds']:.0f} |" if r.get("seconds") else " - |"
        if has_seed:
            line += f" {fmt_mib(r.get('seed_estimate_bytes'))} | {fmt_err(r.get('seed_error'))} |"
        out.append(line)
    return out


def _summary_bullets(rows: Sequence[dict], elapsed_s: float) -> List[str]:
    """The summaries under the table: per backend, all, fitted vs held out, the bf16 MoE cases apart,
    the seed's, the failed cases and the wall time."""
    ok = [r for r in rows if "error" in r]
    out = []
    for backend in sorted({r["backend"] for r in ok}):
        out.append("- " + summary_line(summarize([r for r in ok if r["backend"] == backend]), f"memguard, {backend}"))
    out.append("- " + summary_line(summarize(ok), "**memguard, all**"))
    held = [r for r in ok if r.get("held_out")]
    if held:
        out.append("- " + summary_line(summarize([r for r in ok if not r.get("held_out")]),
                                       "memguard, the matrix the constants were fitted on"))
        out.append("- " + summary_line(summarize(held), "**memguard, held out** (architectures no constant was "
                                                       "fitted on)"))
    moe = [r for r in ok if r.get("cpu_backend_effect") == CPU_BF16_MOE and not r.get("full_depth")]
    if moe:
        out.append("- " + summary_line(summarize([r for r in ok if r not in moe]),
                                       "memguard, without MoE in bf16 on the CPU"))
        out.append("- " + summary_line(summarize(moe), "MoE in bf16 on the CPU (a backend effect not modelled; "
                                                      "per-step peaks below)"))
    if any("seed_error" in r for r in rows):
        out.append("- " + summary_line(summarize(ok, "seed_error"), "ml-memguard (seed), same cases"))
    failed = [r["name"] for r in rows if "error" not in r]
    if failed:
        out.append(f"- failed: {', '.join(failed)}")
    if elapsed_s:
        out.append(f"- wall time {elapsed_s / 60:.1f} min")
    return out


def markdown_report(rows: Sequence[dict], fingerprint: Optional[dict] = None, *, elapsed_s: float = 0,
                    title: str = "memguard bench", date: Optional[str] = None,
                    baseline: Optional[dict] = None) -> str:
    """A markdown report: the date header, the machine, one table row per case, the summaries
    (memguard, and the seed package when it was scored); with full-depth rows also their
    summaries, the small matrix's (``baseline``, see ``baseline.baseline_summary``) and the
    per-step peaks. ``elapsed_s``: the run's wall time in seconds (0: not shown)."""
    out = [f"## {title}", ""]
    if date:
        measured = sorted({r.get("date") for r in rows if r.get("date")})
        out += [f"Report date: {date}" + (f"; measured: {', '.join(measured)}" if measured else ""), ""]
    if fingerprint:
        out += ["Machine: " + ", ".join(f"{k} `{v}`" for k, v in fingerprint.items()), ""]
    out += _case_table(rows) + [""] + _summary_bullets(rows, elapsed_s) + [""]
    if any(r.get("full_depth") for r in rows):
        out += _full_depth_section(rows, baseline) + [""]
        for r in rows:
            if "error" not in r:
                out.append(f"- {r['name']} failed: {str(r.get('failure', ''))[-300:]}")
        out.append("")
    else:  # (the full-depth section carries its own)
        steps = _per_step_table(rows)
        out += steps + [""] if steps else []
    return "\n".join(out)


def write_json(path: str, records: list, rows: list, elapsed: float, fp: Optional[dict] = None, *,
               date: Optional[str] = None, case_set: Optional[str] = None,
               baseline: Optional[dict] = None) -> None:
    """Write a run to ``path`` (atomically, via ``path.tmp``): its date, set, machine ``fp``, wall
    time ``elapsed`` (seconds), the summaries (the full-depth ones and ``baseline`` when present) and
    every case with its measured record and result row."""
    ok = [r for r in rows if "error" in r]
    extra: Dict[str, Any] = {}
    fd = [r for r in ok if r.get("full_depth")]
    if fd:
        extra["full_depth_summary"] = {k: summarize([r for r in fd if k == "all" or r["backend"] == k])
                                       for k in ("hf", "mlx", "all")}
        if any(r.get("cpu_backend_effect") for r in fd):
            extra["full_depth_summary"]["hf_without_cpu_bf16_moe"] = summarize(
                [r for r in fd if r["backend"] == "hf" and not r.get("cpu_backend_effect")])
            extra["full_depth_summary"][CPU_BF16_MOE] = summarize(
                [r for r in fd if r.get("cpu_backend_effect") == CPU_BF16_MOE])
    if baseline:
        extra["baseline_summary"] = baseline
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(date=date or today(), set=case_set, fingerprint=fp or {}, elapsed_s=elapsed,
                       summary=summarize(ok), seed_summary=summarize(ok, "seed_error"), **extra,
                       cases=[dict(r, result=row) for r, row in zip(records, rows)]), f, indent=1, default=str)
    os.replace(path + ".tmp", path)
