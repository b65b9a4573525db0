"""CPU device rules: glibc's heap slack on top of the live set (VmHWM counts resident pages, not
live tensors), driven by the activation traffic, LoRA's temporaries and the heap-resident gradients;
``heap_slack`` is what ``estimate()`` calls. docs/estimator.md, "The CPU counter" and "CPU heap slack".
"""

from __future__ import annotations


from typing import Dict, Optional

from .activations import activation_bytes, adapter_input_tensors
from .encoder_blocks import is_post_norm_encoder
from .gradients import grad_layers
from .image_blocks import is_image_classifier
from .logits import logits_elements
from .seq2seq_blocks import is_seq2seq
from .trainable import block_linear_shapes, lora_linears, num_lora_layers, routed_half_precision_on_cpu
from .specs import DTYPE_BYTES, MiB, ModelSpec, TrainSpec


#: Heap slack per byte of activation traffic at the loss moment, by method: fitted,
#: docs/estimator.md#cpu-heap-slack; ``lora_encoder``: LoRA on :func:`encoder_style_blocks`, fitted,
#: docs/estimator.md#lora-on-encoder-style-blocks-2026-11-29.
CPU_HEAP_SLACK_FORWARD = {"full": 0.3, "lora": 0.5, "lora_encoder": 0.95}
#: The same at the end of the backward and the optimizer step: fitted, docs/estimator.md#cpu-heap-slack.
CPU_HEAP_SLACK_BACKWARD = {"full": 0.95, "lora": 0.9}
#: The same at every moment under checkpointing: fitted on the small matrix with the loss moment
#: holding the larger of the logits and the recomputed block (``moments.recompute_beyond_logits``),
#: docs/estimator.md#cpu-heap-slack.
CPU_HEAP_SLACK_CHECKPOINTED = {"full": 0.35, "lora": 0.9}
#: Trimmed checkpointed full fine-tune, loss moment, in ONE block's traffic: fitted, docs/estimator.md#cpu-heap-slack.
CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS = 1.75
#: Checkpointed LoRA, every moment, in ONE block's traffic beside ``CPU_HEAP_SLACK_CHECKPOINTED``'s
#: share of all blocks': 0 here (on glibc 2.35 / 2.36 each block's forward takes fresh heap, so the
#: slack grows with the blocks; the form was fitted and not adopted there), fitted for the newer heap:
#: docs/estimator.md, "Checkpointed LoRA on glibc 2.39 and later".
CPU_HEAP_SLACK_CHECKPOINTED_LORA_BLOCKS = 0.0
#: glibc's largest dynamic mmap threshold on 64-bit, mallopt(3) ``M_MMAP_THRESHOLD`` (larger requests leave no hole).
MMAP_THRESHOLD_MAX = 32 * MiB

#: The first glibc release whose heap keeps far less of a step's freed tensors resident: measured on
#: 2.39 and 2.41 against 2.35 and 2.36 (2.37 and 2.38 not measured, so they keep the older factors),
#: docs/benchmarks.md, "The CPU heap by C library version".
NEWER_HEAP_GLIBC = (2, 39)
#: The factors above for a process on glibc >= ``NEWER_HEAP_GLIBC``, fitted the same way on the small
#: matrix's fp32 and bf16 cases measured under glibc 2.41: docs/estimator.md, "CPU heap slack by glibc
#: release".
NEWER_GLIBC_SLACK = {
    "forward": {"full": 0.2, "lora": 0.25, "lora_encoder": 0.5},
    # full: the older value, not the decoder matrix's 0.6: an encoder's full fine-tune keeps the
    # same backward heap on 2.41 as on 2.36 (docs/estimator.md, "CPU heap slack by glibc release")
    "backward": {"full": 0.95, "lora": 0.9},
    # lora: with one block's working set as a term of its own (checkpointed_lora_blocks): a freed
    # block-sized hole takes an equal request from 2.39 on, so the slack grows slowly with the blocks
    "checkpointed": {"full": 0.1, "lora": 0.2},
    "checkpointed_loss_blocks": 1.75,
    "checkpointed_lora_blocks": 1.75,
    "lora_temp": 0.15,
}


def is_newer_glibc(version: Optional[str]) -> bool:
    """True when ``version`` (``"2.41"``) is a glibc release from ``NEWER_HEAP_GLIBC`` on; False for
    older releases and for None (not glibc or unknown)."""
    if not version:
        return False
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) >= NEWER_HEAP_GLIBC


def newer_glibc_heap(ts: TrainSpec) -> bool:
    """True when ``ts.glibc`` names a release from ``NEWER_HEAP_GLIBC`` on: its heap takes the
    ``NEWER_GLIBC_SLACK`` factors. False for older releases and for an unknown C library
    (``ts.glibc`` None), which keep the factors the estimator was first fitted with (glibc 2.36)."""
    return is_newer_glibc(ts.glibc)


def slack_factors(ts: TrainSpec) -> Dict[str, object]:
    """The heap-slack factors of the run's C library: ``forward`` / ``backward`` / ``checkpointed``
    (method -> factor), ``checkpointed_loss_blocks``, ``checkpointed_lora_blocks`` and ``lora_temp``
    (floats); the module's ``CPU_HEAP_SLACK_*`` and ``LORA_TEMP_SLACK`` unless
    :func:`newer_glibc_heap`."""
    if newer_glibc_heap(ts):
        return NEWER_GLIBC_SLACK
    return {"forward": CPU_HEAP_SLACK_FORWARD, "backward": CPU_HEAP_SLACK_BACKWARD,
            "checkpointed": CPU_HEAP_SLACK_CHECKPOINTED,
            "checkpointed_loss_blocks": CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS,
            "checkpointed_lora_blocks": CPU_HEAP_SLACK_CHECKPOINTED_LORA_BLOCKS, "lora_temp": LORA_TEMP_SLACK}


def slack_note(ts: TrainSpec) -> str:
    """The estimate's note on whose heap its slack factors are (the run's glibc release)."""
    if newer_glibc_heap(ts):
        return f"cpu heap: glibc {ts.glibc} (the heap-slack factors of glibc >= 2.39)"
    if ts.glibc:
        return f"cpu heap: glibc {ts.glibc} (the heap-slack factors of glibc 2.35 / 2.36)"
    return "cpu heap: glibc release not given (the heap-slack factors of glibc 2.35 / 2.36)"


def encoder_style_blocks(ms: ModelSpec) -> bool:
    """True for a post-LN encoder (BERT, RoBERTa, DistilBERT), an image classifier (ViT) or an
    encoder-decoder (T5, BART): blocks whose forward frees its tensors at nearly one size (tokens x
    hidden: one key / value head per query head, no rotary halves). On glibc 2.35 / 2.36 a freed
    tensor's hole cannot take an equal ``posix_memalign`` request, so a LoRA forward of such blocks
    keeps more of its freed tensors resident than a decoder's, whose smaller requests refill the
    holes (docs/benchmarks.md, "The LoRA under-estimates at full depth"): its loss moment takes the
    ``lora_encoder`` factor (docs/estimator.md, "LoRA on encoder-style blocks")."""
    return is_post_norm_encoder(ms) or is_image_classifier(ms) or is_seq2seq(ms)


def forward_kind(ms: ModelSpec, ts: TrainSpec) -> str:
    """The key of the loss moment's factor (``slack_factors(ts)["forward"]``): ``full``, ``lora`` or
    ``lora_encoder`` (LoRA on :func:`encoder_style_blocks`)."""
    if ts.method == "full":
        return "full"
    return "lora_encoder" if encoder_style_blocks(ms) else "lora"


def forward_split(ms: ModelSpec, ts: TrainSpec, traffic: int, small_logits: int) -> Dict[str, int]:
    """The loss moment's heap traffic (``traffic`` + ``small_logits``, bytes) by the key of the
    ``forward`` factor it takes: all of it under :func:`forward_kind`, except that on
    encoder-style blocks the score-sized tensors (:func:`score_traffic`) and the logits, which are
    not of the blocks' one size, keep the method's own factor (``lora``)."""
    kind = "full" if ts.method == "full" else "lora"
    fk = forward_kind(ms, ts)
    total = max(int(traffic + small_logits), 0)
    if fk == kind:
        return {kind: total}
    other = min(score_traffic(ms, ts) + int(small_logits), total)
    return {fk: total - other, kind: other}


def activation_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
    """Bytes of activations one step saves across all blocks without checkpointing, also under
    checkpointing: what drives the CPU heap slack (``CPU_HEAP_SLACK_*``). Score-sized tensors are
    left out when glibc mmaps each of them (``MMAP_THRESHOLD_MAX``, :func:`score_traffic`), and so
    are the copies the LoRA adapters keep of their inputs when each is that large
    (``adapter_traffic``). Why this traffic, also under checkpointing:
    docs/estimator.md#cpu-heap-slack and #lora-input-copies-and-the-heap."""
    h, sc, lo = _traffic_terms(ms, ts)
    return int(max(h + sc + lo + adapter_traffic(ms, ts), 0))


def score_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
    """The score-sized part of :func:`activation_traffic` (batch x heads x s x s tensors the heap
    serves), bytes; 0 where glibc mmaps each of them (judged on the source length for an
    encoder-decoder, whose decoder and cross-attention scores are smaller) or no kernel makes them."""
    return _traffic_terms(ms, ts)[1]


def _traffic_terms(ms: ModelSpec, ts: TrainSpec):
    """(hidden, scores, LoRA) bytes of the rules' saved activations without checkpointing, the
    scores 0 where mmapped."""
    h, sc, lo, _ = activation_bytes(ms, ts.replace(grad_checkpoint=False))
    return int(h), 0 if _score_tensors_mmapped(ms, ts) else int(sc), int(lo)


def adapter_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
    """What the adapters' input tensors change in ``activation_traffic``, bytes (0 or negative): a
    kept copy (saved until the backward, with no temporary of its own) that glibc mmaps -- each
    at least ``MMAP_THRESHOLD_MAX`` -- leaves no heap behind, so it leaves the traffic, as the
    score tensors do. The freed casts are not added: measured runs do not show them in the slack
    (docs/estimator.md#lora-input-copies-and-the-heap). 0 where the guard pins the mmap
    threshold."""
    if routed_half_precision_on_cpu(ms, ts):
        return 0
    tokens = ts.batch_size * ts.seq_length
    mmapped = sum(n * tokens * b for kept, b, n in adapter_input_tensors(ms, ts)
                  if kept and tokens * b >= MMAP_THRESHOLD_MAX)
    return -int(num_lora_layers(ms, ts) * mmapped)


def _score_tensors_mmapped(ms: ModelSpec, ts: TrainSpec) -> bool:
    """True when every score-sized tensor one block saves (batch x heads x s x s: eager attention's,
    or SDPA's CPU math path's with attention dropout; ``attention_core``) is at least
    ``MMAP_THRESHOLD_MAX`` bytes, so glibc mmaps each one; False for the fused SDPA kernels."""
    e = DTYPE_BYTES[ts.dtype]
    cpu_math = ms.attention_dropout > 0 and ts.attn_impl == "sdpa"
    if ts.attn_impl != "eager" and not cpu_math:
        return False
    smallest = 4 if (cpu_math or ts.attn_impl != "eager") else min(e, 4)
    return ts.batch_size * ms.num_heads * ts.seq_length ** 2 * smallest >= MMAP_THRESHOLD_MAX


#: Temporaries one LoRA'd linear's forward allocates (+1 cast on a half base): PEFT 0.21 ``Linear.forward``.
LORA_FORWARD_TEMPORARIES = 3
#: Resident slack per byte of them, in <= ``LORA_TEMP_BLOCKS`` blocks: measured, docs/estimator.md#lora-temporaries.
LORA_TEMP_SLACK = 0.4
LORA_TEMP_BLOCKS = 2


def lora_forward_traffic(ms: ModelSpec, ts: TrainSpec) -> int:
    """Heap traffic (bytes) of the LoRA temporaries of one forward, HF/Lightning (PEFT) only:
    ``LORA_FORWARD_TEMPORARIES`` tensors of tokens x out_features per LoRA'd linear of at most
    ``LORA_TEMP_BLOCKS`` LoRA'd blocks, in the adapter's dtype (fp32; the compute dtype under
    autocast), plus the cast back to a half-precision base; tensors of at least
    ``MMAP_THRESHOLD_MAX`` are mmapped and not counted. 0 for a full fine-tune, MLX and under
    gradient checkpointing (docs/estimator.md#gradient-checkpointing-on-cpu-2026-11-25)."""
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
    element). Only a full fine-tune has large gradients; LoRA's adapters are all small. Under
    checkpointing without a heap trim they are the last step's holes the next step cannot reuse:
    docs/estimator.md#gradient-checkpointing-on-cpu-2026-11-25."""
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


def logits_heap_served(ms: ModelSpec, ts: TrainSpec) -> bool:
    """True when the head's fp32 logits tensor (``logits.logits_elements`` x 4 bytes) is under
    ``MMAP_THRESHOLD_MAX``, so glibc serves it and its loss working set from the heap (their holes
    count in the loss moment's slack); False when it is mmapped."""
    return logits_elements(ms, ts) * 4 < MMAP_THRESHOLD_MAX


def heap_slack(ms: ModelSpec, ts: TrainSpec, *, gradients: int, param_bytes: int, logits: int) -> Dict[str, int]:
    """``device="cpu"``: moment -> glibc's resident heap slack above the live set, bytes.

    ``gradients``: all ``.grad`` bytes; ``param_bytes``: bytes of one trainable element; ``logits``:
    the loss moment's logits term (its holes count only when the logits tensor is below
    ``MMAP_THRESHOLD_MAX``). Without checkpointing the slack is a factor of the activation traffic
    (``activation_traffic``; ``CPU_HEAP_SLACK_FORWARD`` by :func:`forward_split` plus LoRA's
    temporaries at the loss,
    ``CPU_HEAP_SLACK_BACKWARD`` later). Under checkpointing no moment holds every block's
    activations: the arena is what the forward left or the holes of the last step's gradients
    (``heap_gradient_bytes``), the larger, at every moment -- unless the run trims the heap at
    every step's end (``ts.heap_trim``), which hands those holes back; a trimmed full fine-tune's
    loss moment then holds about one block's traffic (``CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS``);
    a checkpointed LoRA run adds one block's traffic times ``checkpointed_lora_blocks`` (0 before
    glibc 2.39). Every factor is that of the run's C library (:func:`slack_factors`, ``ts.glibc``).
    """
    traffic = activation_traffic(ms, ts)
    small_logits = logits if logits_heap_served(ms, ts) else 0
    kind = "full" if ts.method == "full" else "lora"
    f = slack_factors(ts)
    if ts.grad_checkpoint:
        held = 0 if ts.heap_trim else heap_gradient_bytes(ms, ts, gradients, param_bytes)
        one = traffic / max(1, grad_layers(ms, ts))
        blocks = f["checkpointed_lora_blocks"] * one if kind == "lora" else 0
        every = max(int(f["checkpointed"][kind] * (traffic + small_logits) + blocks), held)
        loss = every
        if kind == "full" and ts.heap_trim:
            loss = int(f["checkpointed_loss_blocks"] * one + f["checkpointed"][kind] * small_logits)
        return {"loss": loss, "backward": every, "optimizer": every}
    loss = int(sum(f["forward"][k] * b for k, b in forward_split(ms, ts, traffic, small_logits).items())
               + f["lora_temp"] * lora_forward_traffic(ms, ts))
    later = int(f["backward"][kind] * traffic)
    return {"loss": loss, "backward": later, "optimizer": later}

