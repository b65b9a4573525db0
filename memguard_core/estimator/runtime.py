"""The runtime overhead term: what a training process holds that does not scale with the model
(interpreter, imports, CUDA context, mapped libraries). docs/estimator.md, "Runtime overhead".
"""

from __future__ import annotations

from typing import Optional

from .specs import MiB, TrainSpec


#: Per counter: cpu measured (bench's tiny cases), cuda context + cuBLAS workspaces: docs/estimator.md#runtime-overhead.
RUNTIME_OVERHEAD_BYTES = {"cpu": 368 * MiB, "cuda": 500 * MiB + 2 * (8 * MiB + 128 * 1024), "mlx": 0,
                          "mps": 0}
#: cpu, HF ``Trainer``, ``datasets`` installed (trainer.py imports it): its anonymous memory, and the
#: library pages it maps (pyarrow, pandas); measured, docs/estimator.md#runtime-overhead.
HF_DATASETS_ANON_BYTES = 43 * MiB
HF_DATASETS_FILE_PAGES_BYTES = 39 * MiB
_DATASETS_INSTALLED: Optional[bool] = None
#: cpu: ``RssFile`` at ``trainer.train()``'s start without ``datasets``, inside the overhead above:
#: measured, docs/estimator.md#runtime-overhead.
CPU_FILE_PAGES_AT_START_BYTES = 91 * MiB


def runtime_overhead_bytes(ts: TrainSpec) -> int:
    """Runtime overhead of the counter ``ts.device`` (bytes): ``RUNTIME_OVERHEAD_BYTES`` (a process
    without ``datasets``); for an HF ``Trainer`` on CPU with ``datasets`` importable here (checked
    once with ``importlib.util.find_spec``, nothing is imported) its anonymous memory
    ``HF_DATASETS_ANON_BYTES``, and its mapped libraries ``HF_DATASETS_FILE_PAGES_BYTES`` unless the
    process's own mapped-file figure is given; on CPU the measured ``ts.resident_file_bytes`` in
    place of ``CPU_FILE_PAGES_AT_START_BYTES``, for every framework (it holds every library the
    process mapped by train start, ``datasets``' included). docs/estimator.md#runtime-overhead."""
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
            b += HF_DATASETS_ANON_BYTES + (HF_DATASETS_FILE_PAGES_BYTES if ts.resident_file_bytes is None else 0)
    if ts.device == "cpu" and ts.resident_file_bytes is not None:
        # every framework's process maps its libraries: the measured figure replaces the typical one
        b += int(ts.resident_file_bytes) - CPU_FILE_PAGES_AT_START_BYTES
    return max(0, b)
