"""CUDA device rules: the context and cuBLAS workspaces, the caching allocator's block and segment
sizes and fragmentation, the SDPA kernel choice, and which part of an estimate each CUDA counter
sees. docs/estimator.md, "CUDA".
"""

from __future__ import annotations

from typing import Dict, Optional

from ..errors import ConfigError
from .heads import head_of
from .optimizer import paged_state_bytes
from .result import MemoryEstimate
from .specs import DTYPE_BYTES, MiB, ModelSpec, TrainSpec


#: The process's device memory outside the caching allocator once a training step has run (the CUDA
#: context and the kernels of the libraries the step loads on first use): NVML's process memory less
#: ``max_memory_reserved``, measured on an H200 (driver 580, CUDA 13.0, torch 2.11), docs/estimator.md#cuda.
CUDA_CONTEXT_BYTES = 758 * MiB
#: cuBLAS's workspace per handle and stream (ATen ``cuda/CublasHandlePool.cpp``,
#: ``parseChosenWorkspaceSize``): ``CUBLAS_WORKSPACE_CONFIG``'s default ``:4096:2:16:8`` (8 MiB + 128 KiB),
#: and 32 MiB on Hopper (compute capability 9.0). torch allocates it through the caching allocator.
CUBLAS_WORKSPACE_BYTES = 8 * MiB + 128 * 1024
CUBLAS_WORKSPACE_SM90_BYTES = 32 * MiB
#: cuBLASLt's own workspace per handle and stream (``parseCUDABlasLtWorkspaceSize``:
#: ``CUBLASLT_WORKSPACE_SIZE``, 1024 KiB by default; none of its own under
#: ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``, which lends it cuBLAS's).
CUBLASLT_WORKSPACE_BYTES = 1 * MiB
#: Threads that run a training step's matmuls, each with its own handle and workspaces: the forward's
#: (the caller's thread) and autograd's backward thread for the device.
CUDA_BLAS_THREADS = 2
#: The workspaces of a step on a GPU not read (a plan made off the machine): Hopper's, the larger,
#: so that an H100 / H200 run is not under by them (an A100's are 2 x 9.1 MiB). An H200 run held
#: 33 MiB per thread (torch 2.11, docs/estimator.md#cuda).
CUDA_CUBLAS_WORKSPACES_BYTES = CUDA_BLAS_THREADS * (CUBLAS_WORKSPACE_SM90_BYTES + CUBLASLT_WORKSPACE_BYTES)


def cublas_workspaces_bytes(ts: TrainSpec) -> int:
    """The cuBLAS and cuBLASLt workspaces a ``device="cuda"`` training step holds, bytes:
    ``CUDA_BLAS_THREADS`` x ``ts.cublas_workspace_bytes`` (one thread's, read on the run's GPU by
    the torch adapter), or ``CUDA_CUBLAS_WORKSPACES_BYTES`` when that is ``None``."""
    per_thread = ts.cublas_workspace_bytes
    return CUDA_CUBLAS_WORKSPACES_BYTES if per_thread is None else CUDA_BLAS_THREADS * int(per_thread)
#: Caching allocator sizes (``c10/cuda/CUDACachingAllocator.cpp``): kMinBlockSize, kSmallSize, kSmallBuffer,
#: kLargeBuffer, kMinLargeAlloc, kRoundLarge; docs/estimator.md#cuda.
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


#: Reserved-but-unallocated share of the live peak: an assumption, not fitted on GPU runs, docs/estimator.md#cuda.
CUDA_FRAGMENTATION = 0.05


def allocator_slack(totals: Dict[str, int], overhead: int, floors: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """moment -> the caching allocator's reserved-but-unallocated bytes: ``CUDA_FRAGMENTATION`` of
    each moment's ``totals`` less the ``overhead`` outside the allocator, or the moment's entry in
    ``floors`` (bytes of cached blocks known to be unusable then, :func:`unusable_cache_bytes`)
    where that is larger."""
    floors = floors or {}
    return {k: max(int(CUDA_FRAGMENTATION * (v - overhead)), int(floors.get(k, 0))) for k, v in totals.items()}


def unusable_cache_bytes(ms: ModelSpec, ts: TrainSpec, cached_block: int) -> int:
    """Bytes the caching allocator holds free but cannot hand to any request of the loss moment of
    a language model (an LM head over a vocabulary) in torch, so they sit on top of its live set in
    ``max_memory_reserved``. The allocator serves a request from one free block at least its size
    (best fit) and never merges blocks of different segments (``c10/cuda/CUDACachingAllocator.cpp``:
    ``get_free_block``, ``try_merge_blocks``):

    * a causal LM's fp16 / bf16 logits (batch x seq x vocab x 2 B; autocast included), through
      transformers' loss: ``ForCausalLMLoss`` upcasts them (``logits.float()``), and when the
      backward starts and frees them every request there is an fp32 tensor twice their size;
    * under activation checkpointing, ``cached_block`` (bytes: one block's working set, less what
      a recompute held at the same moment already reuses): the checkpointed forward frees each
      block's tensors as it goes, and when each is smaller than the logits (a row of logits,
      tokens x vocabulary, over a row of the block's widest tensor, tokens x its widest width) the
      logits chain takes new segments beside them.

    Seen in the allocator's recorded history of an H200 run (``bench/cuda_reserved.py``;
    docs/estimator.md, "The CUDA reserved share of a checkpointed run"). 0 for classifier heads,
    LitGPT's chunked loss and MLX (not torch's allocator)."""
    head = head_of(ms)
    if ts.framework == "mlx" or ts.model_code == "litgpt" or not ms.vocab_size or not head.is_lm:
        return 0
    seq2seq = bool(ms.decoder_layers)
    half = DTYPE_BYTES[ts.dtype] < 4
    upcast = head.kind == "causal_lm" and not seq2seq
    freed_logits = 2 * ts.batch_size * ts.seq_length * ms.vocab_size if half and upcast else 0
    logits_row = (ts.decoder_tokens if seq2seq else ts.seq_length) * ms.vocab_size
    widest = max(ms.hidden_size, ms.intermediate_size, ms.moe_intermediate_size) * ts.seq_length
    cached = int(cached_block) if ts.grad_checkpoint and logits_row > widest else 0
    return freed_logits + cached


#: Largest head dim of the flash kernel: ``check_head_dim_size_flash``, ``cuda/sdp_utils.cpp``.
CUDA_FLASH_MAX_HEAD_DIM = 256
#: The memory-efficient kernel pads its fp32 logsumexp to this many queries: ``_efficient_attention_forward``.
CUDA_EFFICIENT_LSE_PAD = 32


def cuda_sdpa_backend(ms: ModelSpec, ts: TrainSpec) -> str:
    """The kernel ``scaled_dot_product_attention`` runs on CUDA for this model and these settings:
    ``flash`` | ``efficient`` | ``math`` (or ``eager`` when ``attn_impl="eager"``: no SDPA at all;
    ``attn_impl="flash"``, the flash-attn package, saves what the flash kernel saves).

    torch's ``select_sdp_backend`` order: flash for fp16/bf16 with a head dim up to
    ``CUDA_FLASH_MAX_HEAD_DIM``, else memory-efficient for a head dim that is a multiple of 8 (half)
    / 4 (fp32), else math; the compute dtype is the autocast dtype under ``mixed_precision``. The
    filters and their sources: docs/estimator.md#cuda.
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
