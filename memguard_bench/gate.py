"""The bench's accuracy gate (``memguard bench --gate``, run by ``make test`` with ``--quick``): the
violations of a run's scored rows, for the CLI to print and exit 4 on. docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
from typing import List, Sequence

__all__ = ["gate_failures"]


def gate_failures(rows: Sequence[dict], *, max_under: float = 0.05, max_median: float = 0.05) -> List[str]:
    """The accuracy gate of ``make test``: one message per violation among scored rows (fractions:
    an ``error`` below ``-max_under``, or a median |error| above ``max_median``); empty when the
    rows pass. No scored row at all is a violation too (the gate would prove nothing)."""
    scored = [r for r in rows if r.get("error") is not None]
    if not scored:
        return ["no case was scored"]
    out = [f"{r['name']} under-estimated by {-r['error']:.1%} (allowed {max_under:.0%})"
           for r in scored if r["error"] < -max_under]
    med = statistics.median(abs(r["error"]) for r in scored)
    if med > max_median:
        out.append(f"median |error| {med:.1%} above {max_median:.0%}")
    return out
