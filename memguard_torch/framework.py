"""torch's services to the framework-free core (``memguard_core.frameworks``): emptying the CUDA /
MPS caching allocators, the rank agreement over ``torch.distributed``, the CUDA allocator counters and
snapshots. Registered when ``memguard_torch`` is imported (the HF and Lightning adapters import it).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Dict, Optional

from memguard_core import frameworks

logger = logging.getLogger("memguard.frameworks")

__all__ = ["empty_caches", "rank", "cuda_memory_stats", "register"]


def empty_caches() -> None:
    """``torch.cuda.empty_cache()`` where CUDA is initialised, ``torch.mps.empty_cache()`` where
    torch's MPS backend is available. Never raises; never initialises a device."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception as exc:  # a broken device must not break the clean of the others
        logger.debug("memguard: torch.cuda.empty_cache() failed: %r", exc)
    try:
        mps = getattr(getattr(torch, "backends", None), "mps", None)
        if mps is not None and mps.is_available() and hasattr(torch, "mps"):
            torch.mps.empty_cache()
    except Exception as exc:
        logger.debug("memguard: torch.mps.empty_cache() failed: %r", exc)


def rank() -> Optional[int]:
    """``torch.distributed.get_rank()`` in an initialised process group, else None."""
    dist = sys.modules.get("torch.distributed")   # not imported: no process group
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def cuda_memory_stats() -> Dict[str, Any]:
    """``torch.cuda.memory_stats()`` of the current device (bytes and counts, torch's keys)."""
    import torch

    return torch.cuda.memory_stats()


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _snapshots(folder: str, rank: int, at_steps: Any = ()) -> Any:
    from .cuda_snapshots import CudaSnapshots

    return CudaSnapshots(folder, rank=rank, at_steps=at_steps)


def _agree_max(k: int) -> int:
    from .distributed import agree_max

    return agree_max(k)


def register() -> None:
    """Register torch with the core (idempotent)."""
    frameworks.register(frameworks.Framework(
        name="torch", clean_caches=empty_caches, agree_max=_agree_max, rank=rank,
        cuda_memory_stats=cuda_memory_stats, cuda_snapshots=_snapshots, cuda_available=_cuda_available))
