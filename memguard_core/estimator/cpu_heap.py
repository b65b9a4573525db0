"""CPU device rules: glibc's heap slack on top of the live set (VmHWM counts resident pages, not
live tensors), driven by the activation traffic, LoRA's temporaries and the heap-resident gradients.
The measurements behind the factors: docs/estimator.md, "CPU heap slack" and "Gradient
checkpointing on CPU".
"""

from __future__ import annotations


from typing import Dict

from .activations import activation_bytes
from .gradients import grad_layers
from .trainable import block_linear_shapes, lora_linears, num_lora_layers
from .specs import DTYPE_BYTES, MiB, ModelSpec, TrainSpec


#: glibc heap slack on CPU (device="cpu": the counter is VmHWM, resident pages, not live tensors).
#: Torch's CPU allocator calls malloc/free per tensor. glibc serves blocks below its dynamic mmap
#: threshold (it rises to the size of the largest freed mmapped block, at most 32 MiB:
#: ``M_MMAP_THRESHOLD`` in mallopt(3)) from the heap, and freed heap pages stay resident,
#: fragmented; blocks >= 32 MiB are mmapped and go back to the OS on free. With
#: ``MALLOC_MMAP_THRESHOLD_=131072`` pinning the threshold the peak equals the live set this module
#: predicts; with glibc's defaults the forward leaves resident holes in proportion to the
#: activations saved by all blocks (``activation_traffic``: the holes are the temporaries that
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
#: step's heap-resident gradients (``heap_gradient_bytes``; docs/estimator.md, "Gradient
#: checkpointing on CPU"), unless the run trims the heap at every step's end (``TrainSpec.heap_trim``,
#: the guard's default), which hands those pages back.
CPU_HEAP_SLACK_FORWARD = {"full": 0.3, "lora": 0.5}
CPU_HEAP_SLACK_BACKWARD = {"full": 0.95, "lora": 0.9}
#: Under activation checkpointing: every moment's slack as a multiple of the same un-checkpointed
#: traffic (``activation_traffic``) -- no moment holds every block's activations, and the holes are
#: those of the checkpointed forward and of each block's recompute, a different mix of sizes than
#: a plain forward's (a full fine-tune recomputes the inputs of its trained linears, LoRA its
#: adapters' temporaries). Fitted on the six checkpointed cases of the small matrix (OPT-125M,
#: SmolLM2-135M, Qwen2.5-0.5B cut to 4 blocks, SmolLM2 cut to 8; LoRA and full), with the other
#: factors on its other cases, all measured with the step-end heap trim (docs/estimator.md, "CPU
#: heap slack").
CPU_HEAP_SLACK_CHECKPOINTED = {"full": 0.25, "lora": 0.65}
#: A checkpointed full fine-tune at the ``loss`` moment, in a run that trims the heap at every
#: step's end (``TrainSpec.heap_trim``): slack in units of ONE block's un-checkpointed traffic
#: (``activation_traffic`` / the blocks the backward passes through), not of all blocks'. Measured
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


def heap_slack(ms: ModelSpec, ts: TrainSpec, *, gradients: int, param_bytes: int, logits: int) -> Dict[str, int]:
    """``device="cpu"``: moment -> glibc's resident heap slack above the live set, bytes.

    ``gradients``: all ``.grad`` bytes; ``param_bytes``: bytes of one trainable element; ``logits``:
    the loss moment's logits term (its holes count only when the logits tensor is below
    ``MMAP_THRESHOLD_MAX``). Without checkpointing the slack is a factor of the activation traffic
    (``activation_traffic``; ``CPU_HEAP_SLACK_FORWARD`` plus LoRA's temporaries at the loss,
    ``CPU_HEAP_SLACK_BACKWARD`` later). Under checkpointing no moment holds every block's
    activations: the arena is what the forward left or the holes of the last step's gradients
    (``heap_gradient_bytes``), the larger, at every moment -- unless the run trims the heap at
    every step's end (``ts.heap_trim``), which hands those holes back; a trimmed full fine-tune's
    loss moment then holds about one block's traffic (``CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS``).
    """
    traffic = activation_traffic(ms, ts)
    logits_tensor = ts.batch_size * ts.seq_length * ms.vocab_size * 4
    small_logits = logits if logits_tensor < MMAP_THRESHOLD_MAX else 0
    kind = "full" if ts.method == "full" else "lora"
    if ts.grad_checkpoint:
        held = 0 if ts.heap_trim else heap_gradient_bytes(ms, ts, gradients, param_bytes)
        every = max(int(CPU_HEAP_SLACK_CHECKPOINTED[kind] * (traffic + small_logits)), held)
        loss = every
        if kind == "full" and ts.heap_trim:
            one = traffic / max(1, grad_layers(ms, ts))
            loss = int(CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS * one + CPU_HEAP_SLACK_CHECKPOINTED[kind] * small_logits)
        return {"loss": loss, "backward": every, "optimizer": every}
    loss = int(CPU_HEAP_SLACK_FORWARD[kind] * (traffic + small_logits) + LORA_TEMP_SLACK * lora_forward_traffic(ms, ts))
    later = int(CPU_HEAP_SLACK_BACKWARD[kind] * traffic)
    return {"loss": loss, "backward": later, "optimizer": later}


def activation_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
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
    h, sc, lo, _ = activation_bytes(ms, ts.replace(grad_checkpoint=False))
    if _score_tensors_mmapped(ms, ts):
        sc = 0
    return h + sc + lo


def _score_tensors_mmapped(ms: ModelSpec, ts: TrainSpec) -> bool:
    """True when every score-sized tensor one block saves (batch x heads x s x s: eager attention's
    probabilities and their casts / dropout noise in the compute dtype or fp32, SDPA's CPU math
    path's fp32 probabilities, noise and dropped probabilities -- ``attention_core``) is at least
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


def lora_forward_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
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
    for ls in lora_linears(ms, ts):
        sizes = [(2 if amp else 4)] * LORA_FORWARD_TEMPORARIES
        if e < 4 and not amp:
            sizes.append(e)
        for b in sizes:
            t = tokens * ls.out_features * b
            if t < MMAP_THRESHOLD_MAX:
                total += ls.count * t
    return int(total * min(num_lora_layers(ms, ts), LORA_TEMP_BLOCKS))


def heap_gradient_bytes(ms: ModelSpec, ts: TrainSpec, grads: int, pb: int) -> int:
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
    for ls in block_linear_shapes(ms):
        one = ls.in_features * ls.out_features * pb
        if getattr(ls, "is_param", False):
            if one * ls.count >= MMAP_THRESHOLD_MAX:
                big += one * ls.count * ms.num_layers
        elif one >= MMAP_THRESHOLD_MAX:
            big += one * ls.count * ms.num_layers
    return int(max(grads - big, 0))
