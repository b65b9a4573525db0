"""The summary statistics of bench results: quantiles and the median / p90 / worst signed errors of
a set of scored rows, and their one-line wording. docs/benchmarks.md.
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

__all__ = ["quantile", "summarize", "summary_line"]


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (linear interpolation between order statistics, numpy's default); NaN when
    ``xs`` is empty."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(rows: Sequence[dict], key: str = "error") -> dict:
    """``{"cases", "median_abs", "p90_abs", "worst_under", "worst_over", "worst_under_case"}`` over
    the rows that have ``key`` (fractions, signed: negative = under-estimate)."""
    rs = [r for r in rows if r.get(key) is not None]
    if not rs:
        return {"cases": 0}
    errs = [r[key] for r in rs]
    under = min(rs, key=lambda r: r[key])
    return dict(cases=len(rs), median_abs=statistics.median(abs(e) for e in errs),
                p90_abs=quantile([abs(e) for e in errs], 0.9), worst_under=min(errs), worst_over=max(errs),
                worst_under_case=under["name"])


def summary_line(s: dict, label: str) -> str:
    """A :func:`summarize` dict in one line, led by ``label``."""
    if not s.get("cases"):
        return f"{label}: no cases"
    return (f"{label}: {s['cases']} cases, median |error| {s['median_abs'] * 100:.1f}%, p90 "
            f"{s['p90_abs'] * 100:.1f}%, worst under-estimate {s['worst_under'] * 100:+.1f}% "
            f"({s['worst_under_case']}), worst over {s['worst_over'] * 100:+.1f}%")
