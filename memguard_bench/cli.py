"""``memguard bench``: the estimator against real training runs on this machine.

Every case is a real fine-tuning run in a fresh subprocess (``child``), the estimate scored against
the counter it predicts (``score``); the command prints the table and summaries, writes the reports
(``report``) and applies the accuracy gate (``gate``). docs/benchmarks.md, "Estimate accuracy".

    python -m memguard_bench                 # matrix + held out
    python -m memguard_bench --quick         # a small subset (CI)
    python -m memguard_bench --set full-depth --json fd.json --markdown fd.md
    python -m memguard_bench --only smollm2  # cases whose name contains the text
    python -m memguard_bench --reuse bench/results/bench_cpu.json   # re-estimate only
    python -m memguard_bench --submit        # a markdown report to file as an issue

This module imports no framework at module level (the children import torch / mlx).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .baseline import baseline_summary
from .cases import CASE_SETS, select
from .child import print_result
from .console import print_closing_summaries, print_summaries, rich_table
from .gate import gate_failures
from .measure import LibcDirError, libc_loader, run_case
from .provenance import machine_fingerprint, reported_fingerprint, repo_root, today
from .report import markdown_report, write_json
from .score import score

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``memguard bench`` argument parser."""
    ap = argparse.ArgumentParser(prog="memguard bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset (~1-2 min; CI)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="cases whose name contains TEXT (repeatable)")
    ap.add_argument("--set", dest="case_set", choices=CASE_SETS, default="all",
                    help="matrix: the small / truncated matrix the estimator's constants were fitted on; "
                         "held-out: architectures nothing was fitted on; all: those two (~20 min); "
                         "full-depth: every block of published configs (GPT-2, SmolLM2-135M/360M, "
                         "Qwen2.5-0.5B, TinyLlama-1.1B, Llama-3.2-1B, Granite-3 1B-A400M and TinyMixtral "
                         "MoEs, Granite-4.0-H and LFM2 hybrids, BERT / RoBERTa / DistilBERT with their task heads) at "
                         "512-2048 tokens per micro-batch on HF and "
                         "short rows on mlx_lm, per-step peaks recorded (~1.5 hours; not part of all) [all]")
    ap.add_argument("--backend", action="append", choices=("hf", "mlx"),
                    help="only these backends (default: hf, and mlx when installed)")
    ap.add_argument("--cuda", action="store_true", help="also run the HF cases on CUDA (when a GPU is present)")
    ap.add_argument("--json", metavar="PATH", help="write cases, measurements and results as JSON")
    ap.add_argument("--markdown", metavar="PATH", help="write the markdown report")
    ap.add_argument("--submit", action="store_true", help="print a ready-to-file markdown report")
    ap.add_argument("--reuse", metavar="PATH",
                    help="re-estimate measurements saved by --json (runs only the missing; the report's machine "
                         "line stays the measuring machine's, with this checkout's commit as the estimator's)")
    ap.add_argument("--no-seed", action="store_true", help="do not score ml-memguard (the earlier estimator memguard grew from, the pip package ml-memguard: its estimate_training_memory) even when it is installed")
    ap.add_argument("--libc", metavar="DIR", default=None,
                    help="run the cases under another glibc: DIR holds its ld-linux-x86-64.so.2 and libc.so.6 "
                         "(a libc6 package unpacked with dpkg-deb -x); each record says the glibc it ran with")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per case [the case's own limit (full-depth cases), else 600]")
    ap.add_argument("--date", default=None, metavar="YYYY-MM-DD",
                    help="the date stamped on the markdown / JSON report [today, UTC]")
    ap.add_argument("--baseline", default=None, metavar="PATH",
                    help="with full-depth cases: the small matrix's saved JSON whose summary (re-scored) "
                         "the report shows beside them [bench/results/bench_cpu.json; 'none' to skip]")
    ap.add_argument("--gate", action="store_true",
                    help="exit 4 when a case is under-estimated by more than --max-under or the median "
                         "|error| is above --max-median (make test runs --quick --gate)")
    ap.add_argument("--max-under", type=float, default=0.05, metavar="FRACTION",
                    help="gate: the largest under-estimate allowed [0.05]")
    ap.add_argument("--max-median", type=float, default=0.05, metavar="FRACTION",
                    help="gate: the largest median |error| allowed [0.05]")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def _mlx_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None


def _cuda_available() -> bool:
    try:
        p = subprocess.run([sys.executable, "-c", "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True, timeout=120)
        return p.returncode == 0
    except Exception:
        return False


def _backends(a: argparse.Namespace, con) -> Tuple[List[str], bool]:
    """(backends, cuda) this machine can run of those asked for, saying what it skips."""
    backends = a.backend or (["hf", "mlx"] if _mlx_available() else ["hf"])
    if "mlx" in backends and not _mlx_available():
        con.print("[yellow]mlx / mlx-lm not installed: skipping the MLX cases[/yellow]")
        backends = [b for b in backends if b != "mlx"]
    cuda = bool(a.cuda and _cuda_available())
    if a.cuda and not cuda:
        con.print("[yellow]--cuda: no CUDA device visible to torch; CPU only[/yellow]")
    return backends, cuda


def _load_reuse(path: Optional[str]) -> Tuple[Dict[str, Any], Optional[dict], float]:
    """(records by case name, the machine fingerprint, wall time in seconds) of a file saved by
    ``--json``; empty when no file is given or it does not exist."""
    if not path or not os.path.exists(path):
        return {}, None, 0.0
    with open(path) as f:
        old = json.load(f)
    return ({r["name"]: r for r in old.get("cases", [])}, old.get("fingerprint") or None,
            float(old.get("elapsed_s") or 0))


def _result_row(c: dict, rec: dict, seed: bool, console) -> dict:
    """The result row of a measured case; a failed run or estimate is a row with ``failure``."""
    if "error" in rec:
        console.print(f"[red]{c['name']}: FAILED[/red] {rec['error'][-400:]}")
        return dict(name=c["name"], backend=c["backend"], failure=rec["error"], full_depth=bool(c.get("full_depth")))
    try:
        return score(c, rec, seed=seed)
    except Exception as exc:  # an estimator error is a bench result, not a crash
        console.print(f"[red]{c['name']}: estimate failed[/red] {exc!r}")
        return dict(name=c["name"], backend=c["backend"], failure=repr(exc), full_depth=bool(c.get("full_depth")))


def _run(sel: Sequence[dict], a: argparse.Namespace, con, saved: Dict[str, Any], date: str):
    """Measure (or take from ``saved`` with ``--reuse``) and score every selected case under a
    progress bar; returns (rows, records, cases run here, wall time in seconds)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    t0 = time.time()
    rows, records, fresh = [], [], 0
    with Progress(TextColumn("[bold]bench[/bold] {task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=con,
                  transient=False) as prog:
        task = prog.add_task("", total=len(sel))
        for c in sel:
            prog.update(task, description=c["name"])
            rec = saved.get(c["name"], {}).get("measured") if a.reuse else None
            if rec is None:
                rec = run_case(c, a.timeout or c.get("timeout_s") or 600.0, libc_dir=a.libc)
                fresh += 1
            records.append(dict(name=c["name"], case=c, measured=rec))
            rows.append(_result_row(c, rec, not a.no_seed, prog.console))
            prog.advance(task)
            if a.json:  # after every case: a long run interrupted keeps what it measured
                write_json(a.json, records, rows, time.time() - t0, date=date, case_set=a.case_set)
    return rows, records, fresh, time.time() - t0


def _baseline(a: argparse.Namespace, rows: Sequence[dict]) -> Optional[dict]:
    """The small matrix's summary shown beside full-depth rows (``--baseline``); None without them."""
    if not any(r.get("full_depth") for r in rows):
        return None
    bpath = a.baseline or os.path.join(repo_root(), "bench", "results", "bench_cpu.json")
    return baseline_summary(bpath) if bpath.lower() != "none" else None


def _write_reports(a: argparse.Namespace, rows, records, elapsed: float, fp: dict, date: str,
                   baseline: Optional[dict]) -> None:
    """The ``--json``, ``--markdown`` and ``--submit`` outputs."""
    if a.json:
        write_json(a.json, records, rows, elapsed, fp, date=date, case_set=a.case_set, baseline=baseline)
    title = "memguard bench: full-depth set" if a.case_set == "full-depth" else "memguard bench"
    md = markdown_report(rows, fp, elapsed_s=elapsed, title=title, date=date, baseline=baseline)
    if a.markdown:
        os.makedirs(os.path.dirname(os.path.abspath(a.markdown)), exist_ok=True)
        with open(a.markdown, "w") as f:
            f.write(md)
    if a.submit:
        print("\n<!-- memguard bench report: paste into a new issue -->\n" + md)


def _gate(a: argparse.Namespace, ok: Sequence[dict], con) -> bool:
    """Apply ``--gate`` to the scored rows, printing its verdict; True when it fails."""
    failures = gate_failures(ok, max_under=a.max_under, max_median=a.max_median)
    for f in failures:
        con.print(f"[red]gate: {f}[/red]")
    if not failures:
        con.print(f"gate: passed (no case under by more than {a.max_under:.0%}, median |error| at most "
                  f"{a.max_median:.0%})")
    return bool(failures)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``memguard bench``: run the matrix, print the table and the summary. Returns the exit code
    (0: every selected case ran; 1: some failed; 2: bad arguments; 4: the gate failed)."""
    a = build_parser().parse_args(argv)
    if a.child:
        return print_result(a.child)

    from rich.console import Console

    con = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    backends, cuda = _backends(a, con)
    sel = select(a.quick, a.only, backends, cuda, a.case_set)
    if a.list:
        for c in sel:
            con.print(c["name"])
        return 0
    if not sel:
        con.print("[red]no case matches[/red]")
        return 2
    if a.libc:
        try:
            libc_loader(a.libc)
        except LibcDirError as exc:
            con.print(f"[red]{exc}[/red]")
            return 2
    date = a.date or today()
    saved, saved_fp, measured_s = _load_reuse(a.reuse)
    rows, records, fresh, elapsed = _run(sel, a, con, saved, date)
    if a.reuse and all(c["name"] in saved for c in sel):
        elapsed = max(elapsed, measured_s)  # the wall time of the runs the reused file measured
    con.print(rich_table(rows))
    print_summaries(con, rows)
    baseline = _baseline(a, rows)  # after the lines above: re-scoring it may log warnings
    print_closing_summaries(con, rows, baseline)
    con.print(f"wall time {elapsed:.0f} s{' (of the reused measurements)' if a.reuse else ''}")
    fp = reported_fingerprint(machine_fingerprint(), saved_fp if a.reuse else None, fresh)
    ran = sorted({r["measured"].get("glibc") for r in records if r["measured"].get("glibc")})
    if ran:
        fp["glibc"] = ", ".join(ran)  # the children's C library (--libc), not necessarily the parent's
    _write_reports(a, rows, records, elapsed, fp, date, baseline)
    ok = [r for r in rows if "error" in r]
    if a.gate and _gate(a, ok, con):
        return 4
    return 0 if len(ok) == len(rows) else 1
