"""The runtime overhead term: what a training process holds that does not scale with the model
(interpreter, imports, CUDA context, mapped libraries). docs/estimator.md, "Runtime overhead".
"""

from __future__ import annotations

from typing import Optional

from .specs import MiB, TrainSpec


#: Runtime overhead per counter, bytes.
#: cpu: VmHWM of a HF ``Trainer`` run on a negligible model (2-layer Llama, hidden 64, vocab 256):
#:   the interpreter + torch/transformers/peft/accelerate imports + Trainer setup, i.e. everything
#:   that does not scale with the model. Fitted on the ``tiny-*`` cases of ``memguard bench``; the
#:   figures and software versions are in docs/estimator.md, "Runtime overhead".
#: cuda: the CUDA context of a PyTorch process (cuBLAS/cuDNN handles and kernels loaded lazily),
#:   which ``torch.cuda.memory_reserved`` does not count; PyTorch's CUDA semantics notes put it at
#:   hundreds of MiB per device ("CUDA context ... typically ~300-500MB", docs.pytorch.org
#:   notes/cuda.html, "Memory management"); we take 500 MiB (``CUDA_CONTEXT_BYTES``), plus the
#:   two cuBLAS workspaces a training step allocates through the caching allocator
#:   (``CUDA_CUBLAS_WORKSPACES_BYTES``: they are inside ``memory_allocated``). The caching
#:   allocator's fragmentation is added as a fraction of the peak, CUDA_FRAGMENTATION below.
#: mlx: ``mx.get_peak_memory()`` counts only MLX buffers: no overhead.
#: mps: the counter is ``torch.mps.driver_allocated_memory()`` (the Metal buffers of the MPS
#:   allocator, cache included); Metal's own device state is not among them. 0, an assumption: not
#:   measured on a Mac (see MPS_FRAGMENTATION).
RUNTIME_OVERHEAD_BYTES = {"cpu": 368 * MiB, "cuda": 500 * MiB + 2 * (8 * MiB + 128 * 1024), "mlx": 0,
                          "mps": 0}
#: cpu, HF ``Trainer``: ``transformers/trainer.py`` imports ``datasets`` at module level when it is
#: installed (``if is_datasets_available(): import datasets``), which pulls pyarrow and pandas in,
#: adding their libraries to VmHWM. Fitted as the difference of the ``tiny`` bench cases with and
#: without ``datasets`` installed; docs/estimator.md, "Runtime overhead".
HF_DATASETS_IMPORT_BYTES = 98 * MiB
_DATASETS_INSTALLED: Optional[bool] = None
#: cpu, HF ``Trainer``: the file-backed resident pages (``RssFile``: the mapped torch, transformers,
#: pyarrow ... libraries) inside the runtime overhead above, as read when ``trainer.train()`` starts
#: on the ``tiny`` bench case. The figure depends on the page cache, not on the model (a freshly
#: written copy of a venv is cached in large folios and mapped whole, so it reads higher), which is
#: why a TrainSpec's measured ``resident_file_bytes`` replaces this typical figure when given.
#: docs/estimator.md, "Runtime overhead".
CPU_FILE_PAGES_AT_START_BYTES = 128 * MiB


def runtime_overhead_bytes(ts: TrainSpec) -> int:
    """Runtime overhead of the counter ``ts.device`` (bytes): ``RUNTIME_OVERHEAD_BYTES``, plus
    ``HF_DATASETS_IMPORT_BYTES`` for an HF ``Trainer`` on CPU when ``datasets`` is importable here
    (checked once with ``importlib.util.find_spec``, nothing is imported), with the measured
    ``ts.resident_file_bytes`` in place of ``CPU_FILE_PAGES_AT_START_BYTES`` when given on CPU, for
    every framework (the HF, Lightning and plain-loop adapters pass it; a Lightning run of a transformers model reads about the HF
    figure at ``on_train_start``: docs/estimator.md, "Runtime overhead")."""
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
