"""PyTorch on Apple Silicon (``device="mps"``): the MPS allocator's slack and its SDPA path. Not
validated on a Mac. docs/estimator.md, "PyTorch on Apple Silicon".
"""

from __future__ import annotations

from typing import Dict

from .cuda import CUDA_FRAGMENTATION
from .specs import TrainSpec


#: Cached-but-unused share (MPSAllocator.mm, modelled on CUDA's): CUDA's figure, not measured on a Mac.
MPS_FRAGMENTATION = CUDA_FRAGMENTATION


def allocator_slack(totals: Dict[str, int], overhead: int) -> Dict[str, int]:
    """moment -> the MPS allocator's cached-but-unused bytes: ``MPS_FRAGMENTATION`` of each
    moment's ``totals`` less the ``overhead`` (bytes)."""
    return {k: int(MPS_FRAGMENTATION * (v - overhead)) for k, v in totals.items()}


def mps_sdpa_math(ts: TrainSpec) -> bool:
    """SDPA on ``mps`` while training runs the generic math path (fp32 probabilities saved, half
    inputs upcast): torch's fused MPS kernel is taken only for inference, and no flash /
    memory-efficient kernel is registered for MPS (docs/estimator.md, "PyTorch on Apple Silicon")."""
    return ts.device == "mps"
