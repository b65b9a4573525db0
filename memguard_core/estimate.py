"""Peak-memory estimate of one fine-tuning process, with a breakdown.

``estimate(model_spec, train_spec)`` returns a :class:`MemoryEstimate`: the predicted peak of one
counter (``train_spec.device``):

* ``cpu``  -- the training process's peak resident set size, ``VmHWM`` in /proc/self/status
  (what the OOM killer and cgroups see);
* ``cuda`` -- peak device memory of the process: CUDA context + the caching allocator's reserved
  bytes (what ``nvidia-smi`` shows at the worst moment);
* ``mlx``  -- ``mx.get_peak_memory()``.

How the peak is composed
------------------------
A training step passes through three moments where memory is highest; the estimate computes each
and reports the largest (``MemoryEstimate.phase``), with the breakdown of the terms live AT that
moment, so ``sum(breakdown.values()) == peak_bytes`` (before ``correction``, which is reported as
its own ``calibration`` term):

``loss``      end of the forward / start of the backward: weights, optimizer states (they exist
              from the 2nd step on), gradients only while accumulating (``grad_accum > 1``: HF
              ``Trainer`` and Lightning keep ``.grad`` between micro-batches; with ``grad_accum == 1``
              ``zero_grad(set_to_none=True)`` freed them after the previous step), the saved
              activations of every block, and the logits/loss working set.
``backward``  end of the backward: weights, optimizer states, ALL gradients, the embedding-gradient
              transient, the first block's working set.
``optimizer`` ``optimizer.step()``: weights, gradients, optimizer states and the optimizer's own
              temporaries.

Sources of the formulas are named in each helper's docstring. Activation bytes follow the method of
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (sec. 4.1:
count the tensors each op saves for its backward), applied tensor by tensor to the modules of
transformers 5.x (``models/llama/modeling_llama.py``, ``models/gpt2/modeling_gpt2.py``,
``models/mixtral/modeling_mixtral.py``) and PyTorch 2.x autograd (which saves an input only when the
gradient of another input needs it: ``tools/autograd/derivatives.yaml``).

This module imports no framework.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .errors import ConfigError
from .spec import (NF4_BITS, NF4_DOUBLE_QUANT_BITS, LinearShape, ModelSpec, TrainSpec,  # noqa: F401  (public here too)
                   check_train_spec, vision_lora_linears, weights_for_training, with_default_lora_targets)

__all__ = ["MemoryEstimate", "estimate", "trainable_param_count", "RUNTIME_OVERHEAD_BYTES",
           "BREAKDOWN_ORDER", "runtime_overhead_bytes", "cuda_sdpa_backend", "cuda_counter_bytes",
           "cuda_block_bytes", "cuda_segment_bytes", "nf4_storage_bytes", "paged_state_bytes",
           "bnb_4bit_keeps_input", "CUDA_COUNTERS"]

MiB = 1 << 20

#: Bytes per element of the compute dtype.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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

#: Cached-but-unused share of the MPS allocator (``aten/src/ATen/mps/MPSAllocator.mm``: a caching
#: allocator of Metal heaps modelled on CUDA's, sizes rounded up within heaps), which
#: ``driver_allocated_memory`` counts. Taken from CUDA_FRAGMENTATION by that likeness; NOT measured
#: on a Mac (no Apple GPU here), so an mps estimate is a prediction from the code alone.
MPS_FRAGMENTATION = CUDA_FRAGMENTATION

#: glibc heap slack on CPU (device="cpu": the counter is VmHWM, resident pages, not live tensors).
#: Torch's CPU allocator calls malloc/free per tensor. glibc serves blocks below its dynamic mmap
#: threshold (it rises to the size of the largest freed mmapped block, at most 32 MiB:
#: ``M_MMAP_THRESHOLD`` in mallopt(3)) from the heap, and freed heap pages stay resident,
#: fragmented; blocks >= 32 MiB are mmapped and go back to the OS on free. With
#: ``MALLOC_MMAP_THRESHOLD_=131072`` pinning the threshold the peak equals the live set this module
#: predicts; with glibc's defaults the forward leaves resident holes in proportion to the
#: activations saved by all blocks (``_activation_traffic``: the holes are the temporaries that
#: each block frees between its saved tensors, and torch's 64-byte-aligned requests cannot reuse
#: an exactly-sized freed chunk, so they accumulate block after block). The proportion depends on
#: how many of a block's tensors are temporaries: a full fine-tune saves most of them (the inputs of
#: its trained linears and norms), LoRA frees them, so the factors are kept per method. At the end
#: of the backward (gradients or the optimizer step peak) the heap holds the forward's holes plus
#: those the backward leaves. Under PEFT LoRA each LoRA'd linear adds out-sized temporaries
#: (``LORA_FORWARD_TEMPORARIES``); their holes are refilled by the next blocks' equal requests, so
#: only ``LORA_TEMP_BLOCKS`` blocks' worth counts, at ``LORA_TEMP_SLACK``. The factors are fitted on
#: the small matrix of ``memguard bench`` (models cut to 2-12 blocks, SmolLM2-135M's 30 at 128-256
#: tokens), measured as a guarded run runs (the heap trimmed at every optimizer step's end,
#: ``TrainSpec.heap_trim``), and scored on full-depth models apart (docs/estimator.md, "CPU heap
#: slack").
#: ``MALLOC_MMAP_THRESHOLD_=131072`` in the training process's environment removes most of the slack.
#: Under activation checkpointing no moment holds every block's activations, so the backward's
#: factor does not apply there: every moment gets the larger of ``CPU_HEAP_SLACK_CHECKPOINTED``'s
#: slack and the last
#: step's heap-resident gradients (``_heap_gradient_bytes``; docs/estimator.md, "Gradient
#: checkpointing on CPU"), unless the run trims the heap at every step's end (``TrainSpec.heap_trim``,
#: the guard's default), which hands those pages back.
CPU_HEAP_SLACK_FORWARD = {"full": 0.3, "lora": 0.5}
CPU_HEAP_SLACK_BACKWARD = {"full": 0.95, "lora": 0.9}
#: Under activation checkpointing: every moment's slack as a multiple of the same un-checkpointed
#: traffic (``_activation_traffic``) -- no moment holds every block's activations, and the holes are
#: those of the checkpointed forward and of each block's recompute, a different mix of sizes than
#: a plain forward's (a full fine-tune recomputes the inputs of its trained linears, LoRA its
#: adapters' temporaries). Fitted on the six checkpointed cases of the small matrix (OPT-125M,
#: SmolLM2-135M, Qwen2.5-0.5B cut to 4 blocks, SmolLM2 cut to 8; LoRA and full), with the other
#: factors on its other cases, all measured with the step-end heap trim (docs/estimator.md, "CPU
#: heap slack").
CPU_HEAP_SLACK_CHECKPOINTED = {"full": 0.25, "lora": 0.65}
#: A checkpointed full fine-tune at the ``loss`` moment, in a run that trims the heap at every
#: step's end (``TrainSpec.heap_trim``): slack in units of ONE block's un-checkpointed traffic
#: (``_activation_traffic`` / the blocks the backward passes through), not of all blocks'. Measured
#: with ``mallinfo2`` beside ``VmRSS`` (docs/estimator.md, "Gradient checkpointing on CPU"): the
#: arena of such a run is as large as the last backward made it (its gradients and the recompute
#: took heap), and the trim handed its free pages back; the next checkpointed forward frees each
#: block's temporaries before the next block asks for the same sizes, so it makes resident again
#: about one block's working set, and the rest of the arena only when the backward reaches it.
#: The later moments keep ``CPU_HEAP_SLACK_CHECKPOINTED``. LoRA runs do not behave so: their arena
#: is what the forward's own temporaries fragmented, and the next forward touches all of it. Fitted
#: with the other factors on the small matrix (its long-row checkpointed cases included).
CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS = 1.0
MMAP_THRESHOLD_MAX = 32 * MiB

#: Dense V x h gradient tensors beyond ``.grad`` in an HF full fine-tune (torch autograd; see
#: ``_embedding_grad_transients``), by (tied head, accumulating gradients):
#: * tied: the head's and the embedding's uses of the one weight share one ``AccumulateGrad`` node,
#:   so the head's V x h gradient waits in the node's input buffer the whole backward; at the end
#:   ``embedding_dense_backward`` makes a dense V x h gradient and the buffer sums the two
#:   (``torch/csrc/autograd/input_buffer.cpp``): 2 tensors beyond the one ``.grad`` counts.
#: * untied, not accumulating: ``AccumulateGrad`` steals the fresh head gradient and the fresh
#:   embedding gradient into ``.grad`` (``torch/csrc/autograd/functions/accumulate_grad.h``: the
#:   new gradient becomes ``.grad`` when none exists): nothing beyond ``.grad``.
#: * untied, accumulating (``grad_accum > 1``, from the 2nd micro-batch on): each new V x h
#:   gradient is added into the existing ``.grad`` (``variable_grad += new_grad``) -- one copy, at
#:   the end of the backward (the embedding) and at its start (the head, while the activations and
#:   the logits' gradients are still alive: counted at the ``loss`` moment).
#: Checked against bench cases (a tied and an untied model); docs/estimator.md, "Embedding-gradient
#: copies".
EMBEDDING_GRAD_COPIES = {(True, False): 2, (True, True): 2, (False, False): 0, (False, True): 1}

#: Breakdown keys in report order.
BREAKDOWN_ORDER = ("weights", "weight_copies", "gradients", "optimizer_states", "master_weights",
                   "optimizer_temporaries", "backward_transients", "activations", "attention_scores", "logits",
                   "runtime_overhead", "allocator_slack", "calibration")

_GPT2_LIKE = ("gpt2", "gpt_bigcode", "gpt_neo", "gptj", "bloom", "falcon", "phi")

#: LayerNorm blocks with a plain (non-gated) MLP whose saved tensors are modelled from their own
#: transformers 5.x modules (``_plain_mlp_block_act``) rather than GPT-2's: model_type ->
#: (MLP activation, attention dropout in training, residual dropouts per block, fused q/k/v
#: buffer, parallel residual). From the config defaults and modules:
#: ``models/opt``: ``activation_function="relu"``, ``attention_dropout=0.0``, ``dropout=0.1``
#: after the attention and after ``fc2``, separate q/k/v projections, sequential residual;
#: ``models/gpt_neox``: ``hidden_act="gelu"`` (exact), ``attention_dropout=0.0``,
#: ``hidden_dropout=0.0``, fused ``query_key_value`` chunked into q/k/v, ``use_parallel_residual=True``
#: (both LayerNorms read the block input).
_PLAIN_MLP_ARCHS = {
    "opt": ("relu", False, 2, False),
    "gpt_neox": ("gelu", False, 0, True),
}


# ---------------------------------------------------------------------------------------------
# result


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted peak of one counter, with the terms live at that peak.

    Attributes:
        peak_bytes: predicted peak of ``counter`` in bytes (after ``correction``).
        breakdown: name -> bytes, in ``BREAKDOWN_ORDER``; values sum to ``peak_bytes``.
        counter: ``cpu`` (VmHWM of the training process) | ``cuda`` (context + reserved) | ``mlx``
            (``mx.get_peak_memory()``).
        phase: the moment of the peak: ``loss`` | ``backward`` | ``optimizer``.
        phases: peak bytes of each moment (before correction).
        phase_breakdowns: the breakdown of each moment (name -> bytes).
        model_spec / train_spec: the inputs.
        trainable_params: trainable parameter count (elements).
        correction: multiplicative calibration factor applied.
        notes: assumptions that applied to this estimate.
    """

    peak_bytes: int
    breakdown: Dict[str, int]
    counter: str
    model_spec: ModelSpec
    train_spec: TrainSpec
    trainable_params: int
    phase: str = "loss"
    phases: Dict[str, int] = field(default_factory=dict)
    phase_breakdowns: Dict[str, Dict[str, int]] = field(default_factory=dict)
    correction: float = 1.0
    notes: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-safe dict: ``peak_bytes`` (int), ``breakdown`` (name -> int), ``counter``, ``phase``,
        ``phases``, ``trainable_params``, ``correction``, ``notes``, ``model`` and ``train``
        (the spec fields)."""
        import dataclasses

        def plain(v):
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if dataclasses.is_dataclass(v):
                return {k: plain(x) for k, x in dataclasses.asdict(v).items()}
            if isinstance(v, dict):
                return {str(k): plain(x) for k, x in v.items()}
            return v

        return {
            "peak_bytes": int(self.peak_bytes),
            "breakdown": {k: int(v) for k, v in self.breakdown.items()},
            "counter": self.counter,
            "phase": self.phase,
            "phases": {k: int(v) for k, v in self.phases.items()},
            "trainable_params": int(self.trainable_params),
            "correction": float(self.correction),
            "notes": list(self.notes),
            "model": plain(self.model_spec),
            "train": plain(self.train_spec),
        }


# ---------------------------------------------------------------------------------------------
# shapes and trainable parameters


def _block_linears(ms: ModelSpec) -> Tuple[LinearShape, ...]:
    """One block's projections: ``ms.block_linears``, or the Llama layout synthesised from the
    config numbers when the spec has none (q/k/v/o with GQA, gate/up/down; MoE experts as
    ``count=num_experts``) -- transformers ``models/llama/modeling_llama.py``."""
    if ms.block_linears:
        return tuple(ms.block_linears)
    h, hd = ms.hidden_size, ms.head_dim
    q, kv = ms.num_heads * hd, ms.num_kv_heads * hd
    out = [LinearShape("q_proj", h, q), LinearShape("k_proj", h, kv), LinearShape("v_proj", h, kv),
           LinearShape("o_proj", q, h)]
    if ms.is_moe:
        i = ms.moe_intermediate_size or ms.intermediate_size
        out += [LinearShape("gate", h, ms.num_experts, kind="router"),
                LinearShape("gate_up_proj", h, 2 * i, count=ms.num_experts, kind="experts"),
                LinearShape("down_proj", i, h, count=ms.num_experts, kind="experts")]
    else:
        i = ms.intermediate_size
        out += [LinearShape("gate_proj", h, i, kind="mlp"), LinearShape("up_proj", h, i, kind="mlp"),
                LinearShape("down_proj", i, h, kind="mlp")]
    return tuple(out)


def _is_lora_target(ls: LinearShape, targets: tuple) -> bool:
    """PEFT's matching, as ``spec.lora_trainable_params`` applies it: a target matches a linear
    whose path (or name) equals it or ends with ``"." + target`` (PEFT
    ``check_target_module_exists``); ``all-linear`` takes every module linear of a block except
    the router and the experts; fused expert tensors (``is_param``) only by a dotted name."""
    path = getattr(ls, "path", "") or ls.name
    is_param = bool(getattr(ls, "is_param", False))
    for t in targets:
        if t.lower() in ("all-linear", "all_linear"):
            if not is_param and ls.kind not in ("router", "experts"):
                return True
            continue
        hit = path == t or path.endswith("." + t) or ls.name == t
        if hit and (not is_param or "." in t):
            return True
    return False


def _lora_linears(ms: ModelSpec, ts: TrainSpec) -> List[LinearShape]:
    return [ls for ls in _block_linears(ms) if _is_lora_target(ls, ts.lora_targets)]


def _num_lora_layers(ms: ModelSpec, ts: TrainSpec) -> int:
    """LoRA blocks: the last ``lora_layers`` (mlx_lm ``num_layers``), all when None."""
    return ms.num_layers if ts.lora_layers is None else min(ts.lora_layers, ms.num_layers)


def _lora_params_per_layer(ms: ModelSpec, ts: TrainSpec) -> int:
    """LoRA adds A (r x in) and B (out x r) per wrapped linear: r * (in + out) parameters
    (Hu et al. 2021, "LoRA", sec. 4)."""
    return sum(ls.count * ts.lora_rank * (ls.in_features + ls.out_features)
               for ls in _lora_linears(ms, ts))


def trainable_param_count(ms: ModelSpec, ts: TrainSpec) -> int:
    """Trainable parameters (elements) as the framework defines them: ``spec.trainable_params``
    (full, hf/lightning: every parameter; full, mlx: the blocks only -- mlx_lm's full fine-tune
    unfreezes ``model.layers[-num_layers:]``; lora/qlora: ``r * (in + out)`` per targeted linear of
    the LoRA'd blocks; a live module's own count when it fits the method). When the settings
    differ from the live adapter (the planner halved the rank or the LoRA layers), the count is
    derived from the shapes (``spec.lora_trainable_params``) instead of the stale live count.

    Raises:
        ConfigError: the LoRA targets match no linear of the block.
    """
    from .spec import lora_trainable_params, trainable_params

    if not ms.block_linears:
        ms = ms.replace(block_linears=_block_linears(ms))
    if (ts.method != "full" and ms.trainable_params is not None and ms.lora_rank_found is not None
            and (ts.lora_rank != ms.lora_rank_found or ts.lora_layers is not None)):
        return lora_trainable_params(ms, ts)
    return trainable_params(ms, ts)


# ---------------------------------------------------------------------------------------------
# static terms


def _weight_bits(ms: ModelSpec, ts: TrainSpec) -> float:
    """Storage bits of the block linears: NF4 (4.5) for QLoRA on an unquantized spec."""
    if ts.method == "qlora" and ms.weight_bits >= 8:
        return NF4_BITS
    return float(ms.weight_bits)


def _weights(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """Stored weights: block linears (attention + MLP + experts) at ``weight_bits`` (NF4 4.5 bits /
    4.127 with double quantization under QLoRA, bitsandbytes ``Linear4bit``), everything else
    (embeddings, head, norms, router) at ``dense_bits`` -- bitsandbytes skips ``lm_head`` and never
    quantizes embeddings or norms (transformers ``integrations/bitsandbytes.py``). LoRA adapters are
    fp32: PEFT ``get_peft_model(autocast_adapter_dtype=True)`` upcasts bf16/fp16 adapters to fp32,
    mlx_lm creates them fp32 (``tuner/lora.py``)."""
    p = ms.params
    quant = p.attention + p.mlp + p.experts
    dense = p.total - quant
    b = quant * _weight_bits(ms, ts) / 8 + dense * ms.dense_bits / 8
    if ts.method != "full":
        b += trainable * 4
    return int(math.ceil(b))


#: bitsandbytes 4-bit quantization (``bitsandbytes/functional.py`` ``quantize_4bit``, the default
#: ``blocksize=64`` that ``Params4bit`` / ``Linear4bit`` and transformers' ``BitsAndBytesConfig``
#: use): weights packed two per byte, one fp32 absmax per block of 64; with double quantization
#: (``compress_statistics=True``, ``bnb_4bit_use_double_quant``) the absmax minus their mean are
#: quantized blockwise again (``quantize_blockwise(absmax, blocksize=256)``): one uint8 per block, an
#: fp32 absmax per 256 blocks, the 256-entry fp32 dynamic code and the fp32 offset.
BNB_4BIT_BLOCKSIZE = 64
BNB_DQ_BLOCKSIZE = 256


def nf4_storage_bytes(numel: int, double_quant: bool = False) -> int:
    """Bytes a bitsandbytes NF4 weight of ``numel`` elements occupies on the device: the packed
    data ``(numel + 1) // 2`` (uint8 storage), the absmax (``ceil(numel / 64)`` fp32; with double
    quantization ``ceil(numel / 64)`` uint8 + ``ceil(blocks / 256)`` fp32 + the 256-entry fp32 code
    + the fp32 offset) and the 16-entry fp32 NF4 code of the ``QuantState``. Source:
    ``bitsandbytes/functional.py`` ``quantize_4bit`` / ``QuantState``; ``nn/modules.py``
    ``Params4bit._quantize``. Per weight this is 4.5 bits (4.127 with double quantization), the
    QLoRA paper's figures (Dettmers et al. 2023, sec. 3), plus a few hundred bytes per tensor."""
    n = int(numel)
    blocks = -(-n // BNB_4BIT_BLOCKSIZE)
    b = (n + 1) // 2 + 16 * 4
    if double_quant:
        b += blocks + 4 * (-(-blocks // BNB_DQ_BLOCKSIZE)) + 256 * 4 + 4
    else:
        b += 4 * blocks
    return b


def _quantized_linears(ms: ModelSpec) -> List[LinearShape]:
    """Block linears bitsandbytes quantizes: the module linears (not routers, not transformers 5's
    fused expert tensors)."""
    return [ls for ls in _block_linears(ms) if not ls.is_param and ls.kind not in ("router", "experts")]


def _dequant_transient(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of the weight bitsandbytes materialises for one quantized linear's matmul, live while
    that linear runs in the forward and again in the backward (one layer at a time).

    * 4-bit: ``MatMul4Bit.forward`` / ``backward`` (``bitsandbytes/autograd/_functions.py``) call
      ``dequantize_4bit(B, quant_state)`` -- a dense out x in weight in ``quant_state.dtype`` (the
      dtype the weight was loaded in) cast ``.to(A.dtype)`` -- then ``F.linear``; the dense copy is
      freed after the matmul. With double quantization ``dequantize_4bit`` first rebuilds the fp32
      absmax (``dequantize_blockwise(absmax, state2) + offset``): 4 bytes per 64 weights more.
      Counted for the largest quantized linear of a block.
    * 8-bit (LLM.int8, ``MatMul8bitLt``): the input quantized to int8 (tokens x in bytes) and the
      int32 product (tokens x out x 4) before it is dequantized.
    Zero without bitsandbytes weights."""
    wb = _weight_bits(ms, ts)
    if ts.framework == "mlx" or ts.method == "full" or wb >= 16:
        return 0
    lins = _quantized_linears(ms)
    if not lins:
        return 0
    e = DTYPE_BYTES[ts.dtype]
    if ts.mixed_precision and ms.dense_bits >= 32 and e < 4:
        e = 2
    if wb >= 8:
        tokens = ts.batch_size * ts.seq_length
        return max(tokens * (ls.in_features + 4 * ls.out_features) for ls in lins)
    big = max(ls.in_features * ls.out_features for ls in lins)
    out = e * big
    if wb < NF4_BITS - 0.1:  # double quantization: the fp32 absmax rebuilt first
        out += 4 * (-(-big // BNB_4BIT_BLOCKSIZE))
    return int(out)


#: bitsandbytes optimizers keep the state of a tensor below ``1e5`` elements in ordinary device
#: memory even when paged (``bitsandbytes/optim/optimizer.py`` ``Optimizer8bit.get_state_buffer``:
#: ``if not self.is_paged or A.numel() < 1e5: return torch.zeros_like(...)``); larger ones go to
#: CUDA unified memory (``F.get_paged``: ``cudaMallocManaged``), prefetched to the GPU for each
#: ``step`` and evicted to the host only under device-memory pressure.
BNB_PAGED_MIN_NUMEL = 100_000


def paged_state_bytes(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of optimizer state a bitsandbytes *paged* optimizer (``paged_adamw_8bit`` /
    ``paged_adamw_32bit``, HF ``optim="paged_adamw_8bit"``) would hold in CUDA unified memory for
    these settings: the states (``_optimizer_states`` per element: 8-bit 2 x (1 + 4/256), 32-bit
    2 x 4 -- bnb's 32-bit states are fp32 whatever the parameter dtype) of the trainable tensors of
    at least ``BNB_PAGED_MIN_NUMEL`` elements. Those bytes are outside the caching allocator:
    ``max_memory_allocated`` / ``max_memory_reserved`` never count them; ``nvidia-smi`` does while
    they are resident on the GPU. ``ts.optimizer`` ``paged-adamw-8bit`` (or ``adamw-8bit``) means
    the 8-bit states, anything else the 32-bit ones. ``cuda_counter_bytes`` leaves these bytes out
    of the allocator's counters when ``ts.optimizer`` is a paged one (``TrainSpec.paged``)."""
    per = 2 * (1 + 4 / 256) if ts.optimizer in ("adamw-8bit", "paged-adamw-8bit") else 8.0
    big = 0
    if ts.method != "full":
        r = ts.lora_rank
        for ls in _lora_linears(ms, ts):
            for numel in (r * ls.in_features, ls.out_features * r):
                if numel >= BNB_PAGED_MIN_NUMEL:
                    big += ls.count * numel
        big *= _num_lora_layers(ms, ts)
    else:
        for ls in _block_linears(ms):
            numel = ls.in_features * ls.out_features
            if numel >= BNB_PAGED_MIN_NUMEL:
                big += ls.count * numel * ms.num_layers
        big += ms.params.embeddings + ms.params.lm_head
    return int(math.ceil(per * big))


def _param_bytes_trainable(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes per element of a trainable parameter (and so of its gradient and, for torch/MLX
    optimizers, of its states: ``torch.zeros_like(p)`` in ``torch/optim/adamw.py``)."""
    if ts.method != "full":
        # PEFT keeps the adapters fp32 (autocast_adapter_dtype); LitGPT converts them with the model
        return DTYPE_BYTES[ts.dtype] if ts.model_code == "litgpt" else 4
    return int(ms.dense_bits // 8)


def _adafactor_state_elems(ms: ModelSpec, ts: TrainSpec) -> int:
    """Adafactor (Shazeer & Stern 2018; transformers ``optimization.py`` ``Adafactor`` with its
    default ``beta1=None``): a matrix (rows x cols) keeps a row vector and a column vector of second
    moments (rows + cols elements); a vector keeps a full second moment; no first moment."""
    r = ts.lora_rank
    n_lora = _num_lora_layers(ms, ts)
    if ts.method != "full":
        return n_lora * sum(ls.count * ((r + ls.in_features) + (ls.out_features + r))
                            for ls in _lora_linears(ms, ts))
    lins = _block_linears(ms)
    lin = sum(ls.count * (ls.in_features + ls.out_features) for ls in lins)
    # block vectors (norms, biases): full second moments
    block_vectors = max(ms.params.blocks - ms.num_layers * sum(ls.params for ls in lins), 0)
    n = _num_lora_layers(ms, ts) if ts.framework == "mlx" else ms.num_layers
    elems = n * lin + block_vectors * n // ms.num_layers
    if ts.framework != "mlx":
        h = ms.hidden_size
        elems += (ms.vocab_size + h) + ms.params.norms - ms.params.norms_in_blocks
        if ms.params.lm_head:
            elems += ms.vocab_size + h
        extra_emb = ms.params.embeddings - ms.vocab_size * h  # learned positions (GPT-2 wpe)
        if extra_emb > 0:
            elems += extra_emb // h + h
    return elems


def _optimizer_states(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """Optimizer state bytes.

    * adam / adamw: exp_avg + exp_avg_sq in the parameter's dtype (``torch/optim/adamw.py``
      ``_init_group``; mlx ``optimizers.Adam.init_single``): 2 x param bytes per trainable element.
    * sgd: HF ``optim="sgd"`` builds ``torch.optim.SGD`` without momentum: no state. MLX's
      ``optimizers.SGD.init_single`` creates ``v = zeros_like(parameter)`` whatever the momentum,
      and the compiled step keeps it: one buffer per parameter (checked on the memory held between
      mlx_lm steps; docs/estimator.md, "MLX constants").
    * sgd-momentum: one momentum buffer per parameter.
    * adafactor: factored second moments, see ``_adafactor_state_elems``.
    * adamw-8bit / paged-adamw-8bit: bitsandbytes block-wise 8-bit states (Dettmers et al. 2022,
      "8-bit Optimizers via Block-wise Quantization"): 2 states x 1 byte + one fp32 absmax per
      256-element block (bitsandbytes ``optim/optimizer.py``, blocksize 256) = 2 x (1 + 4/256)
      bytes per element.
    * paged-adamw-32bit: bitsandbytes ``Optimizer2State`` with 32-bit states allocates them fp32
      whatever the parameter dtype (``optim/optimizer.py`` ``init_state``: ``dtype=torch.float32``
      when ``config["optim_bits"] == 32``): 8 bytes per element. Paged or not, they are counted
      here; ``cuda_counter_bytes`` splits the paged part off the allocator's counters.
    """
    pb = 4 if _master_weights(ms, ts, trainable) else _param_bytes_trainable(ms, ts)
    o = ts.optimizer
    if o in ("adam", "adamw"):
        return 2 * pb * trainable
    if o == "sgd":
        return pb * trainable if ts.framework == "mlx" else 0
    if o == "sgd-momentum":
        return pb * trainable
    if o == "adafactor":
        return pb * _adafactor_state_elems(ms, ts)
    if o in ("adamw-8bit", "paged-adamw-8bit"):
        return int(math.ceil(2 * (1 + 4 / 256) * trainable))
    if o == "paged-adamw-32bit":
        return 8 * trainable
    raise ConfigError("optimizer", "a known optimizer", o)  # pragma: no cover (TrainSpec validates)


def _largest_trainable_tensor(ms: ModelSpec, ts: TrainSpec) -> int:
    if ts.method != "full":
        r = ts.lora_rank
        return max((r * max(ls.in_features, ls.out_features) for ls in _lora_linears(ms, ts)),
                   default=0)
    big = max((ls.in_features * ls.out_features * ls.count for ls in _block_linears(ms)), default=0)
    if ts.framework != "mlx":
        big = max(big, ms.vocab_size * ms.hidden_size)
    return big


def _optimizer_temporaries(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """Transient memory of ``optimizer.step()``.

    * torch adam/adamw: HF's default ``adamw_torch_fused`` (transformers ``training_args.py``, torch
      >= 2.8) runs the fused kernel in place: none. sgd / sgd-momentum update in place: none.
    * adafactor: HF's loop (transformers ``optimization.py`` ``Adafactor.step``) works one
      parameter at a time: ``update = grad**2 + eps`` and ``update = _approx_sq_grad(row, col)``
      (the first freed as the second is built, the rest in place) -- 2 fp32 copies of the largest
      tensor; half-precision parameters add their fp32 upcasts of ``grad`` and ``p`` (2 more).
    * mlx: ``mx.eval`` of the new parameters and states materialises them before the old arrays
      are released: one extra copy of the trainable parameters (MLX arrays are immutable).
    """
    if ts.framework == "mlx" and ts.optimizer != "sgd":
        return trainable * _param_bytes_trainable(ms, ts)
    if ts.optimizer == "adafactor":
        copies = 2 if _param_bytes_trainable(ms, ts) == 4 else 4
        return copies * 4 * _largest_trainable_tensor(ms, ts)
    return 0


def _master_weights(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """An fp32 master copy of the trainable parameters, when the weights are stored in half
    precision, trained in full, and ``mixed_precision`` asks for fp32 masters (Micikevicius et al.
    2018, "Mixed Precision Training", sec. 3.1; accelerate/DeepSpeed/FSDP bf16 with fp32 masters).
    HF ``Trainer`` with ``bf16=True`` on fp32 weights keeps no extra copy (the fp32 weights are the
    masters); see ``_weight_copies`` for its autocast copies."""
    if ts.method == "full" and ts.mixed_precision and ms.dense_bits < 32:
        return 4 * trainable
    return 0


def _grad_layers(ms: ModelSpec, ts: TrainSpec) -> int:
    """Blocks the backward passes through: all blocks when anything below the top needs a gradient
    (full fine-tune of the embeddings; HF + gradient checkpointing makes the embedding output require
    grad via ``enable_input_require_grads``), else from the lowest trainable block up."""
    if ts.method == "full" and ts.framework != "mlx":
        return ms.num_layers
    if ts.grad_checkpoint and ts.framework == "hf":
        return ms.num_layers
    return _num_lora_layers(ms, ts)


def _weight_copies(ms: ModelSpec, ts: TrainSpec) -> int:
    """Autocast half-precision copies of the linear weights (fp32 weights, ``mixed_precision`` with
    a half compute dtype). ``torch.autocast`` casts every ``linear``/``matmul`` weight to the half
    dtype; casts of leaf tensors that require grad are cached until the autocast region exits
    (``aten/src/ATen/autocast_mode.cpp`` ``cached_cast``), and each cast copy of a weight in a block
    the backward passes through is saved by the matmul for grad-input. So: 2 bytes x the linear
    weights of those blocks, plus the head (the tied embedding when tied)."""
    if not (ts.mixed_precision and ms.dense_bits >= 32 and DTYPE_BYTES[ts.dtype] < 4):
        return 0
    lin = sum(ls.params for ls in _block_linears(ms) if ls.kind != "experts")
    exp = sum(ls.params for ls in _block_linears(ms) if ls.kind == "experts")
    if ms.is_moe and ms.num_experts:
        exp = exp * min(ms.num_experts_per_tok * 4, ms.num_experts) // ms.num_experts
    head = ms.vocab_size * ms.hidden_size
    return 2 * ((lin + exp) * _grad_layers(ms, ts) + head)


# ---------------------------------------------------------------------------------------------
# activations


@dataclass
class _Act:
    """Per-block activation bytes per token (multiply by batch x seq), split in terms."""

    hidden: float = 0.0   # saved block tensors (norm inputs, projections, MLP)
    scores: float = 0.0   # attention scores / softmax (eager) or sdpa's logsumexp
    lora: float = 0.0     # LoRA intermediates (x @ A), r per wrapped linear


def _block_act_per_token(ms: ModelSpec, ts: TrainSpec, *, lora: bool, trainable_block: bool) -> _Act:
    """Bytes one block saves for its backward, per token: the module rules of
    ``_block_act_per_token_modules`` plus, for a frozen block of bitsandbytes-quantized linears,
    the inputs those linears save (``_bnb_saved_inputs``)."""
    a = _block_act_per_token_modules(ms, ts, lora=lora, trainable_block=trainable_block)
    if not trainable_block:
        a.hidden += _bnb_saved_inputs(ms, ts, lora=lora)
    return a


#: Attention output projections by name (the rest of a block's attention linears read the
#: normalised block input).
_ATTN_OUT_NAMES = ("o_proj", "out_proj", "dense", "c_proj")


#: The first bitsandbytes release whose ``MatMul4Bit.forward`` no longer keeps its input:
#: ``ctx.tensors = (A, B)`` became ``(None, B)`` in commit 9e75374 ("fix QLoRA mem bug: delete useless
#: buffered activation", #1270, 2024-07-16; github.com/bitsandbytes-foundation/bitsandbytes,
#: ``bitsandbytes/autograd/_functions.py``), first tagged in 0.43.2.
BNB_4BIT_INPUT_DROPPED = (0, 43, 2)


def bnb_4bit_keeps_input(ts: TrainSpec) -> bool:
    """Whether bitsandbytes' 4-bit matmul keeps its input A for the backward in this run:
    ``ts.bnb_version`` before :data:`BNB_4BIT_INPUT_DROPPED` (0.41.1 and 0.42.0 store
    ``ctx.tensors = (A, B)`` whenever an input needs a gradient; from 0.43.2 on ``(None, B)``). An
    unknown version (``None``) takes the older rule, the larger estimate."""
    if ts.bnb_version is None:
        return True
    return version_tuple(ts.bnb_version) < BNB_4BIT_INPUT_DROPPED


def version_tuple(version: str) -> Tuple[int, int, int]:
    """``"0.42.0"`` -> ``(0, 42, 0)``: the first three numbers of a version string, zero-padded
    (``"0.5"`` -> ``(0, 5, 0)``; a suffix such as ``.dev1`` is ignored)."""
    import re

    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
    return parts + (0,) * (3 - len(parts))  # type: ignore[return-value]


def _bnb_saved_inputs(ms: ModelSpec, ts: TrainSpec, *, lora: bool) -> float:
    """Bytes per token that bitsandbytes' quantized linears of one frozen block save, beyond what
    the module rules count (HF / Lightning with NF4 or LLM.int8 block linears; MLX quantization is
    not bitsandbytes).

    bitsandbytes ``autograd/_functions.py``: ``MatMul4Bit.forward`` (what ``Linear4bit.forward``
    calls through ``bnb.matmul_4bit``) computes ``F.linear(A, dequantize_4bit(B, quant_state)
    .to(A.dtype).t(), bias)`` and stores ``ctx.tensors = (A, B)`` whenever
    ``any(ctx.needs_input_grad[:2])`` -- the input A is kept although the backward only needs B
    (``grad_A = grad_output @ dequantize_4bit(B)``; the weight is frozen). ``MatMul8bitLt`` (LLM.int8,
    ``Linear8bitLt``) likewise keeps A in ``ctx.tensors``. Under LoRA the activations require grad
    (the adapters upstream), so every quantized linear of every block the backward passes through
    keeps its input, in the compute dtype (``Linear4bit.forward`` casts x to ``compute_dtype``;
    under autocast the bf16 copy). A frozen 16-bit ``nn.Linear`` keeps nothing for its input
    (``derivatives.yaml`` ``mm``: the input is saved only for the weight's gradient).

    Linears sharing one input (q/k/v; gate/up) save one tensor. When the compute dtype is fp32 and
    LoRA wraps a linear of the group, PEFT's ``lora_A`` already saves that very tensor (no cast):
    nothing more. Phi's single LayerNorm feeds the attention and the MLP (one tensor for both).
    Fused MoE expert tensors are not bitsandbytes modules: not counted.

    bitsandbytes 0.43.2 and later keep no input in ``MatMul4Bit`` (``bnb_4bit_keeps_input``):
    nothing for 4-bit weights then; ``MatMul8bitLt`` still keeps A."""
    wb = _weight_bits(ms, ts)
    if ts.framework == "mlx" or ts.method == "full" or wb >= 16:
        return 0.0
    if wb < 8 and not bnb_4bit_keeps_input(ts):
        return 0.0
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    b = 2 if amp else e
    h = ms.hidden_size
    lora_names = {ls.name for ls in _lora_linears(ms, ts)} if lora else set()
    groups: Dict[str, List] = {}
    for ls in _block_linears(ms):
        if ls.is_param or ls.kind in ("router", "experts"):
            continue
        if ls.kind == "attention":
            role = "attn_out" if ls.name in _ATTN_OUT_NAMES else "attn_in"
        else:
            role = "mlp_in" if ls.in_features == h else "mlp_out"
        if ms.model_type == "phi" and role == "mlp_in":
            role = "attn_in"
        g = groups.setdefault(role, [ls.in_features, False])
        g[1] = g[1] or ls.name in lora_names
    return float(sum(b * fin for fin, has_lora in groups.values() if not (b == 4 and has_lora)))


def _block_act_per_token_modules(ms: ModelSpec, ts: TrainSpec, *, lora: bool, trainable_block: bool) -> _Act:
    """Bytes one block saves for its backward, per token (Korthikanti et al. 2022 sec. 4.1 method,
    applied to transformers 5.x modules and PyTorch autograd's saved tensors).

    Llama family (RMSNorm, RoPE, gated MLP -- ``modeling_llama.py``), e = compute bytes:
      * each RMSNorm saves its input upcast to fp32 (``hidden_states.to(torch.float32)``; ``pow`` and
        ``mul`` save it): 4h -- the block input and the post-attention residual;
        with a trainable norm weight also the normalised tensor (e*h) for the weight's gradient;
      * a linear saves its input only when its weight is trained or LoRA wraps it (LoRA's ``A``
        needs the input; a frozen weight needs none -- ``derivatives.yaml`` ``mm``);
      * attention: q and k after RoPE, v (GQA: kv heads -- transformers' ``use_gqa_in_sdpa``
        passes ``enable_gqa`` when there is no mask; eager ``repeat_kv`` copies to all heads),
        sdpa's output and logsumexp (fp32, per head); eager saves the fp32 softmax (s per head)
        and its cast to e when e < 4 (``eager_attention_forward``);
      * gated MLP: gate (``silu`` input), up, act (the ``*`` operands), and the product when
        ``down_proj`` saves its input: 3 or 4 x e*i;
      * MoE (``MixtralExperts``): per (token, expert) pair, k per token: gate_up (2i), act (i),
        down output (h, saved by the routing-weight multiply), the gathered input (h) and the
        product (i) when the experts train; router logits and fp32 softmax (E per token).
    GPT-2 family (LayerNorm, fused c_attn, gelu_new, dropout 0.1 -- ``modeling_gpt2.py``):
      LayerNorm saves its input (e*h); ``c_attn``'s output (3h) stays alive through q/k/v views;
      ``gelu_new`` written in Python saves x, tanh(.), 0.5x and 1+tanh (4 x e*i); each dropout saves
      a bool mask (1 byte) and the attention dropout forces SDPA's math path on CPU (O(s^2)).
    """
    e = DTYPE_BYTES[ts.dtype]
    s = ts.seq_length
    h, hd = ms.hidden_size, ms.head_dim
    qd, kvd = ms.num_heads * hd, ms.num_kv_heads * hd
    nh = ms.num_heads
    lins = {ls.name: ls for ls in _block_linears(ms)}
    lora_names = {ls.name for ls in _lora_linears(ms, ts)} if lora else set()

    def saves(name: str) -> bool:
        return trainable_block or name in lora_names

    a = _Act()
    gpt2 = ms.model_type in _GPT2_LIKE
    # autocast: linear inputs are cast to e (copies saved), the residual stream stays fp32
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    r = 4 if amp else e  # residual / norm dtype
    if lora:
        a.lora += sum(ls.count * ts.lora_rank * (2 if amp else 4) for ls in _lora_linears(ms, ts))

    def group_input(names, fin: int) -> float:
        """Saved input bytes (per token) of linears that share one input tensor.

        A trained weight saves the input in the compute dtype -- one tensor for the group, or,
        under autocast, one bf16 cast per linear (autocast caches only weight casts). A LoRA'd
        frozen linear saves the input of ``lora_A`` after PEFT casts it to the adapter dtype
        (``peft/tuners/lora/layer.py`` ``_cast_input_dtype``): the shared tensor when e = 4, a
        separate fp32 copy per LoRA'd linear when the base is half (fp32 adapters), a bf16 autocast
        copy per LoRA'd linear under autocast."""
        present = [n for n in names if n in lins] or list(names)
        if trainable_block:
            return 2 * fin * len(present) if amp else e * fin
        lo = [n for n in present if n in lora_names]
        return _lora_input_bytes(ts, len(lo), fin, e, amp)

    if ms.model_type in _PLAIN_MLP_ARCHS:
        return _plain_mlp_block_act(ms, ts, a, lora_names, trainable_block, e, r, amp)
    if gpt2:
        # transformers 5.x ``modeling_gpt2.py``; saved tensors per ``derivatives.yaml`` (checked with
        # ``saved_tensors_hooks`` on GPT-2 blocks; docs/estimator.md, "Attention and dropout rules")
        n_res = 2 if ms.residual_dropout > 0 else 0  # after the attention's c_proj and the MLP
        def lora_in(name: str, fin: int) -> float:
            """A linear's saved input: ``e x fin``; a LoRA'd frozen one's under LoRA dropout as
            ``_lora_input_bytes`` says."""
            if ts.lora_dropout > 0 and not trainable_block and name in lora_names:
                return _lora_input_bytes(ts, 1, fin, e, amp)
            return e * fin

        a.hidden += r * h                       # ln_1 input (native_layer_norm: input, mean, rstd)
        if saves("c_attn"):
            a.hidden += lora_in("c_attn", h)    # c_attn input (ln_1 output)
        core_h, core_s = _attention_core(ms, ts, e, views_of_one_buffer=True)
        a.hidden += core_h
        a.scores += core_s
        if saves("c_proj"):
            a.hidden += lora_in("c_proj", h)    # merged heads (a contiguous copy), c_proj's input
        a.hidden += n_res / 2 * h * _dropout_bytes(ts, e)
        a.hidden += r * h                       # ln_2 input
        i = ms.intermediate_size
        if saves("c_fc"):
            a.hidden += lora_in("c_fc", h)
        a.hidden += 4 * e * i                   # gelu_new in Python: x, tanh(.), 0.5 x, 1 + tanh(.)
        if trainable_block or "c_proj" in lora_names:
            a.hidden += lora_in("c_proj", i)    # mlp c_proj input
        a.hidden += n_res / 2 * h * _dropout_bytes(ts, e)
        return a

    # Llama family
    a.hidden += 4 * h                           # input_layernorm: fp32 input
    if trainable_block:
        a.hidden += r * h                       # normalised (norm weight grad; fp32 under amp)
    a.hidden += group_input(("q_proj", "k_proj", "v_proj"), h)
    eager = ts.attn_impl == "eager"
    cuda_backend = cuda_sdpa_backend(ms, ts) if ts.device == "cuda" else None
    cpu_math = ts.attn_impl == "sdpa" and ((ts.device != "cuda" and ms.attention_dropout > 0) or _mps_math(ts))
    if cpu_math or cuda_backend == "math":
        core_h, core_s = _attention_core(ms, ts, e, views_of_one_buffer=False)
        a.hidden += core_h                      # SDPA's math path: fp32 copies, GQA repeated
        a.scores += core_s
    elif eager:
        a.hidden += e * 3 * qd                  # q, k (RoPE'd), v; ``repeat_kv`` copies k, v to every head
        a.scores += nh * s * (4 + (e if e < 4 else 0))
        if ms.attn_logit_softcapping:
            a.scores += nh * s * e              # soft-capping: ``tanh`` saves its output (Gemma-2)
        if amp:
            a.scores += nh * s * 2
        if ms.attention_dropout > 0:
            # dropout noise (CPU, in e) or 1-byte mask (CUDA ``native_dropout``) and the dropped
            # probabilities
            a.scores += nh * s * (e + _dropout_bytes(ts, e))
    else:
        a.hidden += e * (qd + 2 * kvd)          # q, k (RoPE'd), v
        a.hidden += e * qd                      # sdpa output (flash backward needs it)
        # fp32 logsumexp (CUDA memory-efficient kernel: padded to 32 queries)
        a.scores += _sdpa_lse_per_token(ms, ts, cuda_backend or "flash")
    a.hidden += group_input(("o_proj",), qd)  # o_proj input (contiguous copy)
    a.hidden += 4 * h                           # post_attention_layernorm: fp32 input
    if trainable_block:
        a.hidden += r * h
    # norms beyond the two (Gemma-2/3's post-attention and pre/post-feedforward RMSNorms), counted
    # from the hidden-sized norm weights the blocks hold: each saves its fp32 input (and the
    # normalised tensor when its weight trains)
    extra_norms = _hidden_norms_per_block(ms) - 2
    if extra_norms > 0:
        a.hidden += extra_norms * (4 * h + (r * h if trainable_block else 0))
    if ms.is_moe:
        E, k = ms.num_experts, max(ms.num_experts_per_tok, 1)
        i = ms.moe_intermediate_size or ms.intermediate_size
        a.hidden += e * h                       # router input (router reads the normed hidden)
        a.hidden += E * (e + 4)                 # router logits + fp32 softmax
        per_pair = e * (2 * i + i + h)          # gate_up, act, down output
        if trainable_block:
            per_pair += e * (h + i)             # gathered input, product
        a.hidden += k * per_pair
        return a
    i = ms.intermediate_size
    a.hidden += group_input(("gate_proj", "up_proj"), h)
    a.hidden += 3 * e * i                       # gate, up, act
    a.hidden += group_input(("down_proj",), i)
    return a


def _lora_input_bytes(ts: TrainSpec, n_lora: int, fin: int, e: int, amp: bool) -> float:
    """Bytes per token that ``n_lora`` LoRA'd frozen linears reading one shared input of ``fin``
    features save for their adapters (PEFT ``peft/tuners/lora/layer.py`` ``Linear.forward``:
    ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``, then ``lora_A(dropout(x))``):

    * ``lora_dropout`` 0 (``nn.Identity``): ``lora_A`` saves its input -- the shared tensor itself
      when it is already in the adapter's dtype (fp32 weights: one e x fin for the group), a
      separate fp32 copy per linear when the base is half (PEFT's ``autocast_adapter_dtype``
      keeps the adapters in fp32), a bf16 autocast copy per linear under autocast;
    * ``lora_dropout`` > 0: per linear, the dropout's output (fp32, or the autocast copy ``lora_A``
      saves in its place) and the dropout's mask on an fp32 input: on CPU / mps the ``noise``
      tensor ``_dropout_impl`` multiplies by (4 bytes), on CUDA ``native_dropout``'s 1-byte mask
      (``_dropout_bytes``). The dropout saves its mask only when its input requires grad, which
      is every LoRA'd linear but those ahead of the first trainable one (the first block's
      q/k/v); they are counted alike (a slight over-estimate, one block's worth at most).
    """
    if n_lora <= 0:
        return 0.0
    per = 2 if amp else 4          # lora_A's saved input: the autocast copy, or fp32
    if ts.lora_dropout > 0:
        return (per + _dropout_bytes(ts, 4)) * fin * n_lora
    if amp:
        return 2 * fin * n_lora
    return e * fin if e == 4 else 4 * fin * n_lora


def _hidden_norms_per_block(ms: ModelSpec) -> int:
    """Hidden-sized norms in one block: the blocks' norm parameters over (blocks x hidden), rounded
    (q/k norms of head_dim size round away); 2 when the spec does not count norms."""
    n = ms.params.norms_in_blocks / max(ms.num_layers * ms.hidden_size, 1)
    return int(round(n)) if n >= 1.5 else 2


def _dropout_bytes(ts: TrainSpec, e: int) -> int:
    """Bytes per element a training-mode ``F.dropout`` saves: on CPU ``_dropout_impl`` computes
    ``input * noise`` and ``mul`` saves the noise, in the input's dtype; on CUDA the fused
    ``native_dropout`` saves a 1-byte bool mask (``aten/src/ATen/native/Dropout.cpp``
    ``is_fused_kernel_acceptable`` takes the fused kernel only for CUDA/XPU/lazy tensors, so
    ``mps`` saves the noise as the CPU does)."""
    return e if ts.device in ("cpu", "mps") else 1


def _mps_math(ts: TrainSpec) -> bool:
    """SDPA on ``mps`` while training runs the generic math path (``_scaled_dot_product_attention_math``:
    fp32 probabilities saved, half inputs upcast). Source: torch ``aten/src/ATen/native/
    transformers/attention.cpp`` ``scaled_dot_product_attention``: the fused
    ``_scaled_dot_product_attention_math_for_mps`` is taken only without dropout and with no input
    requiring grad (inference); no flash / memory-efficient kernel is registered for MPS."""
    return ts.device == "mps"


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


def _sdpa_lse_per_token(ms: ModelSpec, ts: TrainSpec, backend: str) -> float:
    """Bytes per token of the fp32 logsumexp the fused SDPA kernels save: heads x 4, padded to a
    multiple of ``CUDA_EFFICIENT_LSE_PAD`` queries for the memory-efficient kernel."""
    nh, s = ms.num_heads, ts.seq_length
    if backend == "efficient":
        padded = -(-s // CUDA_EFFICIENT_LSE_PAD) * CUDA_EFFICIENT_LSE_PAD
        return 4.0 * nh * padded / s
    return 4.0 * nh


def _attention_core(ms: ModelSpec, ts: TrainSpec, e: int, *, views_of_one_buffer: bool) -> Tuple[float, float]:
    """(hidden-sized, score-sized) bytes per token that the attention core saves, from q/k/v to
    its output, for ``scaled_dot_product_attention`` or the eager matmul-softmax-matmul.

    SDPA on CPU (torch ``sdp_utils_cpp.cpp`` ``use_flash_attention_cpp``): the flash kernel unless
    the attention dropout is > 0 in training (``check_for_dropout``); it saves q, k, v as passed
    (views of one fused c_attn buffer keep the whole buffer), its output (e) and an fp32
    logsumexp per head. The math path (``_scaled_dot_product_attention_math``) upcasts half inputs
    to fp32 and saves the scaled q and k^T and a contiguous fp32 v (GQA: repeated to every head),
    the softmax output, the dropout noise and the dropped probabilities, all fp32: 12 bytes per
    score (9 on CUDA, where the dropout mask is 1 byte). Eager (``eager_attention_forward``): q, k,
    v, the softmax output and, with dropout, the noise and the dropped probabilities, in e.
    """
    s, nh = ts.seq_length, ms.num_heads
    qd, kvd = nh * ms.head_dim, ms.num_kv_heads * ms.head_dim
    drop = ms.attention_dropout > 0
    qkv = e * (qd + 2 * kvd) if views_of_one_buffer else 0.0
    if ts.attn_impl == "eager":
        # with dropout: CPU saves the noise in e (``_dropout_impl``), CUDA a 1-byte mask
        per_score = e + ((e + _dropout_bytes(ts, e)) if drop else 0)
        return qkv, nh * s * per_score
    if ts.device == "cuda":
        backend = cuda_sdpa_backend(ms, ts)
        if backend == "math":
            # fp32 probabilities, and with dropout the 1-byte ``native_dropout`` mask and the dropped
            # probabilities (fp32)
            per_score = 4 + ((1 + 4) if drop else 0)
            return 4.0 * 3 * qd, nh * s * per_score
        return qkv + e * qd, _sdpa_lse_per_token(ms, ts, backend)
    if ts.attn_impl == "sdpa" and (drop or _mps_math(ts)):
        per_score = 4 + (4 + 4 if drop else 0)  # fp32 probabilities (+ noise and dropped ones)
        return 4.0 * 3 * qd, nh * s * per_score
    return qkv + e * qd, 4.0 * nh


def _plain_mlp_block_act(ms: ModelSpec, ts: TrainSpec, a: _Act, lora_names: set, trainable_block: bool,
                         e: int, r: int, amp: bool) -> _Act:
    """Saved bytes per token of a LayerNorm block with a plain MLP (``_PLAIN_MLP_ARCHS``: OPT,
    GPT-NeoX), tensor by tensor (PyTorch ``derivatives.yaml``):

    * ``native_layer_norm`` saves its input (r x h) and per-token mean/rstd (negligible); the weight
      gradient is computed from them, so no normalised copy (unlike RMSNorm's Python ``weight *
      hidden``). A parallel residual's two norms read the same block input: one tensor.
    * a linear saves its input only when its weight trains or LoRA wraps it; q, k and v (e x h
      each, also from GPT-NeoX's fused ``query_key_value``: the saved q/k/v hold their own
      storages), SDPA's output and fp32 logsumexp (CPU flash kernel with no dropout and no mask);
      the out projection, when it saves, a merged-heads copy of the output (e x h). Eager
      attention: the fp32 probabilities (cast to e when e < 4).
    * ``relu`` saves its result, which is the next linear's input (no extra tensor); exact ``gelu``
      saves its input, and the next linear, when it saves, its output.
    * dropout on CPU is ``input * noise`` with a ``noise`` tensor in the input's dtype
      (``aten/src/ATen/native/Dropout.cpp`` ``_dropout_impl``; the fused ``native_dropout`` with
      its 1-byte mask is taken on CUDA only): e x h per dropout on CPU, 1 x h on CUDA.
    Checked with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages saved inside one
    block, parameters excluded) on OPT and Pythia blocks; GPT-2's modelling does not fit them
    (``gelu_new``'s four saved tensors and the attention-dropout math path, neither of which OPT
    has). docs/estimator.md, "Attention and dropout rules"."""
    act, attn_drop, n_drop, parallel = _PLAIN_MLP_ARCHS[ms.model_type]
    h, s, nh = ms.hidden_size, ts.seq_length, ms.num_heads
    i = ms.intermediate_size
    lins = _block_linears(ms)

    def role_saves(pred) -> int:
        """Linears of a role that save their input (trained or LoRA'd)."""
        return sum(1 for ls in lins if pred(ls) and (trainable_block or ls.name in lora_names))

    attn_out_names = ("out_proj", "dense", "o_proj", "c_proj")
    attn_in = role_saves(lambda ls: ls.kind == "attention" and ls.name not in attn_out_names)
    attn_out = role_saves(lambda ls: ls.kind == "attention" and ls.name in attn_out_names)
    mlp_in = role_saves(lambda ls: ls.kind != "attention" and ls.in_features == h)
    mlp_out = role_saves(lambda ls: ls.kind != "attention" and ls.in_features != h)

    def dropped(n: int, fin: int, saved: float) -> float:
        """An out projection's input, ``saved`` as modelled without LoRA dropout; with it, what
        the LoRA'd frozen ones save instead (``_lora_input_bytes``)."""
        if ts.lora_dropout > 0 and not trainable_block:
            return _lora_input_bytes(ts, n, fin, e, amp)
        return saved

    def inp(n: int) -> float:
        """A shared input saved by n linears: one tensor, or one autocast copy per linear; LoRA'd
        frozen linears as ``_lora_input_bytes`` says."""
        if not n:
            return 0.0
        if not trainable_block:
            return _lora_input_bytes(ts, n, h, e, amp)
        if amp:
            return 2 * h * n
        return e * h

    a.hidden += r * h                           # input LayerNorm: its input
    a.hidden += inp(attn_in)
    a.hidden += e * 3 * h                       # q, k, v
    if ts.attn_impl == "eager" or attn_drop or _mps_math(ts):
        a.scores += nh * s * (4 + (e if e < 4 else 0) + (1 if attn_drop else 0))
    else:
        a.hidden += e * h                       # SDPA output
        a.scores += _sdpa_lse_per_token(ms, ts, cuda_sdpa_backend(ms, ts) if ts.device == "cuda" else "flash")
    if attn_out:
        a.hidden += dropped(attn_out, h, e * h)  # merged heads, the out projection's input
    a.hidden += n_drop * h * _dropout_bytes(ts, e)  # dropout noise / mask
    if not parallel:
        a.hidden += r * h                       # post-attention LayerNorm input (the residual)
    a.hidden += inp(mlp_in)
    a.hidden += e * i                           # relu's result / gelu's input
    if act != "relu" and mlp_out:
        a.hidden += dropped(mlp_out, i, e * i)  # gelu's output, the MLP out projection's input
    elif mlp_out and ts.lora_dropout > 0 and not trainable_block:
        a.hidden += dropped(mlp_out, i, 0.0)    # relu's result is saved anyway; the adapters' own
    return a


def _activations(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int, int, int]:
    """Saved activations of all blocks at the end of the forward.

    Returns (hidden, scores, lora, one_block_working_set) in bytes for the micro-batch.
    Without checkpointing every block the backward passes through keeps its saved tensors; blocks
    below the lowest trainable block keep none (no tensor there requires grad). With gradient
    checkpointing as HF/Lightning/mlx_lm do it (one checkpoint per block: transformers
    ``modeling_utils.py`` ``_activation_checkpointing_enable``, torch ``utils/checkpoint.py``) each
    block keeps only its input hidden state (e*h per token), and during the backward ONE block's
    full working set is recomputed (counted in the ``backward``/``loss`` moments) -- not sqrt(L).
    """
    tokens = ts.batch_size * ts.seq_length
    e = DTYPE_BYTES[ts.dtype]
    n_grad = _grad_layers(ms, ts)
    n_lora = _num_lora_layers(ms, ts)
    full = ts.method == "full"
    lora = not full
    # blocks that train (full: all for hf; mlx: the last n) vs frozen blocks grads flow through
    if full:
        n_train = ms.num_layers if ts.framework != "mlx" else n_lora
    else:
        n_train = n_lora
    n_frozen = max(n_grad - n_train, 0)
    top = _block_act_per_token(ms, ts, lora=lora, trainable_block=full)
    frozen = _block_act_per_token(ms, ts.replace(lora_targets=("__none__",)), lora=False,
                                  trainable_block=False) if n_frozen else _Act()
    one = int((top.hidden + top.scores + top.lora) * tokens)
    if ts.grad_checkpoint:
        amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
        per = (4 if amp else e) * ms.hidden_size * tokens
        return n_grad * per, 0, 0, one
    hidden = (n_train * top.hidden + n_frozen * frozen.hidden) * tokens
    scores = (n_train * top.scores + n_frozen * frozen.scores) * tokens
    lo = n_train * top.lora * tokens
    return int(hidden), int(scores), int(lo), one


def _vision_activations(ms: ModelSpec, ts: TrainSpec, images: float) -> int:
    """Bytes the vision tower and projector of a vision-language model save for the backward when
    LoRA reaches their linears (``vision_lora_linears``: ``all-linear``, or names PEFT's suffix rule
    matches there), for ``images`` images per row x ``batch_size`` rows; 0 when no vision linear is
    LoRA'd (nothing on the vision side then requires grad), without a ``ModelSpec.vision_tower`` or
    under mlx (no vision-language models there).

    Per patch (``VisionTower.patches_per_image``: the tokens the blocks run on, before any merger
    or pixel shuffle), per block, with e = compute bytes, r = residual / norm bytes (fp32 under
    autocast), the same rules as the text blocks (``_block_act_per_token_modules``):

    * pre-norms: a LayerNorm saves its input (r x h; ``native_layer_norm``), Qwen2.5-VL's RMSNorm its
      fp32 input (4h); block 0's first norm runs before anything requires grad (the patch
      embedding is a frozen convolution) and saves nothing;
    * LoRA'd frozen linears save their adapters' inputs as ``_lora_input_bytes`` says (q/k/v or fused
      ``qkv`` share one input; the MLP's input linears share one) and ``x @ A`` (r per linear);
    * attention (SDPA's CPU flash kernel, no mask: ``sdpa_attention_forward``): q, k, v and the
      output (e x h each; Qwen2-VL's RoPE'd q and k are new tensors and its ``v`` a view that keeps
      the whole ``qkv`` output alive: e x 5h), the fp32 logsumexp per head; eager attention: the
      same q, k, v, and the fp32 probabilities (+ their cast to e when e < 4) instead of the output
      and logsumexp;
    * MLP: QuickGELU (``x * sigmoid(1.702 x)``) saves x and the sigmoid (2 x e x i), exact / tanh
      GELU its input (e x i), the gated SiLU MLP gate, up and act (3 x e x i).
    Projector, per projector token: the norm ahead of it (Qwen2-VL's ``ln_q``), the GELU between
    its linears and the LoRA'd linears' inputs; tower-level norms / pooling
    (``extra_patch_features``) in e per patch. Under gradient checkpointing each vision block keeps
    its input (r x h per patch) instead of its saved tensors (the projector is not checkpointed).
    Source: transformers 5 modeling files named at ``spec.vision_tower_from_config``; checked with
    ``saved_tensors_hooks`` on a real LoRA step of a narrowed Qwen2-VL (tests/test_vlm_lora.py)."""
    vt = ms.vision_tower
    if vt is None or images <= 0 or ts.method == "full" or ts.framework == "mlx":
        return 0
    hits = vision_lora_linears(ms, ts.lora_targets)
    if not hits:
        return 0
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    r = 4 if amp else e
    h, i, nh = vt.hidden_size, vt.intermediate_size, vt.num_heads
    T = vt.patches_per_image
    block_lora = {lin.path for lin, n in hits if lin in vt.block_linears}
    proj_lora = [lin for lin, n in hits if lin in vt.projector_linears]
    ad = 2 if amp else 4  # adapter dtype: fp32 (PEFT autocast_adapter_dtype), the autocast copy under amp

    def group(paths, fin: int) -> float:
        return _lora_input_bytes(ts, sum(1 for p in paths if p in block_lora), fin, e, amp)

    per_patch = 0.0   # all blocks together, per patch
    if block_lora:
        norm = 4 * h if vt.norm == "rmsnorm" else r * h
        per = 2 * norm                                    # norm1, norm2 inputs
        names = {lin.path for lin in vt.block_linears}
        fused = "attn.qkv" in names
        per += group(("attn.qkv",) if fused else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), h)
        qkv_kept = e * (5 * h if fused else 3 * h)   # q, k, v; a fused qkv's whole output behind the v view
        if ts.attn_impl == "eager":
            per += qkv_kept + nh * T * (4 + (e if e < 4 else 0))
        else:
            per += qkv_kept + e * h + 4 * nh
        per += group(("attn.proj", "self_attn.out_proj"), h)
        if vt.act == "silu_gated":
            per += group(("mlp.gate_proj", "mlp.up_proj"), h) + 3 * e * i + group(("mlp.down_proj",), i)
        else:
            per += group(("mlp.fc1",), h) + (2 if vt.act == "quick_gelu" else 1) * e * i + group(("mlp.fc2",), i)
        per += sum(ad * ts.lora_rank * lin.count for lin in vt.block_linears if lin.path in block_lora)
        if ts.grad_checkpoint:
            per_patch = vt.num_layers * r * h
        else:
            per_patch = vt.num_layers * per - norm     # block 0's norm1 saves nothing
        per_patch += r * vt.extra_patch_features
        if fused:  # Qwen2-VL's vision RoPE: fp32 cos and sin per patch, built once, saved by every block's mul
            per_patch += 2 * 4 * vt.head_dim
    per_tok = 0.0     # the projector, per projector token
    if block_lora or proj_lora:
        if block_lora and vt.projector_norm:
            per_tok += r * vt.projector_norm
        first = vt.projector_linears[0] if vt.projector_linears else None
        if vt.projector_act and (block_lora or (first is not None and first in proj_lora)):
            per_tok += e * vt.projector_act
        for lin in proj_lora:
            per_tok += _lora_input_bytes(ts, 1, lin.in_features, e, amp) + ad * ts.lora_rank
    return int((per_patch * T + per_tok * vt.projector_tokens) * images * ts.batch_size)


def _bnb_last_step_inputs(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of the previous micro-batch's bitsandbytes inputs still live while the next forward
    runs, in a loop that keeps the last step's output (``TrainSpec.last_graph_kept``).

    ``MatMul4Bit`` (bitsandbytes before 0.43.2) and ``MatMul8bitLt`` keep A as a plain attribute
    of ``ctx`` (``ctx.tensors = (A, B)`` / ``(CAt, subA, A)``, ``bitsandbytes/autograd/
    _functions.py``), not through ``save_for_backward``. The backward frees only saved variables
    (``retain_graph=False``: ``PyNode::release_variables``, ``torch/csrc/autograd/python_function.cpp``),
    so a ``ctx`` attribute lives as long as the graph's nodes do -- until the last reference to the
    step's output goes. A hand-written loop that writes ``logits = model(x)`` every step (LitGPT's
    ``finetune/lora.py`` ``fit``, Lightning-AI/litgpt at 00af8b0d) drops the old list only when the
    new forward returns: the previous step's inputs of every quantized linear are live beside the
    new step's activations at the end of the forward. Counted with the micro-batch's own shape
    (the previous step at the same length), at the loss moment; 0 under gradient checkpointing
    (not modelled), without bitsandbytes weights, or when the loop keeps no graph."""
    if (ts.grad_checkpoint or not ts.last_graph_kept or ts.framework == "mlx" or ts.method == "full"
            or _weight_bits(ms, ts) >= 16):
        return 0
    tokens = ts.batch_size * ts.seq_length
    n_train = _num_lora_layers(ms, ts)
    n_frozen = max(_grad_layers(ms, ts) - n_train, 0)
    per = n_train * _bnb_saved_inputs(ms, ts, lora=True)
    if n_frozen:
        per += n_frozen * _bnb_saved_inputs(ms, ts.replace(lora_targets=("__none__",)), lora=False)
    return int(per * tokens)


#: mlx_lm: the backward's one-time working set beyond the blocks' saved arrays, per token, in
#: units of compute-dtype elements: ``MLX_ONE_TIME_H`` x hidden + ``MLX_ONE_TIME_I`` x intermediate
#: (the top block's backward temporaries -- each LoRA'd / trained linear produces its base and
#: adapter input-gradients before they are summed -- plus the final norm, the head's input and its
#: gradient). ``mx.get_peak_memory()`` of real ``mlx_lm.tuner.trainer.train`` runs is linear in
#: the number of blocks with the slope the saved-array count below predicts; these two terms are
#: the intercept at 0 blocks, regressed over tiny Llama-layout LoRA runs (fitted on real mlx_lm
#: runs; docs/estimator.md, "MLX constants").
MLX_ONE_TIME_H = 16
MLX_ONE_TIME_I = 6
#: Why a one-time working set at all, and why it differs between LoRA and full fine-tuning: MLX's
#: CPU backend evaluates asynchronously. ``mx.eval`` walks the tape on the calling thread and, for
#: each array, allocates its output (``eval_cpu``) and enqueues the kernel on the stream's worker
#: thread; the caller only blocks when more than ``MAX_ACTIVE_TASKS`` (10, ``mlx/transforms.cpp``)
#: scheduler tasks are pending, and the CPU encoder counts one task per ``DISPATCHES_PER_TASK``
#: (10, ``mlx/backend/cpu/encoder.h`` of the installed wheel) dispatches -- so up to ~100 dispatches
#: (about 50 ops, kernel + buffer release each) are encoded, their outputs allocated, while the
#: worker still holds the inputs of the ops it has not run. The peak is the live set at the loss
#: plus the outputs of the first ~50 backward ops: asynchronous steps peak higher than the same
#: steps run synchronously (``mx.set_memory_limit(1)`` makes the eval loop wait for every task),
#: and vary between runs by whole arrays. The ``MLX_ONE_TIME_*`` terms are that window.
#: Its content depends on the backward's op mix:
#: under LoRA each adapted linear's backward is ~6 ops (base and adapter input-gradients, scaled,
#: summed; ``x @ A`` and ``g @ B^T`` products), so the window ends inside the top block's MLP, with
#: ~3 extra intermediate-sized arrays from ``down_proj``; a full fine-tune's linear backward is 2
#: ops (``g @ W`` and ``g^T x``), so the same window reaches through the top block's attention
#: backward, which on CPU (``mx.fast.scaled_dot_product_attention``'s fallback, ``softmax(q k^T)
#: v``) allocates two score-sized arrays (the probabilities' cotangent ``g v^T`` and the softmax
#: VJP), heads x seq per token each. Full fine-tune window: ``MLX_FULL_ONE_TIME_H`` x h +
#: ``MLX_FULL_ONE_TIME_I`` x i per token plus ``MLX_FULL_BWD_SCORES`` score arrays, regressed over
#: real mlx_lm full fine-tunes of tiny Llama shapes (LoRA runs of the same sweep show no score
#: term). Not covered: bf16 tiny models, where the same window is relatively larger. Fitted on real
#: mlx_lm runs; docs/estimator.md, "MLX constants".
MLX_FULL_ONE_TIME_H = 20
MLX_FULL_ONE_TIME_I = 3
MLX_FULL_BWD_SCORES = 2
#: mlx_lm ``default_loss``: logits (B, L, V) in the model dtype, ``nn.losses.cross_entropy``'s
#: ``logsumexp`` and the gathered-target difference, the logits' gradient and the ``astype``: 4 x
#: e x V per token, matching the vocabulary slope of real runs (docs/estimator.md, "MLX constants").
MLX_LOGITS_COPIES = 4
#: mlx_lm ``grad_checkpoint`` (``mx.checkpoint`` around each block's ``__call__``): per block, 4
#: hidden-sized arrays per token stay (the checkpoint's input and output and their cotangent
#: buffers), matching the per-block slope of checkpointed runs (docs/estimator.md, "MLX constants").
MLX_CKPT_H = 4


#: mlx_lm full fine-tune, the end of the compiled step (``train``'s ``step``: backward and
#: ``optimizer.update`` in one ``mx.compile``d graph, evaluated by one ``mx.eval``): the update of a
#: parameter is encoded as soon as its gradient is, so, with the asynchronous window described at
#: ``MLX_ONE_TIME_I``, the gradients and the new arrays of the last blocks reached by the backward
#: are allocated together while the old parameters and states are still held. Per trainable element
#: in flight, in the parameter's bytes: Adam/AdamW 4 (the gradient, the new m, the new v and the new
#: parameter; ``mlx/optimizers/optimizers.py`` ``Adam.apply_single``); SGD without momentum 1.25
#: (the gradient; ``parameter - lr * gradient`` mostly reuses the gradient's buffer, MLX donating an
#: elementwise op's sole-reference input); others: the gradient, one new array per state and the
#: new parameter. The window holds the updates of about ``MLX_UPDATE_WINDOW_BLOCKS`` blocks (the
#: same steps evaluated synchronously, ``mx.set_memory_limit(1)``, rise far less). Fitted on
#: parameter-dominated mlx_lm full fine-tunes; docs/estimator.md, "MLX constants".
MLX_UPDATE_ARRAYS = {"adam": 4, "adamw": 4, "sgd": 1.25, "sgd-momentum": 3}
MLX_UPDATE_WINDOW_BLOCKS = 2.25


def _mlx_full_optimizer_moment(ms: ModelSpec, ts: TrainSpec, trainable: int) -> Tuple[int, int, int, int]:
    """mlx_lm full fine-tune, the end of the compiled step: (gradients, new parameters and states,
    activations, attention-score arrays) in flight, bytes.

    * the update window: ``MLX_UPDATE_ARRAYS`` arrays per trainable element of the last
      min(trained blocks, ``MLX_UPDATE_WINDOW_BLOCKS``) blocks, the first of them the gradient
      (the rest reported as optimizer temporaries); one block's trainable elements are
      ``params.blocks / num_layers``, so a spec that does not know how many blocks train (mlx_lm's
      ``num_layers`` is not on the model) still gets the window right from ``trainable``;
    * the backward still running below it: the saved arrays of the trained blocks beyond the window
      (the backward has not reached them yet), plus the backward's one-time window
      (``MLX_FULL_ONE_TIME_*`` and the attention backward's ``MLX_FULL_BWD_SCORES``).
    Fitted on real mlx_lm steps: see ``MLX_UPDATE_ARRAYS`` and docs/estimator.md, "MLX constants"."""
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length
    per_block_params = ms.params.blocks / max(ms.num_layers, 1)
    n_spec = max(_num_lora_layers(ms, ts), 1)
    n_trained = min(float(n_spec), trainable / per_block_params) if per_block_params > 0 else n_spec
    pb = _param_bytes_trainable(ms, ts)
    window = pb * min(trainable, MLX_UPDATE_WINDOW_BLOCKS * per_block_params)
    arrays = MLX_UPDATE_ARRAYS.get(ts.optimizer, 4)
    hidden, scores, one_time, _ = _mlx_activations(ms, ts)
    bwd_scores = MLX_FULL_BWD_SCORES * e * ms.num_heads * ts.seq_length * tokens
    saved_per_block = (hidden + scores - bwd_scores) / n_spec
    lower = max(n_trained - MLX_UPDATE_WINDOW_BLOCKS, 0.0)
    return (int(window), int(max(arrays - 1, 0) * window), int(one_time + lower * saved_per_block),
            int(bwd_scores))


def _mlx_activations(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int, int, int]:
    """mlx_lm's activation memory for ``mx.get_peak_memory()``: (blocks, attention probs, one-time
    backward working set, logits) in bytes for the micro-batch.

    MLX differentiates the lazy graph (``nn.value_and_grad``) and ``mx.eval`` of the compiled step
    keeps every forward array a VJP reads until the backward consumes it (``mlx/transforms.cpp``
    ``vjp``; arrays are released when their last consumer ran). For one mlx_lm Llama/Qwen2 block
    (``mlx_lm/models/llama.py``) the arrays read by the backward are, per token: the block input
    and the post-attention residual (RMSNorm's VJP reads its input: ``mx.fast.rms_norm``), the two
    normalised tensors (inputs of the LoRA'd / trained projections), q and k after RoPE and v
    (``mx.fast.scaled_dot_product_attention``'s CPU fallback: ``softmax(q k^T) v``), the
    attention output (o_proj's input), and in the MLP gate, sigmoid(gate), silu(gate), up and the
    product (down_proj's input): e x (4h + 2 q_dim + 2 kv_dim + 5i), plus the softmax output
    (heads x seq per token, compute dtype). Half-precision blocks with fp32 LoRA adapters promote
    each LoRA'd input to fp32 for ``x @ lora_a`` (mlx_lm ``tuner/lora.py``): 4 bytes per element of
    each LoRA'd input group. MoE (``SwitchGLU``): the MLP terms per routed expert (top-k), plus the
    router's logits and scores. Blocks below the lowest trained block keep nothing (no VJP reaches
    them). With checkpointing each block keeps ``MLX_CKPT_H`` hidden-sized arrays and one block's
    saved set is recomputed at a time. A full fine-tune (mlx_lm unfreezes whole blocks, norms
    included) also keeps each trained RMSNorm's normalised input for its weight's gradient (2 x e x
    h per token per block: freezing the norms removes the full-vs-LoRA difference of the live set),
    and its one-time window is ``MLX_FULL_ONE_TIME_*`` plus ``MLX_FULL_BWD_SCORES`` score-sized
    arrays (returned in the probs term). Constants ``MLX_*`` above: fitted on real mlx_lm runs, see
    their comments and docs/estimator.md, "MLX constants".
    """
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length
    h, hd = ms.hidden_size, ms.head_dim
    qd, kvd = ms.num_heads * hd, ms.num_kv_heads * hd
    n = _grad_layers(ms, ts)
    if ms.is_moe:
        k = max(ms.num_experts_per_tok, 1)
        i = (ms.moe_intermediate_size or ms.intermediate_size)
        mlp = k * (5 * i + h) + 2 * ms.num_experts
        i_eff = k * i
    else:
        i = ms.intermediate_size
        mlp = 5 * i
        i_eff = i
    per_block = e * (4 * h + 2 * qd + 2 * kvd + mlp)
    if ts.method == "full":
        # trained RMSNorm weights: the VJP for each norm's weight reads the normalised input
        # (``x * rsqrt(mean(x^2) + eps)``), one hidden-sized array per norm, 2 per block -- like
        # HF's ``_block_act_per_token`` (the "normalised" term of a trainable block)
        per_block += e * 2 * h
    if ts.method != "full" and e < 4:
        names = {ls.name for ls in _lora_linears(ms, ts)}
        groups = [(("q_proj", "k_proj", "v_proj"), h), (("o_proj",), qd), (("gate_proj", "up_proj"), h),
                  (("down_proj",), i)]
        per_block += sum(4 * fin for ns, fin in groups if names & set(ns))
    probs = e * ms.num_heads * ts.seq_length
    if ts.method == "full":
        one_time = e * (MLX_FULL_ONE_TIME_H * h + MLX_FULL_ONE_TIME_I * i_eff) * tokens
        bwd_scores = MLX_FULL_BWD_SCORES * probs * tokens
    else:
        one_time = e * (MLX_ONE_TIME_H * h + MLX_ONE_TIME_I * i_eff) * tokens
        bwd_scores = 0
    logits = MLX_LOGITS_COPIES * e * ms.vocab_size * tokens
    if ts.grad_checkpoint:
        blocks = n * MLX_CKPT_H * e * h * tokens + (per_block + probs) * tokens
        return int(blocks), int(bwd_scores), int(one_time), int(logits)
    return int(n * per_block * tokens), int(n * probs * tokens + bwd_scores), int(one_time), int(logits)


def _activation_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of activations one step saves across all blocks without checkpointing; drives the CPU
    heap slack (see ``CPU_HEAP_SLACK_FORWARD``), also under checkpointing.

    Under checkpointing nothing inside a block is saved, yet the heap's resident slack still grows
    with the number of checkpointed blocks, not with one block's working set (glibc's arena grows
    during the first checkpointed forward far beyond what is in use; with
    ``MALLOC_MMAP_THRESHOLD_=131072`` the peak is the live set). The slack observed under
    checkpointing is of the order of the forward's factor times this un-checkpointed traffic, so
    that factor is reused rather than a separate one fitted (checked on checkpointed depth sweeps;
    docs/estimator.md, "CPU heap slack").

    Score-sized tensors (eager attention, SDPA's math path) are left out when each of them is at
    least ``MMAP_THRESHOLD_MAX``: glibc serves such a request with its own ``mmap`` and unmaps it on
    free (mallopt(3), ``M_MMAP_THRESHOLD``: the dynamic threshold never rises above 32 MiB on
    64-bit), so it leaves no resident hole in the heap -- the rule the logits already follow at the
    loss moment (``_score_tensors_mmapped``)."""
    h, sc, lo, _ = _activations(ms, ts.replace(grad_checkpoint=False))
    if _score_tensors_mmapped(ms, ts):
        sc = 0
    return h + sc + lo


def _score_tensors_mmapped(ms: ModelSpec, ts: TrainSpec) -> bool:
    """True when every score-sized tensor one block saves (batch x heads x s x s: eager attention's
    probabilities and their casts / dropout noise in the compute dtype or fp32, SDPA's CPU math
    path's fp32 probabilities, noise and dropped probabilities -- ``_attention_core``) is at least
    ``MMAP_THRESHOLD_MAX`` bytes, so glibc mmaps each one (no heap slack). The smallest such tensor
    is in the compute dtype for eager attention and fp32 on the math path. False for the fused
    SDPA kernels, whose per-head logsumexp is small."""
    e = DTYPE_BYTES[ts.dtype]
    cpu_math = ms.attention_dropout > 0 and ts.attn_impl == "sdpa"
    if ts.attn_impl != "eager" and not cpu_math:
        return False
    smallest = 4 if (cpu_math or ts.attn_impl != "eager") else min(e, 4)
    return ts.batch_size * ms.num_heads * ts.seq_length ** 2 * smallest >= MMAP_THRESHOLD_MAX


#: Out-sized tensors one LoRA'd linear allocates in its forward beyond the base layer's output,
#: freed before the next module runs. PEFT 0.21 ``tuners/lora/layer.py`` ``Linear.forward``:
#: ``result = result + lora_B(lora_A(dropout(x))) * scaling`` then ``result.to(torch_result_dtype)``
#: -- the ``lora_B`` output, the scaled product and the out-of-place sum are three tensors of
#: (tokens x out_features) in the adapter's dtype (fp32: PEFT keeps fp32 adapters on a bf16 base,
#: and ``bf16 + fp32`` promotes, so the sum is fp32 too), and with a half-precision base the cast
#: back is a fourth, in the base dtype. None is saved for the backward (``mul`` by a Python scalar and
#: ``add`` save nothing: ``derivatives.yaml``), so they are not activations, but on CPU they pass
#: through glibc's heap and leave resident pages behind. All four are distinct chunks (checked with
#: ``data_ptr()``: torch's CPU allocator asks ``posix_memalign`` for 64-byte alignment
#: (``c10/core/impl/alloc_cpu.cpp``), whose padded request an exactly-sized freed chunk cannot
#: serve, so the sum does not land in the freed ``lora_B`` output nor the cast in the freed base
#: output).
LORA_FORWARD_TEMPORARIES = 3
#: Resident slack per byte of those temporaries at the loss moment, for at most
#: ``LORA_TEMP_BLOCKS`` blocks: the temporaries' holes are refilled by the following blocks' equal
#: requests (deeper models' slack grows with depth by the saved activations' factor only). Fitted
#: by an A/B of the bench's HF ``Trainer`` LoRA cases against a forward with no out-sized temporary
#: (the same LoRA math in place: ``result.view(-1, out).addmm_(lora_A(x), lora_B.weight.t(),
#: alpha=scaling)``); docs/estimator.md, "LoRA temporaries".
LORA_TEMP_SLACK = 0.4
LORA_TEMP_BLOCKS = 2


def _lora_forward_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
    """Heap traffic (bytes) of the LoRA temporaries of one forward, HF/Lightning (PEFT) only:
    ``LORA_FORWARD_TEMPORARIES`` tensors of tokens x out_features per LoRA'd linear of each LoRA'd
    block, in the adapter's dtype (fp32,
    PEFT ``autocast_adapter_dtype``; the compute dtype under autocast), plus the cast of the sum back
    to a half-precision base dtype (``result.to(torch_result_dtype)``). Tensors >= the largest mmap
    threshold (32 MiB) are mmapped and leave no heap slack, so they are not counted. The estimate
    charges ``LORA_TEMP_SLACK`` x this at the loss moment.

    Zero under gradient checkpointing, where the slack is ``CPU_HEAP_SLACK_FORWARD`` x the
    un-checkpointed traffic alone, the rule fitted on the small matrix's checkpointed LoRA cases.
    Depth sweeps with glibc's ``mallinfo2`` show that these temporaries do leave holes under
    checkpointing, in every block (all-linear LoRA grows the slack about 3 x faster per block than
    q/v at a similar saved traffic), but a rule counting them did not hold at both 1024 and 2048
    tokens per micro-batch, so none is applied: docs/estimator.md, "Gradient checkpointing on
    CPU"."""
    if ts.method == "full" or ts.framework == "mlx" or ts.grad_checkpoint:
        return 0
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    tokens = ts.batch_size * ts.seq_length
    total = 0
    for ls in _lora_linears(ms, ts):
        sizes = [(2 if amp else 4)] * LORA_FORWARD_TEMPORARIES
        if e < 4 and not amp:
            sizes.append(e)
        for b in sizes:
            t = tokens * ls.out_features * b
            if t < MMAP_THRESHOLD_MAX:
                total += ls.count * t
    return int(total * min(_num_lora_layers(ms, ts), LORA_TEMP_BLOCKS))


def _heap_gradient_bytes(ms: ModelSpec, ts: TrainSpec, grads: int, pb: int) -> int:
    """Bytes of the gradients that glibc serves from its heap: ``grads`` (all ``.grad`` tensors)
    less those of tensors of at least ``MMAP_THRESHOLD_MAX`` bytes, which are mmapped (the input
    embedding, an untied head, a block linear or fused expert tensor that large; ``pb`` bytes per
    element). Only a full fine-tune has large gradients; LoRA's adapters are all small.

    Why it matters under gradient checkpointing (``estimate``'s CPU slack): HF ``Trainer`` frees
    every gradient after the optimizer step (``model.zero_grad()``, ``set_to_none=True`` by default
    in torch 2.x); the next forward (which under checkpointing keeps only the blocks' inputs) runs
    inside those holes, and the next backward requests the same sizes again while the recomputed
    blocks' tensors come and go; a 64-byte-aligned request cannot reuse an exactly-sized freed chunk
    (``c10/core/impl/alloc_cpu.cpp`` asks ``posix_memalign``), so the new gradients take fresh heap
    and the old ones stay resident holes. Checked with glibc's ``mallinfo2`` on HF ``Trainer`` runs
    (docs/estimator.md, "Gradient checkpointing on CPU"): in the 2nd step the forward did not grow
    the arena (it ran in the freed gradients' holes) and the backward grew it by the heap-resident
    gradient bytes."""
    if ts.method != "full":
        return int(grads)
    big = 0
    vh = ms.vocab_size * ms.hidden_size * pb
    if vh >= MMAP_THRESHOLD_MAX:
        big += vh * (1 if ms.tie_word_embeddings else 2)
    for ls in _block_linears(ms):
        one = ls.in_features * ls.out_features * pb
        if getattr(ls, "is_param", False):
            if one * ls.count >= MMAP_THRESHOLD_MAX:
                big += one * ls.count * ms.num_layers
        elif one >= MMAP_THRESHOLD_MAX:
            big += one * ls.count * ms.num_layers
    return int(max(grads - big, 0))


def _embedding_grad_transients(ms: ModelSpec, ts: TrainSpec, pb: int) -> Tuple[int, int]:
    """Dense V x h gradients beyond ``.grad`` of an HF/Lightning full fine-tune, bytes:
    (end of the backward, start of the backward). ``EMBEDDING_GRAD_COPIES[(tied, accumulating)]``
    x V x h x ``pb`` (the trainable parameter's bytes) at the end; at the start, one copy when the
    head is untied and gradients accumulate (its new gradient before ``+=`` into ``.grad``).
    Zero for LoRA (frozen embeddings) and MLX (mlx_lm does not train the embeddings)."""
    if ts.method != "full" or ts.framework == "mlx":
        return 0, 0
    vh = ms.vocab_size * ms.hidden_size * pb
    tied = bool(ms.tie_word_embeddings)
    acc = ts.grad_accum > 1
    return EMBEDDING_GRAD_COPIES[(tied, acc)] * vh, (vh if (acc and not tied) else 0)


def _logits(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int]:
    """Logits and loss working set, (loss-moment peak, final-norm/head saved) in bytes.

    transformers 5.x ``LlamaForCausalLM.forward`` computes ``lm_head`` on every position
    (``logits_to_keep=0``), and ``loss/loss_utils.py`` ``ForCausalLMLoss`` upcasts with
    ``logits.float()`` and pads the labels instead of slicing the logits; ``cross_entropy`` =
    ``log_softmax`` (saves its fp32 output) + ``nll_loss``. With N = batch x seq x vocab:
      forward:  logits (e) + fp32 copy (4, absent when e = 4) + log_softmax output (4);
      backward start: log_softmax output + nll_loss grad + log_softmax grad, all fp32 (3 x 4), the
      logits being freed when ``compute_loss`` drops the model output;
      head backward: grad in e (+ the fp32 grad while casting) -- below the backward-start peak.
    So the loss moment holds max(e + 4 + 4 (or 8 when e = 4), 12) x N bytes.
    mlx_lm (``tuner/trainer.py`` ``default_loss``) computes ``nn.losses.cross_entropy`` on the
    model-dtype logits: logits + logsumexp-based loss + grad: ~3 x e x N.
    """
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    n = ts.batch_size * ts.seq_length * ms.vocab_size
    if ts.framework == "mlx":
        return 3 * e * n, 0
    fwd = (e + 4 + 4) if e < 4 else 8
    if amp:
        fwd = 2 + 4 + 4
    peak = max(fwd, 12) * n
    if ms.final_logit_softcapping:
        peak += (2 if amp else e) * n  # ``tanh(logits / cap) * cap``: the tanh output is saved
    return peak, 0


# ---------------------------------------------------------------------------------------------
# main entry


def _validate(ms, ts, correction) -> None:
    if not isinstance(ms, ModelSpec):
        raise ConfigError("model_spec", "a memguard_core.spec.ModelSpec", type(ms).__name__)
    if not isinstance(ts, TrainSpec):
        raise ConfigError("train_spec", "a memguard_core.spec.TrainSpec", type(ts).__name__)
    if isinstance(correction, bool) or not isinstance(correction, (int, float)) \
            or not (0 < float(correction) < 100) or math.isnan(float(correction)):
        raise ConfigError("correction", "a positive factor (e.g. 1.0)", correction)
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        v = getattr(ms, f)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"model_spec.{f}", "a positive integer", v)
    if ms.params.total <= 0:
        raise ConfigError("model_spec.params", "parameter counts with a positive total", ms.params)
    if ts.method == "full" and _weight_bits(ms, ts) < 16 and ms.weight_bits < ms.dense_bits:
        raise ConfigError("method", "lora or qlora for quantized weights (full fine-tuning cannot "
                          "train 4/8-bit weights)", ts.method)


def estimate(model_spec: ModelSpec, train_spec: TrainSpec, *, correction: float = 1.0) -> MemoryEstimate:
    """Estimate the peak of ``train_spec.device``'s counter for one training process.

    Args:
        model_spec: the architecture (``memguard_core.spec.ModelSpec``).
        train_spec: the training settings (``memguard_core.spec.TrainSpec``).
        correction: multiplicative calibration factor (e.g. from past runs); the difference is
            reported as the ``calibration`` term.

    Returns:
        MemoryEstimate with ``peak_bytes`` and the breakdown of the terms live at the peak moment
        (see the module docstring for the three moments).

    The weights are counted in the dtype ``train_spec`` implies (``train_spec.dtype``, or fp32
    with ``mixed_precision``) unless the spec was read from a live module:
    ``memguard_core.spec.weights_for_training``; ``MemoryEstimate.model_spec`` is that spec.

    Raises:
        ConfigError: a spec of the wrong type, a non-positive shape, a bad correction, full
            fine-tuning of quantized weights, LoRA targets that match nothing; under
            ``model_code="litgpt"`` the settings ``memguard_core._litgpt.check`` refuses.
    """
    _validate(model_spec, train_spec, correction)
    litgpt = train_spec.model_code == "litgpt"  # LitGPT's own model code: memguard_core._litgpt
    if litgpt:
        from . import _litgpt

        _litgpt.check(model_spec, train_spec)
    else:
        train_spec = with_default_lora_targets(model_spec, train_spec)  # PEFT's targets when none given
    notes: List[str] = list(check_train_spec(model_spec, train_spec))
    ts = train_spec
    # images per row: the image tokens of the row over those one image adds (one image at the defaults)
    images = ts.image_tokens / model_spec.image_tokens if ts.image_tokens and model_spec.image_tokens else 0.0
    if ts.image_tokens:  # a vision-language decoder's sequence holds the image tokens too
        ts = ts.replace(seq_length=ts.seq_length + ts.image_tokens, image_tokens=0)
    ms = weights_for_training(model_spec, ts)
    if ms.params.vision and ts.method == "full":
        notes.append("full fine-tune of a vision-language model: the vision tower's weights, gradients "
                     "and optimizer states are counted, its activations are not")
    vision_hits = vision_lora_linears(ms, ts.lora_targets) if ts.method != "full" and not litgpt else []
    vision_act = _vision_activations(ms, ts, images)
    if vision_hits:
        notes.append(f"LoRA reaches the vision tower / projector ({len(vision_hits)} linears): their adapters "
                     + (f"and the tower's saved activations for {images:g} image(s) per row are counted"
                        if vision_act else "are counted; no images in the rows (image_tokens 0): no vision activations"))
    elif (ms.params.vision and ms.vision_tower is None and ts.method != "full"
          and any(t.lower() in ("all-linear", "all_linear") for t in ts.lora_targets)):
        notes.append(f"all-linear LoRA also adapts the vision tower of {ms.model_type!r}, whose numbers memguard "
                     "does not read: its adapters and activations are not counted")
    trainable = _litgpt.trainable_params(ms, ts) if litgpt else trainable_param_count(ms, ts)
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length

    weights = _litgpt.weights(ms, ts, trainable) if litgpt else _weights(ms, ts, trainable)
    copies = _weight_copies(ms, ts)
    # bitsandbytes: the dense weight one quantized linear materialises while it runs (the first
    # backward op, the top block's, starts while the loss moment's tensors are live)
    dequant = 0 if litgpt else _dequant_transient(ms, ts)
    master = _master_weights(ms, ts, trainable)
    pb = 4 if master else _param_bytes_trainable(ms, ts)
    grads = pb * trainable if not master else int(ms.dense_bits // 8) * trainable
    states = _optimizer_states(ms, ts, trainable)
    opt_tmp = _optimizer_temporaries(ms, ts, trainable)
    if litgpt:  # below, from LitGPT's rules
        hidden = scores = lora_act = one_block = logits_peak = 0
    else:
        hidden, scores, lora_act, one_block = _activations(ms, ts)
        logits_peak, _ = _logits(ms, ts)
    if ts.framework == "mlx":  # MLX's lazy graph: see _mlx_activations
        hidden, scores, one_time, logits_peak = _mlx_activations(ms, ts)
        lora_act, one_block = one_time, 0
    # the final norm's saved input and the head's input (saved when the head trains)
    head_in = 4 * ms.hidden_size * tokens if ts.framework != "mlx" else 0
    if ts.method == "full" and ts.framework != "mlx":
        head_in += e * ms.hidden_size * tokens * 2
    if ms.embedding_dropout > 0 and ts.framework != "mlx":
        head_in += _dropout_bytes(ts, e) * ms.hidden_size * tokens  # the embedding dropout's noise
    # eager causal mask (batch x 1 x s x s in the compute dtype), built once per forward
    mask = ts.batch_size * ts.seq_length ** 2 * e if ts.attn_impl == "eager" else 0
    # gradient checkpointing: the recomputed block's working set during the backward
    recompute = one_block if ts.grad_checkpoint else 0
    overhead = runtime_overhead_bytes(ts)

    last_step = _bnb_last_step_inputs(ms, ts)
    head_moment = None
    bwd_copies = copies + dequant
    kept_grad = kept_tmp = 0  # a gradient no optimizer holds (LitGPT's QLoRA StableEmbedding)
    if litgpt:
        # LitGPT's blocks and head (memguard_core._litgpt): the loss moment is the largest of the
        # moments its step peaks at (the first loss chunk's backward; the 4-bit head's backward;
        # the next forward beside a kept graph), each adding its head terms to the blocks
        saves, quant = _litgpt.block_saves(ms, ts), _litgpt.qlora_inputs(ms, ts)
        stable = _litgpt.stable_embedding_terms(ms, ts)
        kept_grad, kept_tmp = stable["gradient"], stable["transient"]
        n = ms.num_layers  # LitGPT adapts every block (_litgpt.check refuses lora_layers)
        per = (n - 1) * (saves.block + quant.block) + saves.first + quant.first
        scores = int(tokens * n * saves.lse)
        hidden = int(tokens * (per + stable["per_token"])) - scores
        lora_act, one_block = 0, int(tokens * (saves.block + quant.block))
        heads = _litgpt.head_moments(ms, ts)
        head_moment = max(heads, key=lambda k: sum(heads[k].values()))
        h = heads[head_moment]
        logits_peak, head_in, copies, last_step = h["logits"], h["activations"], h["weight_copies"], 0
        # the head's dense weight exists only while the head runs; the backward ends in the bottom
        # block, whose 4-bit linears are dequantized one at a time
        bwd_copies = _litgpt.block_dequant(ms, ts)

    # moment 1: loss (grads resident only while accumulating)
    grads_at_loss = (grads if ts.grad_accum > 1 else 0) + kept_grad
    # mlx_lm full fine-tune: the update's arrays are not live at the loss (with synchronous
    # evaluation the loss-moment live set of AdamW and SGD steps is the same); the step's update
    # window is the optimizer moment below (``_mlx_full_optimizer_moment``). SGD's extra copy of
    # the trainable parameters is MLX SGD's ``v`` buffer, counted as a state.
    loss = dict(weights=weights, weight_copies=copies + dequant, gradients=grads_at_loss,
                optimizer_states=states, master_weights=master, optimizer_temporaries=0,
                backward_transients=0, activations=hidden + lora_act + head_in + recompute + last_step + vision_act,
                attention_scores=scores + mask, logits=logits_peak, runtime_overhead=overhead)
    # moment 2: end of backward: all grads + embedding-grad transient (dense V x h beyond .grad,
    # EMBEDDING_GRAD_COPIES by tied head / accumulation) + the first block's working set.
    emb_tmp, head_tmp = _embedding_grad_transients(ms, ts, pb)
    loss["backward_transients"] = head_tmp
    bwd = dict(weights=weights, weight_copies=bwd_copies, gradients=grads + kept_grad,
               backward_transients=emb_tmp + kept_tmp,
               optimizer_states=states, master_weights=master, optimizer_temporaries=0,
               # the vision tower's backward runs after the decoder's: its saved tensors are still live
               activations=(min(one_block, hidden + lora_act + recompute) if _grad_layers(ms, ts) else 0) + vision_act,
               attention_scores=0, logits=0, runtime_overhead=overhead)
    # moment 3: optimizer step
    opt = dict(weights=weights, weight_copies=0, gradients=grads + kept_grad, optimizer_states=states,
               master_weights=master, optimizer_temporaries=opt_tmp, backward_transients=0,
               activations=0,
               attention_scores=0, logits=0, runtime_overhead=overhead)
    if ts.framework == "mlx" and ts.method == "full":
        # the update is part of the backward's graph: gradients and new arrays of the last blocks
        # in flight together while the backward still runs below them -- see MLX_UPDATE_ARRAYS
        g_fly, new_fly, acts, sc = _mlx_full_optimizer_moment(ms, ts, trainable)
        opt.update(gradients=g_fly, optimizer_temporaries=new_fly, activations=acts,
                   attention_scores=sc)
    phases = {"loss": loss, "backward": bwd, "optimizer": opt}
    totals = {k: sum(v.values()) for k, v in phases.items()}
    traffic = _activation_traffic(ms, ts)
    logits_tensor = ts.batch_size * ts.seq_length * ms.vocab_size * 4
    lora_traffic = _lora_forward_traffic(ms, ts)
    kind = "full" if ts.method == "full" else "lora"
    for k, v in phases.items():
        if ts.device in ("cuda", "mps"):
            frag = CUDA_FRAGMENTATION if ts.device == "cuda" else MPS_FRAGMENTATION
            slack = int(frag * (totals[k] - overhead))
        elif ts.device == "cpu":
            small_logits = logits_peak if logits_tensor < MMAP_THRESHOLD_MAX else 0
            if ts.grad_checkpoint:
                # the blocks' activations never coexist (one block is recomputed at a time): the
                # arena is what the forward left, or the holes of the last step's gradients when
                # those are larger -- the next forward runs inside them and the new gradients
                # take fresh heap (``_heap_gradient_bytes``); the same at every moment. A run that
                # trims the heap at every step's end (``ts.heap_trim``, memguard's guard) handed
                # those pages back after ``zero_grad`` freed the gradients: no such holes remain
                held = 0 if ts.heap_trim else _heap_gradient_bytes(ms, ts, grads, pb)
                if kind == "full" and k == "loss" and ts.heap_trim:
                    one = traffic / max(1, _grad_layers(ms, ts))
                    slack = int(CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS * one
                                + CPU_HEAP_SLACK_CHECKPOINTED[kind] * small_logits)
                else:
                    slack = max(int(CPU_HEAP_SLACK_CHECKPOINTED[kind] * (traffic + small_logits)), held)
            elif k == "loss":
                slack = int(CPU_HEAP_SLACK_FORWARD[kind] * (traffic + small_logits) + LORA_TEMP_SLACK * lora_traffic)
            else:
                slack = int(CPU_HEAP_SLACK_BACKWARD[kind] * traffic)
        else:
            slack = 0
        v["allocator_slack"] = slack
        totals[k] += slack
    from .sharding import apply_sharding  # per-rank terms of DDP / FSDP / ZeRO (no-op for "none")

    apply_sharding(ms, ts, phases, totals, notes)
    phase = max(totals, key=lambda k: totals[k])
    chosen = phases[phase]
    peak_raw = totals[phase]
    peak = int(math.ceil(peak_raw * float(correction)))
    breakdown = {k: int(chosen.get(k, 0)) for k in BREAKDOWN_ORDER if k != "calibration"}
    breakdown["calibration"] = peak - peak_raw
    if ts.grad_checkpoint:
        notes.append("gradient checkpointing: one block input per layer + one recomputed block")
    if ts.method == "qlora" and ms.weight_bits >= 8:
        notes.append(f"QLoRA: block linears stored as NF4 ({NF4_BITS} bits)")
    if dequant:
        if _weight_bits(ms, ts) >= 8 or bnb_4bit_keeps_input(ts):
            notes.append("bitsandbytes: each quantized linear keeps its input for the backward "
                         "(MatMul4Bit/MatMul8bitLt ctx.tensors) and dequantizes one weight at a time")
        else:
            notes.append("bitsandbytes >= 0.43.2: 4-bit linears keep no input; one weight dequantized at a time")
    if last_step:
        notes.append("bitsandbytes: the loop keeps the last step's output, and with it the quantized "
                     "linears' inputs of that step (ctx attributes) into the next forward")
    if ts.paged and ts.device == "cuda":
        notes.append("paged optimizer: states of tensors from 1e5 elements on in CUDA unified memory "
                     "(outside max_memory_allocated / max_memory_reserved)")
    if ts.device == "cuda":
        notes.append(f"cuda: SDPA kernel {cuda_sdpa_backend(ms, ts)}")
    if kept_grad:
        notes.append("LitGPT >= 0.5 QLoRA: the StableEmbedding it swaps in trains outside the optimizer -- its "
                     "dense gradient stays from the first backward on")
    if litgpt:
        notes.append("LitGPT's model code: fused qkv LoRA on " + ", ".join(sorted(_litgpt.lora_parts(ts)))
                     + f", adapters in {ts.dtype}, head in chunks of {_litgpt.LM_HEAD_CHUNK}; the loss moment is "
                     + {"loss": "the first loss chunk's backward", "head_backward": "the 4-bit head's backward",
                        "forward_end": "the end of the forward (Fabric's fp32 copy of the logits)",
                        "next_forward": "the next forward beside the kept graph"}[head_moment])
    return MemoryEstimate(peak_bytes=peak, breakdown=breakdown, counter=ts.device,
                          model_spec=ms, train_spec=train_spec, trainable_params=trainable, phase=phase,
                          phases=totals,
                          phase_breakdowns={k: {t: int(v.get(t, 0)) for t in BREAKDOWN_ORDER
                                                if t != "calibration"} for k, v in phases.items()},
                          correction=float(correction), notes=tuple(notes))


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
