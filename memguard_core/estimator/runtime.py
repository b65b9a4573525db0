"""The runtime overhead term: what a training process holds that does not scale with the model
(interpreter, imports, CUDA context, mapped libraries). docs/estimator.md, "Runtime overhead".
"""

from __future__ import annotations

from typing import Optional

from .cuda import CUDA_CONTEXT_BYTES, CUDA_CUBLAS_WORKSPACES_BYTES, cublas_workspaces_bytes
from .specs import MiB, TrainSpec


#: Per counter: cpu measured (bench's tiny cases), cuda context + cuBLAS workspaces (those of a GPU
#: not read: :func:`memguard_core.estimator.cuda.cublas_workspaces_bytes`): docs/estimator.md#runtime-overhead.
RUNTIME_OVERHEAD_BYTES = {"cpu": 368 * MiB, "cuda": CUDA_CONTEXT_BYTES + CUDA_CUBLAS_WORKSPACES_BYTES, "mlx": 0,
                          "mps": 0}
#: cpu, HF ``Trainer``, ``datasets`` installed (trainer.py imports it): its anonymous memory, and the
#: library pages it maps (pyarrow, pandas); measured, docs/estimator.md#runtime-overhead.
HF_DATASETS_ANON_BYTES = 43 * MiB
HF_DATASETS_FILE_PAGES_BYTES = 39 * MiB
_DATASETS_INSTALLED: Optional[bool] = None
#: cpu: ``RssFile`` at ``trainer.train()``'s start without ``datasets``, inside the overhead above:
#: measured, docs/estimator.md#runtime-overhead.
CPU_FILE_PAGES_AT_START_BYTES = 91 * MiB
#: cpu: what the process behind ``RUNTIME_OVERHEAD_BYTES`` held when ``trainer.train()`` started,
#: apart from the model's tensors (RSS at ``on_train_begin``, same ``tiny`` case and venv);
#: the overhead less this is the growth to the step's peak (the backward's and optimizer's code
#: pages, autograd's threads): measured, docs/estimator.md#runtime-overhead.
CPU_RUNTIME_AT_START_BYTES = 358 * MiB


def runtime_overhead_bytes(ts: TrainSpec) -> int:
    """Runtime overhead of the counter ``ts.device`` (bytes). On CPU with the process's own figure
    (``ts.runtime_held_bytes``, a guarded run): that figure + :func:`cpu_runtime_growth_bytes`.
    Otherwise modelled: ``RUNTIME_OVERHEAD_BYTES`` (a process
    without ``datasets``; on cuda the context and the run's GPU's cuBLAS workspaces,
    ``cuda.cublas_workspaces_bytes``); for an HF ``Trainer`` on CPU with ``datasets`` importable here (checked
    once with ``importlib.util.find_spec``, nothing is imported) its anonymous memory
    ``HF_DATASETS_ANON_BYTES``, and its mapped libraries ``HF_DATASETS_FILE_PAGES_BYTES`` unless the
    process's own mapped-file figure is given; on CPU the measured ``ts.resident_file_bytes`` in
    place of ``CPU_FILE_PAGES_AT_START_BYTES``, for every framework (it holds every library the
    process mapped by train start, ``datasets``' included). docs/estimator.md#runtime-overhead."""
    global _DATASETS_INSTALLED
    if ts.device == "cpu" and ts.runtime_held_bytes is not None:
        return int(ts.runtime_held_bytes) + cpu_runtime_growth_bytes()
    b = CUDA_CONTEXT_BYTES + cublas_workspaces_bytes(ts) if ts.device == "cuda" else RUNTIME_OVERHEAD_BYTES[ts.device]
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


def cpu_runtime_growth_bytes() -> int:
    """What a CPU training process adds to its runtime between train start and the step's peak
    (bytes): ``RUNTIME_OVERHEAD_BYTES["cpu"] - CPU_RUNTIME_AT_START_BYTES``, both measured on
    the same run (docs/estimator.md#runtime-overhead)."""
    return max(0, RUNTIME_OVERHEAD_BYTES["cpu"] - CPU_RUNTIME_AT_START_BYTES)


def runtime_source(ts: TrainSpec) -> str:
    """One line saying where the runtime overhead of ``ts`` comes from: measured in this process,
    or modelled (and from what). docs/estimator.md#runtime-overhead."""
    mib = lambda n: f"{n / MiB:.0f} MiB"  # noqa: E731
    total = runtime_overhead_bytes(ts)
    if ts.device == "cpu" and ts.runtime_held_bytes is not None:
        return (f"runtime overhead {mib(total)}: measured in this process at train start "
                f"({mib(ts.runtime_held_bytes)} held apart from the model's tensors) + "
                f"{mib(cpu_runtime_growth_bytes())} modelled growth to the step's peak")
    if ts.device == "cpu":
        files = "this process's mapped files" if ts.resident_file_bytes is not None else "typical mapped files"
        extra = ", datasets' import" if ts.framework == "hf" and _DATASETS_INSTALLED else ""
        return (f"runtime overhead {mib(total)}: modelled (interpreter and imports{extra}, {files}); "
                f"a guarded run measures its own process instead")
    if ts.device == "cuda":
        read = "this GPU's" if ts.cublas_workspace_bytes is not None else "Hopper's, the GPU not read"
        return (f"runtime overhead {mib(total)}: modelled (CUDA context {mib(CUDA_CONTEXT_BYTES)}; cuBLAS "
                f"workspaces {mib(cublas_workspaces_bytes(ts))}, {read}; the context grows as kernels load "
                f"during the first steps, so no figure read before them is used)")
    return f"runtime overhead {mib(total)}: none on the {ts.device} counter (it sees the allocator's buffers only)"
