"""The one out-of-memory predicate of the torch adapters (HF, Lightning, ``TorchGuard``): the
exception's type first, the allocator's message only as the fallback (docs/lifecycle.md)."""

from __future__ import annotations

import torch

from memguard_core.errors import MemGuardError

from .sync import PeerOutOfMemoryError

__all__ = ["is_oom_error", "OOM_MESSAGES"]

#: Lower-cased substrings of out-of-memory messages raised as a plain ``RuntimeError``: the caching
#: allocators' (CUDA / HIP / XPU "... out of memory", "MPS backend out of memory"), a kernel launch or
#: library call that could not allocate ("CUDA error: out of memory", cuBLAS'
#: ``CUBLAS_STATUS_ALLOC_FAILED``), the CPU allocator ("DefaultCPUAllocator: can't allocate memory"),
#: cuDNN's workspace failure (``CUDNN_STATUS_NOT_SUPPORTED``) and Gaudi's; the list of accelerate's
#: ``utils.memory.should_reduce_batch_size`` and Lightning's ``utilities.memory.is_oom_error``, plus
#: the launch and cuBLAS forms.
OOM_MESSAGES = ("out of memory", "can't allocate memory", "cudnn_status_not_supported",
                "cublas_status_alloc_failed", "pt_devmem allocation failed")


def _oom_types() -> tuple:
    names = (getattr(torch, "OutOfMemoryError", None), getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None))
    return tuple(t for t in names if isinstance(t, type)) + (PeerOutOfMemoryError, MemoryError)


def is_oom_error(exc: BaseException) -> bool:
    """True for an out-of-memory error that fewer rows per forward may get past.

    By type: ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class; the CUDA,
    MPS and XPU caching allocators raise it), Python's ``MemoryError``, another rank's
    (:class:`memguard_torch.sync.PeerOutOfMemoryError`). Else a ``RuntimeError`` (torch's
    ``AcceleratorError`` included) whose message holds one of :data:`OOM_MESSAGES`. Never memguard's
    own errors: a ``WindowOOMError`` quotes the allocator's message but means splitting has failed.
    """
    if isinstance(exc, MemGuardError):
        return False
    if isinstance(exc, _oom_types()):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    msg = str(exc).lower()
    return any(m in msg for m in OOM_MESSAGES)
