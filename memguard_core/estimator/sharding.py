"""Per-rank memory of data-parallel training: DDP, FSDP (``fully_shard`` / FSDP1) and DeepSpeed ZeRO.

``estimate()`` builds the three moments of ONE process holding the whole model, then
:func:`apply_sharding` rewrites each moment's terms for one rank of ``TrainSpec.sharding`` (bytes).
Activations, attention scores, logits and the runtime overhead are per rank already; the allocator
slack is recomputed. What each layout divides and adds, and the sources: docs/distributed.md,
"Rules and their sources"; details: docs/estimator.md, "Data-parallel ranks".
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from .cuda import allocator_slack
from .trainable import trainable_param_count
from .specs import DTYPE_BYTES

MiB = 1 << 20

#: cpu: a rank's fixed cost (torch.distributed, gloo): calibrated to 0, docs/distributed.md#rules-and-their-sources.
DIST_CPU_RUNTIME_BYTES = 0

#: cpu, DeepSpeed: its import and comm op on top: calibrated, docs/distributed.md#rules-and-their-sources.
DEEPSPEED_CPU_RUNTIME_BYTES = 60 * MiB

#: cpu, FSDP / ZeRO-3: heap slack per byte of ``_unit_heap_traffic``: fitted on 30M rows, docs/distributed.md.
FSDP_CPU_HEAP_SLACK = {"fsdp-full": 1.15, "fsdp-grad-op": 1.15, "fsdp-hybrid": 1.15, "fsdp-no-shard": 0.6,
                       "zero3": 1.15}

#: DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``), bytes.
DDP_FIRST_BUCKET_BYTES = 1 * MiB

#: DeepSpeed bucket sizes (elements): ``runtime/zero/config.py``, Lightning's ``DeepSpeedStrategy``; docs/estimator.md.
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


def apply_sharding(ms, ts, phases: Dict[str, Dict[str, int]], totals: Dict[str, int], notes: List[str], *,
                   slack_floors: Optional[Dict[str, int]] = None) -> None:
    """Rewrite the moments of one whole-model process (``phases``: moment -> term -> bytes, and
    their ``totals``, as ``estimate()`` built them, allocator slack included) into those of one
    rank of ``ts.sharding``, in place; append a note.

    ``ms`` is the spec ``estimate()`` counted (weights in their training dtype). The allocator
    slack is recomputed: on ``cuda`` the same fraction (``CUDA_FRAGMENTATION``) of the rewritten
    moment, or the moment's entry of ``slack_floors`` where larger (``cuda.unusable_cache_bytes``:
    per-token tensors, which every rank of a data-parallel run holds); on ``cpu`` the single-process heap slack plus, under FSDP, :data:`FSDP_CPU_HEAP_SLACK`.
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
            v["allocator_slack"] = allocator_slack({k: sum(v.values())}, v["runtime_overhead"], slack_floors)[k]
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
    becomes the largest of the moments' (bytes), in place -- ``free()`` returns no hole below the
    heap's top, so the backward's holes stay under the next forward. Measured:
    docs/distributed.md, "A plain loop that does not trim the heap"."""
    held = max(v["allocator_slack"] for v in phases.values())
    for v in phases.values():
        v["allocator_slack"] = held
