"""``estimate()`` and the estimator's constants, re-exported from :mod:`memguard_core.estimator` where
they live now (one module per term of memory and per device: docs/estimator.md). Kept for the
importers outside the estimator (issue 32: they move to the new modules, then this module goes).
"""

from .estimator.bnb import (BNB_4BIT_INPUT_DROPPED, bnb_4bit_keeps_input, version_tuple)
from .estimator.cpu_heap import (CPU_HEAP_SLACK_BACKWARD, CPU_HEAP_SLACK_CHECKPOINTED,
                                 CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS, CPU_HEAP_SLACK_FORWARD,
                                 LORA_FORWARD_TEMPORARIES, LORA_TEMP_BLOCKS, LORA_TEMP_SLACK, MMAP_THRESHOLD_MAX)
from .estimator.cuda import (CUDA_CONTEXT_BYTES, CUDA_COUNTERS, CUDA_CUBLAS_WORKSPACES_BYTES, CUDA_EFFICIENT_LSE_PAD,
                             CUDA_FLASH_MAX_HEAD_DIM, CUDA_FRAGMENTATION, CUDA_LARGE_BUFFER, CUDA_MIN_BLOCK,
                             CUDA_MIN_LARGE_ALLOC, CUDA_ROUND_LARGE, CUDA_SMALL_BUFFER, CUDA_SMALL_SIZE,
                             cuda_block_bytes, cuda_counter_bytes, cuda_sdpa_backend, cuda_segment_bytes)
from .estimator.estimate import estimate
from .estimator.gradients import EMBEDDING_GRAD_COPIES
from .estimator.lora_targets import with_default_lora_targets
from .estimator.mlx import (MLX_CKPT_H, MLX_FULL_BWD_SCORES, MLX_FULL_ONE_TIME_H, MLX_FULL_ONE_TIME_I,
                            MLX_LOGITS_COPIES, MLX_ONE_TIME_H, MLX_ONE_TIME_I, MLX_UPDATE_ARRAYS,
                            MLX_UPDATE_WINDOW_BLOCKS)
from .estimator.mps import MPS_FRAGMENTATION
from .estimator.optimizer import (BNB_PAGED_MIN_NUMEL, paged_state_bytes)
from .estimator.result import (BREAKDOWN_ORDER, MemoryEstimate)
from .estimator.runtime import (CPU_FILE_PAGES_AT_START_BYTES, HF_DATASETS_IMPORT_BYTES, RUNTIME_OVERHEAD_BYTES,
                                runtime_overhead_bytes)
from .estimator.specs import (DTYPE_BYTES, MiB, LinearShape, ModelSpec, NF4_BITS, NF4_DOUBLE_QUANT_BITS, TrainSpec)
from .estimator.trainable import (check_train_spec, trainable_param_count, vision_lora_linears, weights_for_training)
from .estimator.weights import (BNB_4BIT_BLOCKSIZE, BNB_DQ_BLOCKSIZE, nf4_storage_bytes)

__all__ = ["MemoryEstimate", "estimate", "trainable_param_count", "RUNTIME_OVERHEAD_BYTES",
           "BREAKDOWN_ORDER", "runtime_overhead_bytes", "cuda_sdpa_backend", "cuda_counter_bytes",
           "cuda_block_bytes", "cuda_segment_bytes", "nf4_storage_bytes", "paged_state_bytes",
           "bnb_4bit_keeps_input", "CUDA_COUNTERS"]

# the other names kept importable from here (read by tests, bench/ and the adapters)
_REEXPORTED = (BNB_4BIT_BLOCKSIZE, BNB_4BIT_INPUT_DROPPED, BNB_DQ_BLOCKSIZE, BNB_PAGED_MIN_NUMEL, BREAKDOWN_ORDER,
               CPU_FILE_PAGES_AT_START_BYTES, CPU_HEAP_SLACK_BACKWARD, CPU_HEAP_SLACK_CHECKPOINTED,
               CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS, CPU_HEAP_SLACK_FORWARD, CUDA_CONTEXT_BYTES,
               CUDA_COUNTERS, CUDA_CUBLAS_WORKSPACES_BYTES, CUDA_EFFICIENT_LSE_PAD,
               CUDA_FLASH_MAX_HEAD_DIM, CUDA_FRAGMENTATION, CUDA_LARGE_BUFFER, CUDA_MIN_BLOCK,
               CUDA_MIN_LARGE_ALLOC, CUDA_ROUND_LARGE, CUDA_SMALL_BUFFER, CUDA_SMALL_SIZE,
               DTYPE_BYTES, EMBEDDING_GRAD_COPIES, HF_DATASETS_IMPORT_BYTES,
               LORA_FORWARD_TEMPORARIES, LORA_TEMP_BLOCKS, LORA_TEMP_SLACK, LinearShape, MLX_CKPT_H,
               MLX_FULL_BWD_SCORES, MLX_FULL_ONE_TIME_H, MLX_FULL_ONE_TIME_I, MLX_LOGITS_COPIES,
               MLX_ONE_TIME_H, MLX_ONE_TIME_I, MLX_UPDATE_ARRAYS, MLX_UPDATE_WINDOW_BLOCKS,
               MMAP_THRESHOLD_MAX, MPS_FRAGMENTATION, MemoryEstimate, MiB, ModelSpec, NF4_BITS,
               NF4_DOUBLE_QUANT_BITS, RUNTIME_OVERHEAD_BYTES, TrainSpec, bnb_4bit_keeps_input,
               check_train_spec, cuda_block_bytes, cuda_counter_bytes, cuda_sdpa_backend,
               cuda_segment_bytes, estimate, nf4_storage_bytes, paged_state_bytes,
               runtime_overhead_bytes, trainable_param_count, version_tuple, vision_lora_linears,
               weights_for_training, with_default_lora_targets)
