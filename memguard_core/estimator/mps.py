"""PyTorch on Apple Silicon (``device="mps"``): the MPS allocator's slack and its SDPA path. Not
validated on a Mac. docs/estimator.md, "PyTorch on Apple Silicon".
"""

from __future__ import annotations


from typing import Dict

from .cuda import CUDA_FRAGMENTATION
from .specs import TrainSpec


#: Cached-but-unused share of the MPS allocator (``aten/src/ATen/mps/MPSAllocator.mm``: a caching
#: allocator of Metal heaps modelled on CUDA's, sizes rounded up within heaps), which
#: ``driver_allocated_memory`` counts. Taken from CUDA_FRAGMENTATION by that likeness; NOT measured
#: on a Mac (no Apple GPU here), so an mps estimate is a prediction from the code alone.
MPS_FRAGMENTATION = CUDA_FRAGMENTATION


def allocator_slack(totals: Dict[str, int], overhead: int) -> Dict[str, int]:
    """moment -> the MPS allocator's cached-but-unused bytes: ``MPS_FRAGMENTATION`` of each
    moment's ``totals`` less the ``overhead`` (bytes)."""
    return {k: int(MPS_FRAGMENTATION * (v - overhead)) for k, v in totals.items()}


def mps_sdpa_math(ts: TrainSpec) -> bool:
    """SDPA on ``mps`` while training runs the generic math path (``_scaled_dot_product_attention_math``:
    fp32 probabilities saved, half inputs upcast). Source: torch ``aten/src/ATen/native/
    transformers/attention.cpp`` ``scaled_dot_product_attention``: the fused
    ``_scaled_dot_product_attention_math_for_mps`` is taken only without dropout and with no input
    requiring grad (inference); no flash / memory-efficient kernel is registered for MPS."""
    return ts.device == "mps"
