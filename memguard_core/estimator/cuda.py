"""CUDA device rules: the context and cuBLAS workspaces, the caching allocator's block and segment
sizes and fragmentation, the SDPA kernel choice, and which part of an estimate each CUDA counter
sees. docs/estimator.md, "CUDA".
"""

from __future__ import annotations

from typing import Dict, Optional

from ..errors import ConfigError
from .optimizer import paged_state_bytes
from .result import MemoryEstimate
from .specs import DTYPE_BYTES, MiB, ModelSpec, TrainSpec


#: cuda: the CUDA context (driver state, kernel images, cuDNN/cuBLAS handles), outside every torch
#: counter (``memory_allocated`` / ``memory_reserved`` do not see it, ``nvidia-smi`` does). Bytes.
#: Source: PyTorch docs, notes/cuda.html "Memory management" (the context takes hundreds of MiB per
#: device, depending on the CUDA version and the kernels loaded); an assumption from that source,
#: not fitted on GPU runs (docs/estimator.md, "CUDA").
CUDA_CONTEXT_BYTES = 500 * MiB
#: cuda: the cuBLAS workspaces of a training step, bytes. torch allocates one workspace per
#: (cuBLAS handle, stream) through the caching allocator (``aten/src/ATen/cuda/CublasHandlePool.cpp``
#: ``getCurrentCUDABlasHandle`` / ``cublas_handle_stream_to_workspace``), of the size
#: ``CUBLAS_WORKSPACE_CONFIG`` names -- default ``:4096:2:16:8`` = 2 x 4096 KiB + 8 x 16 KiB =
#: 8.125 MiB (``parseChosenWorkspaceSize``; Hopper builds default to 4 x that). Handles are per
#: thread, and autograd runs the backward of CUDA ops on its own device thread
#: (``torch/csrc/autograd/engine.cpp``), so a step holds two: the forward's and the backward's.
CUDA_CUBLAS_WORKSPACES_BYTES = 2 * (8 * MiB + 128 * 1024)
#: PyTorch CUDA caching allocator sizes, bytes (``c10/cuda/CUDACachingAllocator.cpp``,
#: ``c10/core/AllocatorConfig.h``): every request is rounded up to a multiple of 512 B
#: (``kMinBlockSize``, ``round_size``); requests up to 1 MiB (``kSmallSize``) come from 2 MiB
#: segments of the small pool (``kSmallBuffer``); 1-10 MiB requests (``kMinLargeAlloc``) get 20 MiB
#: segments (``kLargeBuffer``); larger ones a segment rounded up to 2 MiB (``kRoundLarge``,
#: ``get_allocation_size``). ``memory_allocated`` counts the rounded block, ``memory_reserved`` the
#: segments.
CUDA_MIN_BLOCK = 512
CUDA_SMALL_SIZE = 1 * MiB
CUDA_SMALL_BUFFER = 2 * MiB
CUDA_LARGE_BUFFER = 20 * MiB
CUDA_MIN_LARGE_ALLOC = 10 * MiB
CUDA_ROUND_LARGE = 2 * MiB


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes ``memory_allocated`` counts for one CUDA tensor of ``nbytes``: the caching allocator's
    ``round_size`` (at least 512 B, a multiple of 512 B; ``c10/cuda/CUDACachingAllocator.cpp``)."""
    n = max(int(nbytes), 0)
    return CUDA_MIN_BLOCK if n < CUDA_MIN_BLOCK else CUDA_MIN_BLOCK * ((n + CUDA_MIN_BLOCK - 1) // CUDA_MIN_BLOCK)


def cuda_segment_bytes(nbytes: int) -> int:
    """Bytes of the segment (``cudaMalloc``) the caching allocator reserves for a request of
    ``nbytes`` when no cached block fits (``get_allocation_size`` in
    ``c10/cuda/CUDACachingAllocator.cpp``): 2 MiB up to 1 MiB, 20 MiB up to 10 MiB, else rounded up
    to 2 MiB."""
    n = cuda_block_bytes(nbytes)
    if n <= CUDA_SMALL_SIZE:
        return CUDA_SMALL_BUFFER
    if n < CUDA_MIN_LARGE_ALLOC:
        return CUDA_LARGE_BUFFER
    return CUDA_ROUND_LARGE * ((n + CUDA_ROUND_LARGE - 1) // CUDA_ROUND_LARGE)


#: Reserved-but-unallocated slack of PyTorch's CUDA caching allocator (blocks rounded to 512 B /
#: 2 MiB segments, ``c10/cuda/CUDACachingAllocator.cpp``); 5% of the allocated peak is the usual
#: range of ``memory_reserved / max_memory_allocated`` on training loops. An assumption, not fitted
#: on GPU runs (docs/estimator.md, "CUDA").
CUDA_FRAGMENTATION = 0.05


def allocator_slack(totals: Dict[str, int], overhead: int) -> Dict[str, int]:
    """moment -> the caching allocator's reserved-but-unallocated bytes: ``CUDA_FRAGMENTATION`` of
    each moment's ``totals`` less the ``overhead`` outside the allocator (bytes)."""
    return {k: int(CUDA_FRAGMENTATION * (v - overhead)) for k, v in totals.items()}
#: Head dims the CUDA flash kernel takes (``check_head_dim_size_flash`` in torch
#: ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``: q, k, v of one head size <= 256).
CUDA_FLASH_MAX_HEAD_DIM = 256
#: The memory-efficient kernel pads its fp32 logsumexp to a multiple of 32 queries
#: (``_efficient_attention_forward`` in ``aten/src/ATen/native/transformers/cuda/attention.cu``:
#: ``logsumexp`` of shape (batch, heads, ceil(s / 32) * 32) when ``compute_log_sumexp``).
CUDA_EFFICIENT_LSE_PAD = 32


def cuda_sdpa_backend(ms: ModelSpec, ts: TrainSpec) -> str:
    """The kernel ``scaled_dot_product_attention`` runs on CUDA for this model and these settings:
    ``flash`` | ``efficient`` | ``math`` (or ``eager`` when ``attn_impl="eager"``: no SDPA at all;
    ``attn_impl="flash"``, the flash-attn package, saves what the flash kernel saves).

    torch ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` ``select_sdp_backend`` tries the
    backends in ``priority_order`` (flash, memory-efficient, math; cuDNN first only on sm90/sm100
    with cuDNN > 9.15, ``check_prefer_cudnn_attention`` -- it saves the same output + statistics as
    flash) and takes the first whose filters pass:

    * flash (``use_flash_attention``): fp16/bf16 inputs only (``check_dtypes_low_precision``), q/k/v
      of one head dim <= 256 (``check_head_dim_size_flash``), no explicit mask
      (``check_for_attn_mask``; transformers passes ``is_causal=True`` and no mask when a batch has
      no padding), sm80 or newer; dropout is supported (a philox seed and offset are kept and the
      mask is regenerated in the backward), and grouped-query attention too (``enable_gqa``);
    * memory-efficient (``use_mem_efficient_attention``): fp32 as well, head dim a multiple of the
      GEMM alignment (``check_head_dim_size_mem_efficient``: 8 for fp16/bf16, 4 for fp32 on sm80),
      masks and dropout (philox) supported;
    * math otherwise (``_scaled_dot_product_attention_math``: the scores and probabilities are
      materialised and saved).
    The compute dtype is the autocast dtype under ``mixed_precision``. A GPU older than sm80 is not
    modelled (flash is refused there; the memory-efficient kernel saves the same, bar the padding).
    """
    if ts.attn_impl == "eager":
        return "eager"
    if ts.attn_impl == "flash":
        return "flash"
    half = DTYPE_BYTES[ts.dtype] < 4
    hd = ms.head_dim
    if half and hd <= CUDA_FLASH_MAX_HEAD_DIM:
        return "flash"
    if hd % (8 if half else 4) == 0:
        return "efficient"
    return "math"


#: What a published CUDA figure can be, and what of the estimate it compares with.
CUDA_COUNTERS = ("max_memory_allocated", "max_memory_reserved", "nvidia-smi")


def cuda_counter_bytes(est: MemoryEstimate, counter: str = "nvidia-smi", *, paged: Optional[bool] = None) -> int:
    """The part of a ``device="cuda"`` estimate a given counter sees, bytes.

    * ``nvidia-smi`` (the process's device memory): the whole estimate -- CUDA context
      (``CUDA_CONTEXT_BYTES``) + reserved segments + managed (paged) memory resident on the GPU;
    * ``max_memory_reserved`` (``torch.cuda.max_memory_reserved``): without the context (the driver
      holds it, not the caching allocator) and without paged optimizer states;
    * ``max_memory_allocated``: also without the allocator slack (``CUDA_FRAGMENTATION``: cached but
      unused segment bytes). The cuBLAS workspaces stay: torch allocates them through the caching
      allocator.
    ``paged``: the run uses a bitsandbytes paged optimizer (``paged_state_bytes`` leaves the
    allocator's counters); ``None`` = as the estimate's ``train_spec.optimizer`` says
    (``paged-adamw-8bit`` / ``paged-adamw-32bit``, ``TrainSpec.paged``).

    Raises:
        ConfigError: an estimate of another counter, or an unknown ``counter``.
    """
    if est.counter != "cuda":
        raise ConfigError("counter", "an estimate made with device='cuda'", est.counter)
    if counter not in CUDA_COUNTERS:
        raise ConfigError("counter", " | ".join(CUDA_COUNTERS), counter)
    if counter == "nvidia-smi":
        return int(est.peak_bytes)
    if paged is None:
        paged = est.train_spec.paged
    p = paged_state_bytes(est.model_spec, est.train_spec) if paged else 0
    p = int(p * (1 + CUDA_FRAGMENTATION))
    out = est.peak_bytes - CUDA_CONTEXT_BYTES - p
    if counter == "max_memory_allocated":
        out -= est.breakdown.get("allocator_slack", 0) - int(CUDA_FRAGMENTATION * p / (1 + CUDA_FRAGMENTATION))
    return int(out)
