"""The runtime overhead term: what a training process holds that does not scale with the model
(interpreter, imports, CUDA context, mapped libraries). docs/estimator.md, "Runtime overhead".
"""

from __future__ import annotations

from typing import Optional

from .specs import MiB, TrainSpec


#: Per counter: cpu measured (bench's tiny cases), cuda context + cuBLAS workspaces: docs/estimator.md#runtime-overhead.
RUNTIME_OVERHEAD_BYTES = {"cpu": 368 * MiB, "cuda": 500 * MiB + 2 * (8 * MiB + 128 * 1024), "mlx": 0,
                          "mps": 0}
#: cpu, HF ``Trainer``, ``datasets`` installed (trainer.py imports it): measured, docs/estimator.md#runtime-overhead.
HF_DATASETS_IMPORT_BYTES = 98 * MiB
_DATASETS_INSTALLED: Optional[bool] = None
#: cpu: ``RssFile`` inside the overhead at ``trainer.train()``'s start: measured, docs/estimator.md#runtime-overhead.
CPU_FILE_PAGES_AT_START_BYTES = 128 * MiB


def runtime_overhead_bytes(ts: TrainSpec) -> int:
    """Runtime overhead of the counter ``ts.device`` (bytes): ``RUNTIME_OVERHEAD_BYTES``, plus
    ``HF_DATASETS_IMPORT_BYTES`` for an HF ``Trainer`` on CPU when ``datasets`` is importable here
    (checked once with ``importlib.util.find_spec``, nothing is imported), with the measured
    ``ts.resident_file_bytes`` in place of ``CPU_FILE_PAGES_AT_START_BYTES`` when given on CPU, for
    every framework (docs/estimator.md#runtime-overhead)."""
    global _DATASETS_INSTALLED
    b = RUNTIME_OVERHEAD_BYTES[ts.device]
    if ts.device == "cpu" and ts.framework == "hf":
        if _DATASETS_INSTALLED is None:
            try:
                import importlib.util

                _DATASETS_INSTALLED = importlib.util.find_spec("datasets") is not None
            except Exception:
                _DATASETS_INSTALLED = False
        if _DATASETS_INSTALLED:
            b += HF_DATASETS_IMPORT_BYTES
    if ts.device == "cpu" and ts.resident_file_bytes is not None:
        # every framework's process maps its libraries: the measured figure replaces the typical one
        b += int(ts.resident_file_bytes) - CPU_FILE_PAGES_AT_START_BYTES
    return max(0, b)
