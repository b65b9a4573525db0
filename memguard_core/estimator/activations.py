"""Activations per block: the tensors one decoder block saves for its backward, per token
(Korthikanti et al. 2022 sec. 4.1 method applied to transformers 5.x modules and PyTorch autograd),
and all blocks' activations at the end of the forward. docs/estimator.md, "Dropout and the attention
kernel".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from .attention import attention_core, dropout_bytes, sdpa_lse_per_token
from .bnb import bnb_saved_inputs
from .cuda import cuda_sdpa_backend
from .encoder_blocks import encoder_block_act, encoder_reads_norm, is_post_norm_encoder
from .image_blocks import image_block_act, is_image_classifier
from .lora_inputs import lora_input_bytes
from .gradients import grad_layers
from .mps import mps_sdpa_math
from .seq2seq_blocks import is_seq2seq, stack_activation_bytes
from .trainable import block_linear_shapes, lora_linears, num_lora_layers
from .specs import DTYPE_BYTES, ModelSpec, TrainSpec


_GPT2_LIKE = ("gpt2", "gpt_bigcode", "gpt_neo", "gptj", "bloom", "falcon", "phi")
#: model_type -> (MLP activation, attention dropout, residual dropouts per block, fused q/k/v, parallel residual)
#: of the plain-MLP LayerNorm blocks modelled from their own modules: docs/estimator.md#attention-and-dropout-rules.
_PLAIN_MLP_ARCHS = {
    "opt": ("relu", False, 2, False),
    "gpt_neox": ("gelu", False, 0, True),
}


@dataclass
class _Act:
    """Per-block activation bytes per token (multiply by batch x seq), split in terms."""

    hidden: float = 0.0   # saved block tensors (norm inputs, projections, MLP)
    scores: float = 0.0   # attention scores / softmax (eager) or sdpa's logsumexp
    lora: float = 0.0     # LoRA intermediates (x @ A), r per wrapped linear


def block_act_per_token(ms: ModelSpec, ts: TrainSpec, *, lora: bool, trainable_block: bool) -> _Act:
    """Bytes one block saves for its backward, per token: the module rules of
    ``block_act_per_token_modules`` plus, for a frozen block of bitsandbytes-quantized linears,
    the inputs those linears save (``bnb_saved_inputs``)."""
    a = block_act_per_token_modules(ms, ts, lora=lora, trainable_block=trainable_block)
    if not trainable_block:
        a.hidden += bnb_saved_inputs(ms, ts, lora=lora)
    return a


def block_act_per_token_modules(ms: ModelSpec, ts: TrainSpec, *, lora: bool, trainable_block: bool) -> _Act:
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
    GPT-2 family: ``_gpt2_block_act``; OPT / GPT-NeoX: ``_plain_mlp_block_act``; post-LN encoders
    (BERT, RoBERTa, DistilBERT, DeBERTa-v2): ``encoder_blocks.encoder_block_act``.
    """
    e = DTYPE_BYTES[ts.dtype]
    h = ms.hidden_size
    qd = ms.num_heads * ms.head_dim
    lins = {ls.name: ls for ls in block_linear_shapes(ms)}
    lora_names = {ls.name for ls in lora_linears(ms, ts)} if lora else set()

    a = _Act()
    gpt2 = ms.model_type in _GPT2_LIKE
    # autocast: linear inputs are cast to e (copies saved), the residual stream stays fp32
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    r = 4 if amp else e  # residual / norm dtype
    if lora:
        a.lora += sum(ls.count * ts.lora_rank * (2 if amp else 4) for ls in lora_linears(ms, ts))

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
        return lora_input_bytes(ts, len(lo), fin, e, amp)

    if ms.model_type in _PLAIN_MLP_ARCHS:
        return _plain_mlp_block_act(ms, ts, a, lora_names, trainable_block, e, r, amp)
    if gpt2:
        return _gpt2_block_act(ms, ts, a, lora_names, trainable_block, e, r, amp)
    if is_post_norm_encoder(ms):
        return encoder_block_act(ms, ts, a, lora_names, trainable_block, e, r, amp)
    if is_image_classifier(ms):  # ViT / DeiT: image_blocks
        return image_block_act(ms, ts, a, lora_names, trainable_block, e, r, amp)

    # Llama family
    a.hidden += 4 * h                           # input_layernorm: fp32 input
    if trainable_block:
        a.hidden += r * h                       # normalised (norm weight grad; fp32 under amp)
    a.hidden += group_input(("q_proj", "k_proj", "v_proj"), h)
    _attention_act(ms, ts, a, e, amp)
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


def _attention_act(ms: ModelSpec, ts: TrainSpec, a: _Act, e: int, amp: bool) -> None:
    """Adds to ``a`` what a Llama-family attention core saves per token, from q / k / v to its
    output: SDPA's math path (``attention_core``), eager's probabilities, or a fused kernel's q, k,
    v, output and fp32 logsumexp."""
    s, nh = ts.seq_length, ms.num_heads
    qd, kvd = nh * ms.head_dim, ms.num_kv_heads * ms.head_dim
    eager = ts.attn_impl == "eager"
    cuda_backend = cuda_sdpa_backend(ms, ts) if ts.device == "cuda" else None
    cpu_math = ts.attn_impl == "sdpa" and ((ts.device != "cuda" and ms.attention_dropout > 0) or mps_sdpa_math(ts))
    if cpu_math or cuda_backend == "math":
        core_h, core_s = attention_core(ms, ts, e, views_of_one_buffer=False)
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
            a.scores += nh * s * (e + dropout_bytes(ts, e))
    else:
        a.hidden += e * (qd + 2 * kvd)          # q, k (RoPE'd), v
        a.hidden += e * qd                      # sdpa output (flash backward needs it)
        # fp32 logsumexp (CUDA memory-efficient kernel: padded to 32 queries)
        a.scores += sdpa_lse_per_token(ms, ts, cuda_backend or "flash")


def _gpt2_block_act(ms: ModelSpec, ts: TrainSpec, a: _Act, lora_names: set, trainable_block: bool,
                    e: int, r: int, amp: bool) -> _Act:
    """Saved bytes per token of a GPT-2-family block (``_GPT2_LIKE``; transformers 5.x
    ``modeling_gpt2.py``), added to ``a``: LayerNorm inputs (r x h), ``c_attn``'s output alive
    through the q/k/v views, ``gelu_new`` in Python (x, tanh(.), 0.5x, 1 + tanh: 4 x e x i), the
    dropout masks; the attention dropout forces SDPA's math path on CPU. Checked with
    ``saved_tensors_hooks``: docs/estimator.md, "Attention and dropout rules"."""
    h = ms.hidden_size

    n_res = 2 if ms.residual_dropout > 0 else 0  # after the attention's c_proj and the MLP

    def saves(name: str) -> bool:
        return trainable_block or name in lora_names

    def lora_in(name: str, fin: int) -> float:
        """A linear's saved input: ``e x fin``; a LoRA'd frozen one's under LoRA dropout as
        ``lora_input_bytes`` says."""
        if ts.lora_dropout > 0 and not trainable_block and name in lora_names:
            return lora_input_bytes(ts, 1, fin, e, amp)
        return e * fin

    a.hidden += r * h                       # ln_1 input (native_layer_norm: input, mean, rstd)
    if saves("c_attn"):
        a.hidden += lora_in("c_attn", h)    # c_attn input (ln_1 output)
    core_h, core_s = attention_core(ms, ts, e, views_of_one_buffer=True)
    a.hidden += core_h
    a.scores += core_s
    if saves("c_proj"):
        a.hidden += lora_in("c_proj", h)    # merged heads (a contiguous copy), c_proj's input
    a.hidden += n_res / 2 * h * dropout_bytes(ts, e)
    a.hidden += r * h                       # ln_2 input
    i = ms.intermediate_size
    if saves("c_fc"):
        a.hidden += lora_in("c_fc", h)
    a.hidden += 4 * e * i                   # gelu_new in Python: x, tanh(.), 0.5 x, 1 + tanh(.)
    if trainable_block or "c_proj" in lora_names:
        a.hidden += lora_in("c_proj", i)    # mlp c_proj input
    a.hidden += n_res / 2 * h * dropout_bytes(ts, e)
    return a


#: Llama-family linears that read a product of the block (attention output, gated MLP product), not a
#: normalised hidden state: under autocast their input is already in the compute dtype.
_READS_PRODUCT = ("o_proj", "down_proj", "out_proj", "dense", "c_proj", "wo", "w2", "fc2")


def adapter_input_bytes(ms: ModelSpec, ts: TrainSpec) -> Tuple[float, float]:
    """(kept, freed): bytes per token, per LoRA'd block, of the tensors that PEFT's adapter path and
    autocast allocate for the inputs of a Llama-family block's frozen linears -- the kept ones
    saved for the backward (part of ``block_act_per_token``), the freed ones temporaries. The CPU
    heap slack is driven by them differently (``cpu_heap.activation_traffic``).

    PEFT 0.21 ``peft/tuners/lora/layer.py`` ``Linear.forward``: ``x = self._cast_input_dtype(x,
    lora_A.weight.dtype)`` (a new tensor when the dtypes differ: the adapters are fp32 on a
    half-precision base, ``autocast_adapter_dtype``, and under autocast), then
    ``lora_A(dropout(x))``; CPU dropout is ``x * noise`` and ``mul`` saves only the noise
    (``_dropout_impl``). Torch autocast (``aten/src/ATen/autocast_mode.h`` ``cached_cast``) caches
    only the casts of leaf tensors that require grad, so every linear casts an fp32 input anew;
    under autocast the inputs read from a norm are fp32 (the residual stream and RMSNorm stay
    fp32), those read from a product (``_READS_PRODUCT``: attention output, MLP product) are
    already in the compute dtype. A frozen base ``F.linear`` does not save its input
    (``derivatives.yaml`` ``mm``: the input's gradient needs only the weight). Per linear reading
    ``fin`` features:

    * half-precision base, LoRA'd: kept -- the fp32 copy ``lora_A`` saves (4 x fin); with a
      dropout the copy is freed (4) and the dropout's noise and output kept (4 + 4 on CPU);
    * fp32 base, no autocast, LoRA'd: ``lora_A`` saves the block's own tensor (nothing); with a
      dropout its noise and output are kept (4 + 4);
    * autocast: every frozen linear reading a norm casts it for the base (freed, 2 x fin); a
      LoRA'd one keeps ``lora_A``'s bf16 copy (2), a LoRA'd one reading a product first makes
      PEFT's fp32 copy (freed, 4); with a dropout, its noise is kept (4) and its fp32 output freed
      (4) once autocast has copied it for ``lora_A``.

    A post-LN encoder's linears (``encoder_blocks``) are told apart by shape and path, not name
    (BERT's three ``dense``): ``encoder_blocks.encoder_reads_norm`` says which read a LayerNorm.
    (0, 0) for a full fine-tune, LitGPT's model code and the GPT-2 / plain-MLP families (their
    rules count the adapters' inputs apart: ``_gpt2_block_act``, ``_plain_mlp_block_act``); routers
    and fused experts are left out. Checked against the casts and saved tensors of real PEFT
    blocks: tests/test_lora_ckpt_census.py.
    """
    kept = sum(n * b for k, b, n in adapter_input_tensors(ms, ts) if k)
    freed = sum(n * b for k, b, n in adapter_input_tensors(ms, ts) if not k)
    return float(kept), float(freed)


def adapter_input_tensors(ms: ModelSpec, ts: TrainSpec) -> List[Tuple[bool, int, int]]:
    """The tensors ``adapter_input_bytes`` sums, one entry per kind: (kept, bytes per token of one
    tensor, tensors per block); the same rules, for callers that need each tensor's size (glibc
    mmaps a request of ``cpu_heap.MMAP_THRESHOLD_MAX`` or more)."""
    if (ts.method == "full" or ts.model_code == "litgpt" or ms.model_type in _GPT2_LIKE
            or ms.model_type in _PLAIN_MLP_ARCHS):
        return []
    e = DTYPE_BYTES[ts.dtype]
    amp = ts.mixed_precision and ms.dense_bits >= 32 and e < 4
    drop = dropout_bytes(ts, 4) if ts.lora_dropout > 0 else 0
    lora_names = {ls.name for ls in lora_linears(ms, ts)}
    # encoders by shape and path: BERT's ``dense`` names linears of both kinds; DeBERTa's ``pos_*``
    # projections read the relative embeddings, not the tokens
    encoder = is_post_norm_encoder(ms)
    lora_set = set(lora_linears(ms, ts)) if encoder else set()
    out: List[Tuple[bool, int, int]] = []
    for ls in block_linear_shapes(ms):
        if getattr(ls, "is_param", False) or ls.kind in ("router", "experts"):
            continue
        if encoder and ls.name.startswith("pos_"):
            continue
        n, fin, lo = ls.count, ls.in_features, (ls in lora_set) if encoder else ls.name in lora_names
        reads_norm = encoder_reads_norm(ms, ls) if encoder else ls.name not in _READS_PRODUCT
        if amp:
            if reads_norm:
                out.append((False, 2 * fin, n))           # the base's autocast cast
            if lo:
                out.append((True, 2 * fin, n))            # lora_A's bf16 copy
                if not reads_norm:
                    out.append((False, 4 * fin, n))       # PEFT's fp32 copy of a bf16 input
                if drop:
                    out += [(True, drop * fin, n), (False, 4 * fin, n)]  # noise; fp32 output
        elif lo and (e < 4 or drop):
            out.append((True, 4 * fin, n))                # the fp32 copy, or the dropout's output
            if drop:
                out.append((True, drop * fin, n))         # the dropout's noise
                if e < 4:
                    out.append((False, 4 * fin, n))       # the fp32 cast ahead of the dropout
    return out


def _hidden_norms_per_block(ms: ModelSpec) -> int:
    """Hidden-sized norms in one block: the blocks' norm parameters over (blocks x hidden), rounded
    (q/k norms of head_dim size round away); 2 when the spec does not count norms."""
    n = ms.params.norms_in_blocks / max(ms.num_layers * ms.hidden_size, 1)
    return int(round(n)) if n >= 1.5 else 2


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
    lins = block_linear_shapes(ms)

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
        the LoRA'd frozen ones save instead (``lora_input_bytes``)."""
        if ts.lora_dropout > 0 and not trainable_block:
            return lora_input_bytes(ts, n, fin, e, amp)
        return saved

    def inp(n: int) -> float:
        """A shared input saved by n linears: one tensor, or one autocast copy per linear; LoRA'd
        frozen linears as ``lora_input_bytes`` says."""
        if not n:
            return 0.0
        if not trainable_block:
            return lora_input_bytes(ts, n, h, e, amp)
        if amp:
            return 2 * h * n
        return e * h

    a.hidden += r * h                           # input LayerNorm: its input
    a.hidden += inp(attn_in)
    a.hidden += e * 3 * h                       # q, k, v
    if ts.attn_impl == "eager" or attn_drop or mps_sdpa_math(ts):
        a.scores += nh * s * (4 + (e if e < 4 else 0) + (1 if attn_drop else 0))
    else:
        a.hidden += e * h                       # SDPA output
        a.scores += sdpa_lse_per_token(ms, ts, cuda_sdpa_backend(ms, ts) if ts.device == "cuda" else "flash")
    if attn_out:
        a.hidden += dropped(attn_out, h, e * h)  # merged heads, the out projection's input
    a.hidden += n_drop * h * dropout_bytes(ts, e)  # dropout noise / mask
    if not parallel:
        a.hidden += r * h                       # post-attention LayerNorm input (the residual)
    a.hidden += inp(mlp_in)
    a.hidden += e * i                           # relu's result / gelu's input
    if act != "relu" and mlp_out:
        a.hidden += dropped(mlp_out, i, e * i)  # gelu's output, the MLP out projection's input
    elif mlp_out and ts.lora_dropout > 0 and not trainable_block:
        a.hidden += dropped(mlp_out, i, 0.0)    # relu's result is saved anyway; the adapters' own
    return a


def activation_bytes(ms: ModelSpec, ts: TrainSpec) -> Tuple[int, int, int, int]:
    """Saved activations of all blocks at the end of the forward.

    Returns (hidden, scores, lora, one_block_working_set) in bytes for the micro-batch.
    Without checkpointing every block the backward passes through keeps its saved tensors; blocks
    below the lowest trainable block keep none (no tensor there requires grad). With gradient
    checkpointing as HF/Lightning/mlx_lm do it (one checkpoint per block: transformers
    ``modeling_utils.py`` ``_activation_checkpointing_enable``, torch ``utils/checkpoint.py``) each
    block keeps only its input hidden state (e*h per token), and during the backward ONE block's
    full working set is recomputed (counted in the ``backward``/``loss`` moments) -- not sqrt(L).
    An encoder-decoder's two stacks (source and target tokens): ``seq2seq_blocks.stack_activation_bytes``.
    """
    if is_seq2seq(ms):
        return stack_activation_bytes(ms, ts)
    tokens = ts.batch_size * ts.seq_length
    e = DTYPE_BYTES[ts.dtype]
    n_grad = grad_layers(ms, ts)
    n_lora = num_lora_layers(ms, ts)
    full = ts.method == "full"
    lora = not full
    # blocks that train (full: all for hf; mlx: the last n) vs frozen blocks grads flow through
    if full:
        n_train = ms.num_layers if ts.framework != "mlx" else n_lora
    else:
        n_train = n_lora
    n_frozen = max(n_grad - n_train, 0)
    top = block_act_per_token(ms, ts, lora=lora, trainable_block=full)
    frozen = block_act_per_token(ms, ts.replace(lora_targets=("__none__",)), lora=False,
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
