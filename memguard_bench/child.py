"""The bench's child process (``python -m memguard_bench --child JSON``): one case measured in a fresh
interpreter, so the counter it reads is that run's own high-water mark; it prints its record as one
``RESULT {json}`` line for the parent (``measure.run_case``). docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os

from memguard_core.probes import glibc_version

from .child_hf import run_hf_child
from .child_mlx import run_mlx_child

__all__ = ["run_child", "print_result"]


def run_child(case: dict) -> dict:
    """Measure ``case`` in this process (mlx_lm or HF by its backend); returns the child's record."""
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    rec = run_mlx_child(case) if case["backend"] == "mlx" else run_hf_child(case)
    version = glibc_version()
    if version:
        rec["glibc"] = version
    return rec


def print_result(case_json: str) -> int:
    """Run the case given as JSON and print its record on one ``RESULT`` line; returns 0."""
    print("RESULT " + json.dumps(run_child(json.loads(case_json))), flush=True)
    return 0
