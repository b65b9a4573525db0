"""The small matrix beside the full-depth set: a saved ``--json`` run of the small / truncated matrix
(``bench/results/bench_cpu.json``) re-scored by this estimator and summarised, dated by its records,
the file's git history or the file itself. docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from .provenance import git_measured_dates
from .score import score
from .stats import summarize

__all__ = ["baseline_summary"]


def baseline_summary(path: str) -> Optional[dict]:
    """The small / truncated matrix saved by an earlier ``--json`` run (``bench/results/bench_cpu.json``),
    its measurements re-scored by this estimator: ``{"path", "date", "date_source", "cases",
    "hf", "mlx", "all"}`` (each a ``summarize`` dict); None when the file cannot be read. Its date is
    the records' ``date``, else the date git history gives each record, else the file's ``date``
    field or its mtime."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    rows, recs = [], {}
    for r in old.get("cases", []):
        rec, case = r.get("measured") or {}, r.get("case")
        if not case or "peak_bytes" not in rec or case.get("full_depth"):
            continue
        try:
            rows.append(score(case, rec, seed=False))
            recs[case["name"]] = rec
        except Exception:
            continue
    days = {n: rec["date"] for n, rec in recs.items() if rec.get("date")}
    src = "the records' dates"
    missing = {n: rec["peak_bytes"] for n, rec in recs.items() if n not in days}
    if missing:
        days.update(git_measured_dates(path, missing))
        src = "the records' dates and the file's git history" if len(days) > len(missing) else \
            "the file's git history (the commit each peak was first saved in)"
    date = ", ".join(sorted(set(days.values())))
    if len(days) < len(recs):  # some records dated by nothing better: the file's own stamp
        fallback = old.get("date") or time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(path)))
        date, src = ", ".join(sorted(set(days.values()) | {fallback})), src + "; the rest: the file's date"
    return dict(path=path, date=date, date_source=src, cases=len(rows),
                hf=summarize([r for r in rows if r["backend"] == "hf"]),
                mlx=summarize([r for r in rows if r["backend"] == "mlx"]), all=summarize(rows))
