"""Per-rank memory of data-parallel training: DDP, FSDP (``fully_shard`` / FSDP1) and DeepSpeed ZeRO.

``estimate()`` first builds the three moments of ONE process holding the whole model (``loss``,
``backward``, ``optimizer``; see ``memguard_core/estimator/estimate.py``), then :func:`apply_sharding`
rewrites each moment's terms for one rank of ``TrainSpec.sharding``. Everything here is in bytes.
Activations, attention scores, logits and the runtime overhead are per rank already (each rank runs
its own micro-batch), so sharding never touches them; the CPU heap slack is recomputed by
``estimate()`` from the rewritten moments.

Rules (N = the shard group: ``world_size``, or ``shard_group_size`` under ``fsdp-hybrid``, 1 under
``fsdp-no-shard``):

``ddp``  (``torch/nn/parallel/distributed.py``, ``torch/csrc/distributed/c10d/reducer.cpp``)
    Nothing is divided. The Reducer allocates, at construction, one flat gradient bucket per
    ``bucket_cap_mb`` (25 MiB; the first 1 MiB, ``dist._DEFAULT_FIRST_BUCKET_BYTES``) covering
    every trainable parameter: a second copy of the gradients that lives for the whole run
    (``initialize_buckets``), so it is counted at every moment. ``.grad`` is a separate tensor into
    which the autograd hook copies (``copy_grad_to_bucket`` and back after the all-reduce) unless
    ``gradient_as_bucket_view=True``, where ``.grad`` are views of the buckets and the gradients
    are counted once. gloo all-reduces one bucket at a time: one bucket of scratch
    (``min(bucket_cap_mb, gradients)``) at the end of the backward.
``fsdp-*`` (FSDP2 ``torch/distributed/fsdp/_fully_shard/``; one unit per decoder block + the root)
    Weights, gradients, optimizer states, master weights and the optimizer's temporaries are
    divided by N (``_fsdp_param.py`` ``_init_sharded_param``: dim-0 shards, padding ignored: at most
    N-1 rows per parameter). Added, in ``param_dtype`` (``MixedPrecisionPolicy``: the compute dtype
    with ``mixed_precision``, else the stored one) under ``weight_copies``:
    * the root module's parameters (embeddings, final norm, untied head): the root is never
      resharded after forward (``_fsdp_state.py`` ``_lazy_init``: "For the root, do not reshard
      after forward"), so they are unsharded from its forward to the end of the backward;
    * with ``reshard_after_forward=False`` (``fsdp-grad-op``, FSDP1 ``SHARD_GRAD_OP``) every block
      stays unsharded from its forward to its backward: all of them at the ``loss`` moment and at
      the start of the backward (nothing is all-gathered in the backward then);
    * in the backward, the unit being processed and the next one, prefetched
      (``_fsdp_param_group.py`` ``_backward_prefetch``; FSDP1 ``BackwardPrefetch.BACKWARD_PRE``);
    * the root's unsharded gradients until its reduce-scatter at the end of the backward
      (``_fsdp_collectives.py`` ``foreach_reduce``: the unsharded gradients are copied into a
      ``reduce_scatter_input`` of the unit's size in ``reduce_dtype``); the copy and the embedding's
      own gradient transients (``EMBEDDING_GRAD_COPIES``) do not coexist, the larger counts.
    FSDP1 (``fsdp_version=1``) all-gathers into the flat parameter directly (no copy-out); the
    model is otherwise the same.
    cpu without a step-end heap trim (``TrainSpec.heap_trim=False``): every moment carries the
    largest moment's heap slack (:func:`_untrimmed_holes_persist`; FSDP and ZeRO-3).
    Offload (``CPUOffloadPolicy`` / FSDP1 ``CPUOffload(offload_params=True)``): the sharded
    parameters, gradients and optimizer states live in host memory. On the ``cpu`` counter they
    are still resident in the same process, so nothing changes; on ``cuda`` they leave the
    device.
    The model is assumed to be materialised sharded (meta-device init + ``to_empty``, or FSDP1
    ``sync_module_states`` from rank 0): a rank that first builds the whole model peaks at least
    at the full weights + their shards during ``fully_shard``, which this model does not add.
``zero1`` / ``zero2`` / ``zero3`` (DeepSpeed ``deepspeed/runtime/zero/stage_1_and_2.py`` and
    ``stage3.py``, 0.19.8) -- the model states follow DeepSpeed's own estimators
    (:func:`deepspeed_zero2_model_states`, :func:`deepspeed_zero3_model_states`): ZeRO-2 per rank
    ``2P + 18P/N`` = 16-bit weights (whole) + (16-bit gradient partition 2 + fp32 gradients 4 +
    fp32 master 4 + Adam moments 8) x P/N; ZeRO-3 ``4 x largest layer + 18P/N`` (the gathered
    largest module's 16-bit parameters and gradients + the partitions); ZeRO-1 has no DeepSpeed
    estimator: the same accounting with the 16-bit gradients whole (stage 1 all-reduces them):
    ``4P + 16P/N``. Plus the buckets (elements x bytes): the reduction buffer(s)
    (``reduce_bucket_size``; two with ``overlap_comm``: ``stage_1_and_2.py`` ``buf_0`` / ``buf_1``;
    one in stage 3, ``stage3.py`` "IPG"), and under ZeRO-3 the prefetch bucket
    (``stage3_prefetch_bucket_size``) of gathered parameters, capped by
    ``stage3_max_live_parameters``. Bucket sizes by framework (:data:`ZERO_BUCKETS`): HF ``Trainer``
    fills its "auto" values from the model (transformers ``integrations/deepspeed.py``
    ``trainer_config_process``: ``reduce_bucket_size = hidden_size**2``,
    ``stage3_prefetch_bucket_size = 0.9 * hidden_size**2``,
    ``stage3_param_persistence_threshold = 10 * hidden_size``); Lightning's ``DeepSpeedStrategy``
    defaults to 2e8 for the all-gather and reduce buckets; DeepSpeed's own defaults
    (``runtime/zero/config.py``) are 5e8, prefetch 5e7, max live 1e9, persistence 1e5, and
    ``overlap_comm`` is on for stage 3 only. Offload (``offload_optimizer`` / ``offload_param``):
    host memory on ``cuda``, in the same process on ``cpu``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from .cuda import CUDA_FRAGMENTATION
from .trainable import trainable_param_count
from .specs import DTYPE_BYTES

MiB = 1 << 20

#: cpu: a rank's fixed cost beyond ``RUNTIME_OVERHEAD_BYTES["cpu"]`` (bytes): ``torch.distributed``
#: with a gloo process group (its threads and pair buffers) and the DDP / FSDP / DTensor modules.
#: Calibrated on a negligible model (the ``tiny`` case of ``bench/distributed.py``, 2 blocks,
#: hidden 64, vocab 256), where nothing else is left to explain; not fitted on the scored rows
#: (figures: docs/distributed.md, "cpu fixed cost and heap slack"). With the heap trimmed at every
#: step's end, as the guard runs a loop, the tiny ranks peak 9-13 MiB *below* the single-process
#: estimate of the same loop (the runtime figure's own error is larger than this cost), so the
#: calibration gives 0; kept as a named term for the rule's sake.
DIST_CPU_RUNTIME_BYTES = 0

#: cpu, DeepSpeed: a rank's fixed cost beyond ``DIST_CPU_RUNTIME_BYTES`` (bytes): ``import deepspeed``
#: (its accelerator, ops and config machinery) and the shared-memory comm op its CPU accelerator
#: builds and loads. Calibrated, like the constant above, on the ``tiny`` case (DeepSpeed 0.19.8,
#: ``DS_ACCELERATOR=cpu``); not fitted on the scored rows (docs/distributed.md, "cpu fixed cost and
#: heap slack").
DEEPSPEED_CPU_RUNTIME_BYTES = 60 * MiB

#: cpu, FSDP: glibc heap slack beyond the single-process rule, as a multiple of the unsharded
#: block bytes one step passes through the heap (``_unit_heap_traffic``: every block's all-gather
#: output and its unsharded gradients), at the end of the backward and the optimizer step.
#: Why: FSDP2 pushes every block's all-gather output, unsharded parameters, unsharded gradients and
#: reduce-scatter input (each a block's size, below glibc's 32 MiB mmap threshold, so from the
#: heap) through the heap between the activations the backward frees, and keeps only the 1/N
#: gradient shard, so the holes they leave are not refilled by gradients as in one process, and
#: the heap does not shrink with N while the sharded state inside it does. The live set alone is
#: the module's rule above (checked with ``MALLOC_MMAP_THRESHOLD_=131072``, which removes the
#: slack). FITTED on the 30M-parameter rows of ``bench/distributed.py`` (2 and 4 ranks, the heap
#: trimmed at every step's end as the guard does) and scored on the 135M rows only: 1.15 = the
#: median over the 30M full-shard, grad-op and CPU-offload rows (1.125, to the 0.05 above); no-shard
#: (one-rank shards: the gradients are whole again and refill part of the holes) 0.6, the median
#: of its 30M rows. The driver was the activation traffic until 2026-11-26; the block bytes were
#: chosen after the trimmed 135M 4-rank rows showed the activation-based factor fitted at 30M 6-12 %
#: under there (the factor itself is fitted on 30M rows only). Hybrid takes the sharded value and
#: FSDP1 the same rule, neither fitted on rows of its own. ZeRO-3 gathers and releases every
#: module's parameters and reduce-scatters its gradients through the heap the same way, so it takes
#: the sharded FSDP value: a transfer by mechanism, not a fit on ZeRO rows. Fit and scores:
#: docs/distributed.md, "cpu fixed cost and heap slack" and "Measured". Single ranks still differ
#: from each other (their heaps' extent differs between ranks that make the same requests:
#: docs/distributed.md, "Per-rank spread").
FSDP_CPU_HEAP_SLACK = {"fsdp-full": 1.15, "fsdp-grad-op": 1.15, "fsdp-hybrid": 1.15, "fsdp-no-shard": 0.6,
                       "zero3": 1.15}

#: DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), bytes.
DDP_FIRST_BUCKET_BYTES = 1 * MiB

#: DeepSpeed bucket settings per framework (elements): reduce, all-gather, stage-3 prefetch,
#: stage-3 max live parameters, stage-3 persistence threshold, overlap_comm for stages 1/2.
#: ``hf``: transformers' "auto" values (functions of hidden_size, see the module docstring);
#: ``lightning``: ``lightning/pytorch/strategies/deepspeed.py`` ``DeepSpeedStrategy.__init__``
#: (``allgather_bucket_size=200_000_000``, ``reduce_bucket_size=200_000_000``,
#: ``overlap_comm=True``); ``torch`` (a plain ``deepspeed.initialize``): DeepSpeed's defaults,
#: ``deepspeed/runtime/zero/config.py``.
ZERO_BUCKETS = {
    "deepspeed": dict(reduce=int(5e8), allgather=int(5e8), prefetch=int(5e7), max_live=int(1e9),
                      persistence=int(1e5), overlap_comm=False),
    "lightning": dict(reduce=int(2e8), allgather=int(2e8), prefetch=int(5e7), max_live=int(1e9),
                      persistence=int(1e5), overlap_comm=True),
}


def zero_buckets(hidden_size: int, framework: str, overrides: Optional[Dict[str, int]] = None) -> Dict[str, int]:
    """DeepSpeed's bucket sizes (elements) as ``framework`` sets them: HF "auto" values for ``hf``
    (transformers ``integrations/deepspeed.py``: ``reduce_bucket_size = h*h``,
    ``stage3_prefetch_bucket_size = int(0.9*h*h)``, ``stage3_param_persistence_threshold = 10*h``;
    the rest DeepSpeed's defaults), Lightning's ``DeepSpeedStrategy`` defaults, else DeepSpeed's;
    then the values a config sets explicitly (``overrides``: ``TrainSpec.zero_buckets``)."""
    if framework == "hf":
        b = dict(ZERO_BUCKETS["deepspeed"])
        b.update(reduce=hidden_size * hidden_size, prefetch=int(0.9 * hidden_size * hidden_size),
                 persistence=10 * hidden_size)
    else:
        b = dict(ZERO_BUCKETS["lightning" if framework == "lightning" else "deepspeed"])
    b.update(overrides or {})
    return b


# ---------------------------------------------------------------------------------------------
# DeepSpeed's own estimators, transcribed (deepspeed 0.19.8)


def deepspeed_zero2_model_states(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                 cpu_offload: bool = True,
                                 additional_buffer_factor: float = 1.5) -> Tuple[int, int]:
    """(cpu_mem, gpu_mem) bytes, as ``estimate_zero2_model_states_mem_needs`` in
    ``deepspeed/runtime/zero/stage_1_and_2.py`` (0.19.8) computes them: ``gpu_mem`` is per GPU,
    ``cpu_mem`` per node. Without offload ``gpu = 2P + int(18P / gpus)`` ("2 = params_16bit, 18 =
    2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit"),
    ``cpu = 4P x gpus_per_node x factor``; with offload ``gpu = 2P``,
    ``cpu = P x max(4 x gpus, 16) x factor``."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def deepspeed_zero3_model_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                                 num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                                 zero_init: bool = True,
                                 additional_buffer_factor: float = 1.5) -> Tuple[int, int, int]:
    """(cpu_mem, gpu_mem, largest_layer_memory) bytes, as ``estimate_zero3_model_states_mem_needs``
    in ``deepspeed/runtime/zero/stage3.py`` (0.19.8): ``largest_layer_memory = 4 x largest layer``
    (its gathered 16-bit parameters and gradients); without offload
    ``gpu = largest + int(18P / gpus)``; optimizer offload ``gpu = largest + int(2P / gpus)``;
    parameter offload too ``gpu = largest``. ``cpu_mem`` (per node) as DeepSpeed writes it."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        per_param = 18 if cpu_offload_params else 16  # fp32 states + master (+ 16-bit params)
        gpu_mem = largest_layer_memory + (0 if cpu_offload_params else int(2 * total_params / total_gpus))
        factor = per_param * gpus_factor if zero_init else max(4 * num_gpus_per_node, per_param * gpus_factor)
        cpu_mem = total_params * factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), int(largest_layer_memory)


def zero1_model_states(total_params: int, world_size: int) -> int:
    """Per-rank ZeRO-1 model states, bytes, in DeepSpeed's accounting (16-bit parameters, Adam):
    ``4P + 16P/N`` -- DeepSpeed ships no stage-1 estimator; stage 1 keeps the 16-bit parameters and
    gradients whole (``stage_1_and_2.py``, ``partition_gradients`` off) and partitions the fp32
    gradients, master weights and moments (4 + 4 + 8) like stage 2."""
    return 4 * total_params + int(16 * total_params / world_size)


# ---------------------------------------------------------------------------------------------
# validation


def shard_group(ts) -> int:
    """Ranks a shard spans: ``world_size``, ``shard_group_size`` under ``fsdp-hybrid``, 1 under
    ``fsdp-no-shard`` / ``ddp`` / ``none``."""
    s = ts.sharding
    if s in ("none", "ddp", "fsdp-no-shard"):
        return 1
    if s == "fsdp-hybrid":
        return int(ts.shard_group_size or ts.world_size)
    return int(ts.world_size)


# ---------------------------------------------------------------------------------------------
# per-rank moments


def _root_and_block_params(ms) -> Tuple[int, int]:
    """(root, one block) parameter counts (elements): the root FSDP unit holds what is outside the
    decoder blocks (embeddings, final norm, untied head, other, vision); a block unit holds
    ``params.blocks / num_layers``."""
    p = ms.params
    block = p.blocks // max(1, ms.num_layers)
    return p.total - p.blocks, block


def _largest_module_params(ms) -> int:
    """Parameters of the largest module counting only its own parameters (DeepSpeed's
    ``model_to_params`` in stage3.py: ``sum(p.numel() for p in m.parameters(recurse=False))``):
    the embedding (``vocab x hidden``) or the largest linear."""
    lin = max((ls.in_features * ls.out_features + (ls.out_features if ls.bias else 0)
               for ls in ms.block_linears), default=0)
    return max(ms.vocab_size * ms.hidden_size, lin, ms.params.lm_head)


def apply_sharding(ms, ts, phases: Dict[str, Dict[str, int]], totals: Dict[str, int], notes: List[str]) -> None:
    """Rewrite the moments of one whole-model process (``phases``: moment -> term -> bytes, and
    their ``totals``, as ``estimate()`` built them, allocator slack included) into those of one
    rank of ``ts.sharding``, in place; append a note.

    ``ms`` is the spec ``estimate()`` counted (weights in their training dtype). The allocator
    slack is recomputed: on ``cuda`` the same fraction (``CUDA_FRAGMENTATION``) of the rewritten
    moment; on ``cpu`` the single-process heap slack plus, under FSDP, :data:`FSDP_CPU_HEAP_SLACK`.
    Does nothing for ``sharding="none"``, so a ``none`` estimate equals the single-process one
    exactly."""
    s = ts.sharding
    if s == "none":
        return
    slack = {k: v.get("allocator_slack", 0) for k, v in phases.items()}
    traffic = _unit_heap_traffic(ms, ts, phases) if ts.device == "cpu" and s in FSDP_CPU_HEAP_SLACK else 0
    if s == "ddp":
        _ddp(ts, phases, notes)
    elif s.startswith("fsdp"):
        _fsdp(ms, ts, phases, notes)
    else:
        _zero(ms, ts, phases, notes)
    fsdp_slack = FSDP_CPU_HEAP_SLACK.get(s, 0.0)
    for k, v in phases.items():
        if ts.device == "cpu":
            v["runtime_overhead"] += DIST_CPU_RUNTIME_BYTES + (DEEPSPEED_CPU_RUNTIME_BYTES if s.startswith("zero") else 0)
            extra = int(fsdp_slack * traffic) if k != "loss" else 0
            v["allocator_slack"] = slack[k] + extra
        elif ts.device == "cuda":
            v["allocator_slack"] = 0
            v["allocator_slack"] = int(CUDA_FRAGMENTATION * (sum(v.values()) - v["runtime_overhead"]))
    if ts.device == "cpu" and not ts.heap_trim and fsdp_slack:
        _untrimmed_holes_persist(phases)
    for k, v in phases.items():
        totals[k] = sum(v.values())


def _unit_bytes(ms, ts, phases) -> Tuple[float, int, int, int, int]:
    """Per-unit bytes of an FSDP (or ZeRO-3) run, read from the whole-model ``phases`` before they
    are sharded: ``(pd, root_w, block_w, root_g, block_g)`` -- bytes per parameter as gathered (the
    compute dtype under mixed precision, FSDP's ``MixedPrecisionPolicy(param_dtype=...)``, else the
    stored dtype, LoRA adapters included), the root unit's and one block unit's unsharded weights,
    and their unsharded gradients (a full fine-tune's in proportion to the parameters; LoRA trains
    blocks only, so the root has none)."""
    total = max(1, ms.params.total)
    root_p, block_p = _root_and_block_params(ms)
    g_full = phases["optimizer"]["gradients"]
    stored = phases["optimizer"]["weights"] / total
    pd = DTYPE_BYTES[ts.dtype] if ts.mixed_precision else stored
    root_g = int(g_full * root_p / total) if ts.method == "full" else 0
    block_g = int((g_full - root_g) / max(1, ms.num_layers))
    return pd, int(root_p * pd), int(block_p * pd), root_g, block_g


def _unit_heap_traffic(ms, ts, phases) -> int:
    """Bytes of unsharded block parameters and gradients one step passes through the heap under
    FSDP (and ZeRO-3, which gathers and reduce-scatters module by module the same way): every
    block's all-gather output (its parameters in FSDP's ``param_dtype``) and its unsharded gradients
    (the reduce-scatter input), each a block's size and so, below glibc's 32 MiB mmap ceiling, from
    the heap, between the activations the step saves and frees. Read from the whole-model
    ``phases`` before they are sharded. Drives :data:`FSDP_CPU_HEAP_SLACK`."""
    pd, _, _, root_g, _ = _unit_bytes(ms, ts, phases)
    _, block_p = _root_and_block_params(ms)
    return int(ms.num_layers * block_p * pd + (phases["optimizer"]["gradients"] - root_g))


def _ddp(ts, phases, notes) -> None:
    grads = phases["optimizer"]["gradients"]
    cap = int(ts.bucket_cap_mb * MiB)
    for k, v in phases.items():
        # the Reducer's buckets: allocated at construction, alive at every moment
        if ts.gradient_as_bucket_view and k != "loss":
            extra = 0  # .grad are the buckets: already counted as gradients
        else:
            extra = grads
        v["gradients"] = v["gradients"] + extra
    phases["backward"]["backward_transients"] += min(cap, grads)  # one bucket in flight in gloo
    notes.append(f"per rank of {ts.world_size}: ddp: gradient buckets ({ts.bucket_cap_mb:g} MiB each) hold a copy of the gradients"
                 + (" (.grad are views of them)" if ts.gradient_as_bucket_view else ""))


def _div(x: int, n: int) -> int:
    return int(math.ceil(x / n))


def _fsdp(ms, ts, phases, notes) -> None:
    n = shard_group(ts)
    g_full = phases["optimizer"]["gradients"]
    # the all-gathered copies (FSDP's param_dtype) replace autocast's copies of the weights
    _, root_w, block_w, root_g, block_g = _unit_bytes(ms, ts, phases)
    grad_op = ts.sharding == "fsdp-grad-op"
    copyout = block_w if ts.fsdp_version == 2 else 0  # FSDP2 all-gather output before copy-out
    for k, v in phases.items():
        autocast = 0 if ts.mixed_precision else v["weight_copies"]  # dequant transients stay
        for t in ("weights", "optimizer_states", "master_weights", "optimizer_temporaries"):
            v[t] = _div(v[t], n)
        if k == "loss":
            v["gradients"] = _div(v["gradients"], n)
            unsharded = root_w + (ms.num_layers * block_w if grad_op else 0)
            v["weight_copies"] = autocast + unsharded
        elif k == "backward":
            # sharded gradients of the blocks + the root's unsharded ones (reduce-scattered last);
            # the unit being run + the prefetched one (+ FSDP2's all-gather output) + the block's
            # unsharded gradients and their reduce-scatter input
            v["gradients"] = _div(g_full - root_g, n) + root_g
            # full shard: the unit being run + the prefetched one; grad-op: every block is still
            # unsharded from its forward when the backward starts (each is resharded after its
            # own backward, _fsdp_param_group.py post_backward), so the first moment holds them all
            gathered = ms.num_layers * block_w if grad_op else 2 * block_w + copyout
            v["weight_copies"] = autocast + root_w + gathered
            v["backward_transients"] = max(v["backward_transients"], root_g, 2 * block_g)
        else:
            v["gradients"] = _div(v["gradients"], n)
            v["weight_copies"] = 0
    if ts.offload == "params" and ts.device != "cpu":
        for k, v in phases.items():  # sharded states live in host memory
            for t in ("weights", "optimizer_states", "master_weights", "optimizer_temporaries"):
                v[t] = 0
            v["gradients"] -= _div(g_full - root_g, n) if k == "backward" else v["gradients"]
    what = {"fsdp-full": "full shard", "fsdp-grad-op": "shard grad-op (reshard_after_forward=False)",
            "fsdp-hybrid": f"hybrid shard (shard group {n})", "fsdp-no-shard": "no shard"}[ts.sharding]
    notes.append(f"per rank of {ts.world_size}: fsdp{ts.fsdp_version}: {what}: weights, gradients and optimizer states / {n}; the root "
                 "module's parameters stay unsharded through forward and backward"
                 + ("; offloaded state is host memory of the same process on cpu" if ts.offload != "none" else ""))


def _zero(ms, ts, phases, notes) -> None:
    n = max(1, ts.world_size)
    stage = int(ts.sharding[-1])
    total = max(1, ms.params.total)
    w_full = phases["optimizer"]["weights"]
    g_full = phases["optimizer"]["gradients"]
    trainable = _trainable(ms, ts) if g_full else 0
    stored = w_full / total
    grad_b = g_full / trainable if trainable else stored
    # DeepSpeed keeps fp32 copies of the partition it owns: master weights, gradients, moments
    states32 = _fp32_states_per_param(ts) * trainable
    master32 = 4 * trainable
    grads32 = 4 * trainable
    b = zero_buckets(ms.hidden_size, ts.framework, ts.zero_buckets)
    overlap = b["overlap_comm"] or stage == 3
    # on the cpu counter only the pages DeepSpeed writes are resident (torch.empty maps them lazily),
    # and it writes at most the gradients it holds; a device allocator reserves the whole bucket
    elems = b["reduce"] if ts.device != "cpu" else min(b["reduce"], trainable)
    reduce_buf = elems * (4 if stage == 1 else grad_b) * (2 if overlap and stage < 3 else 1)
    if stage == 3:
        largest = _largest_module_params(ms)
        live = min(b["max_live"], ms.params.total, largest + b["prefetch"])
        gathered_w = int(live * stored)
        largest_g = int(largest * grad_b) if trainable else 0
    for k, v in phases.items():
        if stage == 3:
            v["weights"] = _div(w_full, n)
            v["weight_copies"] = 0 if k == "optimizer" else gathered_w
        if stage == 1:
            g = g_full if (k != "loss" or ts.grad_accum > 1) else 0
        else:
            g = _div(g_full, n) if (k != "loss" or ts.grad_accum > 1) else 0
        if stage == 3:
            g = 0  # the partitioned gradients are kept in the fp32 accumulation buffer below
        v["gradients"] = g + (_div(grads32, n) if trainable else 0)
        v["optimizer_states"] = _div(states32, n)
        v["master_weights"] = _div(master32, n)
        v["optimizer_temporaries"] = _div(v["optimizer_temporaries"], n)
        v["backward_transients"] = v["backward_transients"] + (int(reduce_buf) if k != "optimizer" else 0)
        if stage == 3 and k != "optimizer":
            v["backward_transients"] += largest_g
    if ts.offload != "none" and ts.device != "cpu":
        for v in phases.values():  # DeepSpeed's offload: fp32 partitions (and ZeRO-3 params) on the host
            v["optimizer_states"] = v["master_weights"] = v["optimizer_temporaries"] = 0
            v["gradients"] -= _div(grads32, n) if trainable else 0
            if ts.offload == "params":
                v["weights"] = 0
    notes.append(f"per rank of {n}: zero{stage}: DeepSpeed's model-state accounting (fp32 master, gradients and moments of the "
                 f"rank's 1/{n} partition); buckets: reduce {b['reduce']:,} elements"
                 + (f", prefetch {b['prefetch']:,}" if stage == 3 else "")
                 + ("; offloaded state is host memory of the same process on cpu" if ts.offload != "none" else ""))


def _trainable(ms, ts) -> int:
    return trainable_param_count(ms, ts)


def _fp32_states_per_param(ts) -> int:
    """fp32 optimizer state bytes per trainable parameter under ZeRO (the optimizer runs on the fp32
    partition): Adam/AdamW 8 (two moments), SGD with momentum 4, plain SGD 0; others (Adafactor,
    8-bit Adam) as Adam, an upper bound."""
    return {"sgd": 0, "sgd-momentum": 4}.get(ts.optimizer, 8)


def _untrimmed_holes_persist(phases) -> None:
    """cpu, FSDP / ZeRO-3, a run that does NOT return glibc's free heap at the step's end
    (``TrainSpec.heap_trim=False``: a plain loop without memguard's guard): every moment's heap slack
    becomes the largest of the moments' (bytes), in place.

    Why (glibc ``malloc/malloc.c``): ``free()`` gives pages back only from the top of the main heap
    (``systrim``, once the top chunk exceeds ``M_TRIM_THRESHOLD``) and never from a hole below it;
    only ``malloc_trim`` (``mtrim``: ``MADV_DONTNEED`` on every free page) returns the holes. So
    without a trim the holes the backward left (this module's end-of-backward slack: the
    single-process activation holes plus :data:`FSDP_CPU_HEAP_SLACK`'s unit-sized ones) stay resident
    through the optimizer step and the next forward, and the loss moment's live set (every block's
    saved activations, the logits and their loss temporaries) comes on top of them. It is not placed
    inside them: measured per rank (135M, 2 ranks x 2 x 256 tokens, untrimmed, ``mallinfo2`` at every
    FSDP unit's backward hooks) the 2nd step's forward raised the main arena by 390-550 MiB while
    1.8-2.1 GiB of it was free (the 3rd step's by 0-240 MiB), as FSDP2's unit-sized buffers (all-gather outputs, unsharded gradients, reduce-scatter
    inputs: ``_fsdp_collectives.py`` ``foreach_all_gather`` / ``foreach_reduce``) and the 1/N
    gradient shards freed by ``zero_grad(set_to_none=True)`` leave holes between the long-lived
    shards and AdamW moments that the forward's requests do not fit. In a trimmed run those pages
    were handed back and the forward touches only what it uses, so the slack stays per moment (the
    trimmed rows the factors were fitted and scored on). Nothing is fitted here: the rule reuses the
    moments' own slack. DDP is left as it is (its untrimmed ranks on the same run read within 1 % of
    the unchanged estimate); one process (``sharding="none"``) is not rewritten here at all."""
    held = max(v["allocator_slack"] for v in phases.values())
    for v in phases.values():
        v["allocator_slack"] = held
