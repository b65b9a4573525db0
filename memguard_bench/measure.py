"""Measuring one bench case: the parent starts a fresh interpreter for it (``python -m memguard_bench
--child``, glibc's defaults restored) and reads back the child's record. docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .provenance import repo_root, today

__all__ = ["run_case"]


def run_case(case: dict, timeout_s: float = 600.0) -> dict:
    """Run one case in a fresh interpreter (killed after ``timeout_s`` seconds); returns the child's
    record (``peak_bytes`` and the model facts, dated), or ``{"error": ..., "date": ...}``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_root() + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)  # measure glibc's defaults, which the model assumes
    try:
        p = subprocess.run([sys.executable, "-m", "memguard_bench", "--child", json.dumps(case)],
                           capture_output=True, text=True, cwd=repo_root(), env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s", "date": today()}
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        return {"error": f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}", "date": today()}
    rec = json.loads(line[-1][7:])
    rec.setdefault("date", today())  # the day it was measured (UTC): --reuse keeps it
    return rec
