"""LitGPT's own model code (``TrainSpec.model_code = "litgpt"``): what a LoRA / QLoRA step of
``litgpt finetune lora`` keeps for the backward -- a fused qkv linear with one ``LoRAQKVLinear``,
adapters in the weights' dtype, the head in chunks, Lightning's ``BitsandbytesPrecision``.
``step_terms`` is what ``estimate()`` calls. Rules read from LitGPT at 8641822 and 00af8b0d (line
numbers name the 2024 tree): docs/estimator.md, "LitGPT's model code".
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, NamedTuple, Tuple

from ..errors import ConfigError
from .attention import dropout_bytes, sdpa_lse_per_token
from .bnb import bnb_4bit_keeps_input, version_tuple
from .cuda import cuda_sdpa_backend
from .moments import StepTerms
from .trainable import block_linear_shapes
from .specs import DTYPE_BYTES, ModelSpec, PeftDefaultTargets, TrainSpec
from .weights import weight_bits

#: Chunk of positions LitGPT's ``finetune/lora.py`` runs the head and the loss in
#: (``model(input_ids, lm_head_chunk_size=128)``, ``chunked_cross_entropy(..., chunk_size=128)``).
LM_HEAD_CHUNK = 128


class Block(NamedTuple):
    """How a LitGPT ``Block`` is laid out for one model family (``litgpt/config.py`` presets)."""

    norm: str                  #: ``layernorm`` (``torch.nn.LayerNorm``) | ``rmsnorm`` (``litgpt.model.RMSNorm``)
    parallel_residual: bool    #: ``x + attn(norm_1(x)) + mlp(norm_2(x))`` (GPT-NeoX, Phi)
    shared_attention_norm: bool  #: the MLP reads ``norm_1(x)`` too (Phi): one norm
    mlp: str                   #: ``gelu`` (``GptNeoxMLP``) | ``glu`` (``LLaMAMLP``: silu(fc_1) * fc_2)


#: The transformers ``model_type`` of a config -> LitGPT's block for those checkpoints (the
#: ``litgpt/config.py`` entries of Phi-1.5 / Phi-2, StableLM-Alpha / Pythia, Llama 2 / 3 / 3.1 /
#: 3.2 and Mistral). Other families are refused rather than guessed.
BLOCKS: Dict[str, Block] = {
    "phi": Block("layernorm", True, True, "gelu"),
    "gpt_neox": Block("layernorm", True, False, "gelu"),
    "llama": Block("rmsnorm", False, False, "glu"),
    "mistral": Block("rmsnorm", False, False, "glu"),
}

#: LoRA targets LitGPT's ``LoRAQKVLinear`` takes (``lora_query`` / ``lora_key`` / ``lora_value``),
#: with the module names users also write for them.
_QKV_NAMES = {"query": "q", "lora_query": "q", "q_proj": "q", "q": "q",
              "key": "k", "lora_key": "k", "k_proj": "k", "k": "k",
              "value": "v", "lora_value": "v", "v_proj": "v", "v": "v"}
#: LitGPT's ``finetune/lora.py`` defaults: ``lora_query=True``, ``lora_value=True``.
DEFAULT_TARGETS: FrozenSet[str] = frozenset({"q", "v"})
#: LitGPT's ``finetune/lora.py`` default ``lora_dropout`` (PEFT's ``LoraConfig`` default is 0).
DEFAULT_LORA_DROPOUT = 0.05

#: First LitGPT whose QLoRA swaps in a trainable ``StableEmbedding`` (finetune/lora.py): docs/estimator.md.
STABLE_EMBEDDING_FROM = (0, 5, 0)


def stable_embedding(ts: TrainSpec) -> bool:
    """Whether this QLoRA run's LitGPT swaps in a trainable ``StableEmbedding``
    (:data:`STABLE_EMBEDDING_FROM`); ``ts.litgpt_version`` None = the current LitGPT (it does)."""
    if ts.method != "qlora":
        return False
    return ts.litgpt_version is None or version_tuple(ts.litgpt_version) >= STABLE_EMBEDDING_FROM


def stable_embedding_terms(ms: ModelSpec, ts: TrainSpec) -> Dict[str, int]:
    """Bytes the trainable ``StableEmbedding`` adds (:func:`stable_embedding`), else zeros:
    ``gradient``, its weight's dense gradient (vocab x hidden in the weights' dtype,
    ``embedding_dense_backward``), live from the first backward on; ``transient``, the new
    gradient a later backward adds into it; ``per_token``, what its forward keeps (the
    LayerNorm's input in the forward context's dtype -- Fabric's ``bf16-true`` sets the default
    dtype the module casts to, bitsandbytes ``nn/modules.py`` ``StableEmbedding.forward`` -- with
    its mean and rstd, and the token ids)."""
    if not stable_embedding(ts):
        return {"gradient": 0, "transient": 0, "per_token": 0}
    e = DTYPE_BYTES[ts.dtype]
    g = ms.vocab_size * ms.hidden_size * e
    return {"gradient": g, "transient": g, "per_token": e * ms.hidden_size + 16}


def block_of(ms: ModelSpec) -> Block:
    """LitGPT's block for ``ms.model_type``.

    Raises:
        ConfigError (``model_code``): a family whose LitGPT block is not modelled here.
    """
    b = BLOCKS.get(ms.model_type)
    if b is None:
        raise ConfigError("model_code", "'transformers' for this model: LitGPT's block is modelled for "
                          + ", ".join(sorted(BLOCKS)) + f" configs, not {ms.model_type!r}", "litgpt")
    return b


def lora_parts(ts: TrainSpec) -> FrozenSet[str]:
    """The parts of the fused qkv linear LoRA trains: a subset of ``{"q", "k", "v"}``.

    ``ts.lora_targets`` left at PEFT's default means LitGPT's default (query and value).

    Raises:
        ConfigError (``lora_targets``): a target outside q / k / v (LitGPT's ``lora_projection``,
        ``lora_mlp`` and ``lora_head`` are not modelled).
    """
    targets = ts.lora_targets
    if isinstance(targets, PeftDefaultTargets):
        return DEFAULT_TARGETS
    parts = set()
    for t in targets:
        p = _QKV_NAMES.get(str(t).strip().lower())
        if p is None:
            raise ConfigError("lora_targets", "query, key and / or value under model_code 'litgpt' (LitGPT's "
                              "lora_query / lora_key / lora_value; projection, MLP and head LoRA are not "
                              "modelled)", list(targets))
        parts.add(p)
    return frozenset(parts)


def check(ms: ModelSpec, ts: TrainSpec) -> None:
    """Refuse settings the LitGPT rules do not cover, naming the field.

    Raises:
        ConfigError: full fine-tuning (``method``), autocast (``mixed_precision``: LitGPT's
        ``bf16-mixed``), activation checkpointing (``grad_checkpoint``), eager attention
        (``attn_impl``: LitGPT always calls SDPA), MLX (``framework``), several processes
        (``world_size`` / ``sharding``: LitGPT's multi-device runs use FSDP), LoRA on the last N
        blocks only (``lora_layers``: LitGPT adapts every block), a model family outside
        :data:`BLOCKS`, LoRA outside q / k / v.
    """
    if ts.method == "full":
        raise ConfigError("method", "lora or qlora under model_code 'litgpt' (its finetune/lora.py); a full "
                          "fine-tune with LitGPT's code is not modelled", ts.method)
    if ts.mixed_precision:
        raise ConfigError("mixed_precision", "False under model_code 'litgpt': LitGPT's bf16-true / 16-true / "
                          "32-true precisions (weights in dtype); bf16-mixed is not modelled", True)
    if ts.grad_checkpoint:
        raise ConfigError("grad_checkpoint", "False under model_code 'litgpt' (finetune/lora.py runs no "
                          "activation checkpointing on one device)", True)
    if ts.attn_impl == "eager":
        raise ConfigError("attn_impl", "sdpa or flash under model_code 'litgpt' (LitGPT's attention calls "
                          "scaled_dot_product_attention)", ts.attn_impl)
    if ts.framework == "mlx" or ts.device == "mlx":
        raise ConfigError("framework", "lightning or torch under model_code 'litgpt' (LitGPT runs PyTorch)",
                          ts.framework)
    if ts.sharding != "none":
        raise ConfigError("sharding", "'none' under model_code 'litgpt' (one process; LitGPT's FSDP runs are "
                          "not modelled)", ts.sharding)
    if ts.world_size > 1:
        raise ConfigError("world_size", "1 under model_code 'litgpt' (one device; LitGPT's multi-device runs "
                          "use FSDP, not modelled)", ts.world_size)
    if ts.lora_layers is not None:
        raise ConfigError("lora_layers", "None under model_code 'litgpt' (LitGPT adapts every block)",
                          ts.lora_layers)
    block_of(ms)
    lora_parts(ts)


def _dims(ms: ModelSpec) -> Dict[str, int]:
    hd = ms.head_dim
    return {"q": ms.num_heads * hd, "k": ms.num_kv_heads * hd, "v": ms.num_kv_heads * hd}


def trainable_params(ms: ModelSpec, ts: TrainSpec) -> int:
    """Parameters of LitGPT's LoRA adapters: per block ``lora_A`` (r x #parts, hidden) and
    ``lora_B`` (sum of the trained parts' widths, r), ``litgpt/lora.py`` ``LoRAQKVLinear.__init__``,
    in every block."""
    parts = lora_parts(ts)
    d = _dims(ms)
    r = ts.lora_rank
    return (r * ms.hidden_size * len(parts) + r * sum(d[p] for p in parts)) * ms.num_layers


class Saves(NamedTuple):
    """Bytes per token of one block (``block``; ``first``: the bottom block, whose input needs no
    gradient) and of the fp32 logsumexp of SDPA in it (``lse``, part of both)."""

    block: float
    first: float
    lse: float


def block_saves(ms: ModelSpec, ts: TrainSpec) -> Saves:
    """What autograd keeps per token in one LitGPT block under LoRA on the fused qkv linear, bytes.

    With e the weights' dtype bytes (LitGPT trains ``bf16-true``: weights and adapters in bf16),
    C = hidden, q / kv the query / key-value widths, I = intermediate:

    * norm inputs: ``LayerNorm`` keeps its input (e x C, once for a parallel residual whose norms
      read the same x, ``litgpt/model.py`` ``Block.forward`` l.201-206); LitGPT's ``RMSNorm`` works
      on ``x.float()`` and keeps that fp32 copy (4 x C per norm; two in a sequential block);
    * LoRA input: ``lora_A`` runs on ``lora_dropout(x)`` (``lora.py`` l.426): with p > 0 its bf16
      output (e x C) and the dropout's mask (``memguard_core.estimator.attention.dropout_bytes``: 1 byte
      on CUDA, e on CPU); with p = 0 the norm output
      itself (e x C). One dropout for the whole fused linear, whatever the parts;
    * the zero-padding of the adapter output (``LoRAQKVLinear.zero_pad``, ``lora.py`` l.347
      ``index_copy``): ``IndexCopyBackward`` keeps its source, e x (widths of the trained parts),
      unless q, k and v all train (no padding then);
    * attention (``CausalSelfAttention.forward`` l.242-267, 318): the fused output is viewed as
      (B, groups, q_per_kv + 2, T, hs); with one query per group (multi-head attention) q, k and
      v stay views of it and SDPA's saved v keeps the whole buffer alive (e x (q + 2 kv)); with
      grouped queries ``reshape`` after ``expand`` copies, so v is a q-sized copy and the buffer
      is freed. RoPE's ``cat`` makes new q and k (e x q each with grouped queries, e x (q + kv)
      otherwise), SDPA keeps q, k, v, its output (e x q) and an fp32 logsumexp (4 x heads, padded
      as ``memguard_core.estimator.attention.sdpa_lse_per_token`` says for the memory-efficient kernel);
    * MLP (frozen linears keep no input): ``GptNeoxMLP``'s ``F.gelu`` keeps its input (e x I,
      l.356-357); ``LLaMAMLP``'s ``silu(fc_1) * fc_2`` keeps fc_1's output for the silu and both
      factors for the product (3 e x I).

    The bottom block's input needs no gradient (unless a trainable ``StableEmbedding`` feeds it:
    :func:`stable_embedding`): its dropout keeps no mask, its first norm keeps no input (in a
    parallel residual block neither norm, which read the same x), and in a parallel residual block
    its MLP keeps nothing (its input never leads to a trained parameter).
    """
    b = block_of(ms)
    e = DTYPE_BYTES[ts.dtype]
    c, i = ms.hidden_size, ms.intermediate_size
    d = _dims(ms)
    q, kv = d["q"], d["k"]
    parts = lora_parts(ts)
    mha = ms.num_kv_heads == ms.num_heads
    if b.norm == "layernorm":
        norms = e * c
    else:
        norms = 4 * c * (1 if b.parallel_residual else 2)
    drop = ts.lora_dropout > 0
    lora_in = e * c
    mask = dropout_bytes(ts, e) * c if drop else 0
    pad = 0 if parts == {"q", "k", "v"} else e * sum(d[p] for p in parts)
    if mha:
        attn = e * (q + 2 * kv) + e * (q + kv) + e * q
    else:
        attn = e * q * 4  # roped q, roped (expanded) k, the v copy, the output
    backend = cuda_sdpa_backend(ms, ts) if ts.device == "cuda" else "flash"
    lse = sdpa_lse_per_token(ms, ts, backend)
    mlp = e * i if b.mlp == "gelu" else 3 * e * i
    block = norms + lora_in + mask + pad + attn + lse + mlp
    if stable_embedding(ts):
        return Saves(float(block), float(block), float(lse))
    first_norm = norms if b.parallel_residual else norms / 2
    first = block - mask - first_norm - (mlp if b.parallel_residual else 0)
    return Saves(float(block), float(first), float(lse))


def qlora_inputs(ms: ModelSpec, ts: TrainSpec) -> Saves:
    """Bytes per token bitsandbytes' 4-bit linears of one LitGPT block keep beyond
    :func:`block_saves`, under QLoRA with bitsandbytes before 0.43.2.

    Lightning's ``BitsandbytesPrecision`` (``lightning/fabric/plugins/precision/bitsandbytes.py``,
    ``module_init_context``) replaces every ``torch.nn.Linear`` -- the frozen base of the LoRA
    linear, the projection, the MLP's and the head -- with a 4-bit ``Linear4bit``; ``MatMul4Bit``
    keeps its input A as ``ctx.tensors`` whenever an input needs a gradient
    (``bitsandbytes/autograd/_functions.py``; ``memguard_core.estimator.bnb.bnb_4bit_keeps_input``).
    New tensors per block: the qkv input (``norm_1`` output, e x C; with p = 0 ``lora_A`` keeps
    it already), the projection's input (the attention output made contiguous, e x q), the MLP's
    input when it has its own norm (e x C) and the MLP projection's input (e x I). The bottom
    block's qkv linear and, in a parallel residual block, its MLP see inputs without gradient:
    nothing kept there.
    """
    if ts.method != "qlora" or not bnb_4bit_keeps_input(ts):
        return Saves(0.0, 0.0, 0.0)
    b = block_of(ms)
    e = DTYPE_BYTES[ts.dtype]
    c, i = ms.hidden_size, ms.intermediate_size
    qkv_in = e * c if ts.lora_dropout > 0 else 0
    proj_in = e * _dims(ms)["q"]
    mlp = (0 if b.shared_attention_norm else e * c) + e * i
    block = qkv_in + proj_in + mlp
    first = block if stable_embedding(ts) else proj_in + (0 if b.parallel_residual else mlp)
    return Saves(float(block), float(first), 0.0)


def head_moments(ms: ModelSpec, ts: TrainSpec) -> Dict[str, Dict[str, int]]:
    """The head's and the loss's bytes at the moments where a LitGPT LoRA step peaks, beyond the
    blocks' saved tensors: ``{moment: {"logits": ..., "weight_copies": ..., "activations": ...}}``,
    with n = B x T x V elements of logits.

    * ``loss`` (the first chunk's ``log_softmax`` backward): Fabric's ``_FabricModule.forward``
      casts the outputs to the default dtype (``precision.convert_output``, fp32), so the
      ``logits`` list the loop holds is fp32 (4n) until the backward ends, and
      ``chunked_cross_entropy`` keeps each fp32 chunk's ``log_softmax`` output (4n); the chunk's
      backward adds two fp32 chunk-sized gradients (2 x 4 x B x 128 x V);
    * ``forward_end`` (``convert_output`` itself): the e-sized chunks the model returned and their
      fp32 copies (e·n + 4n), beside the previous step's fp32 ``logits`` (4n) and, under QLoRA,
      its quantized linears' kept inputs when the loop keeps the last step's output
      (``TrainSpec.last_graph_kept``: LitGPT's ``fit`` reassigns ``logits = model(...)``,
      00af8b0d ``finetune/lora.py`` l.304-307);
    * ``head_backward`` (QLoRA: the 4-bit head's backward, after every loss node ran): the fp32
      logits, their gradients cast back to e (e·n) and the head's weight dequantized to fp16 then
      cast to e (``MatMul4Bit.backward``: (2 + e) x V x C);
    * ``next_forward`` (QLoRA with the last step's output kept): the previous step's fp32 logits
      and kept inputs beside the new step's head forward -- its e-sized chunks and the dequantized
      head weight.
    ``activations`` are what the moment adds to the blocks: the final norm's saved input (LayerNorm
    e x C, RMSNorm 4 x C per token), the 4-bit head's kept input (e x C, bitsandbytes before
    0.43.2) and the previous step's kept inputs where the moment has them.
    """
    b = block_of(ms)
    e = DTYPE_BYTES[ts.dtype]
    tokens = ts.batch_size * ts.seq_length
    c, v = ms.hidden_size, ms.vocab_size
    n = tokens * v
    chunk = ts.batch_size * min(LM_HEAD_CHUNK, ts.seq_length) * v
    norm_in = (e if b.norm == "layernorm" else 4) * c * tokens
    quant = ts.method == "qlora"
    head_in = e * c * tokens if quant and bnb_4bit_keeps_input(ts) else 0
    kept = ts.last_graph_kept
    prev = 0
    if quant and kept:
        q = qlora_inputs(ms, ts)
        prev = int(tokens * ((ms.num_layers - 1) * q.block + q.first)) + head_in
    here = norm_in + head_in
    out = {"loss": {"logits": 8 * n + 8 * chunk, "weight_copies": 0, "activations": here},
           "forward_end": {"logits": (4 * n if kept else 0) + e * n + 4 * n, "weight_copies": 0,
                           "activations": here + prev}}
    if quant:
        dequant = (2 + e) * v * c
        out["head_backward"] = {"logits": 4 * n + e * n, "weight_copies": dequant, "activations": here}
        if kept:
            out["next_forward"] = {"logits": 4 * n + e * n, "weight_copies": dequant, "activations": here + prev}
    return out


def block_dequant(ms: ModelSpec, ts: TrainSpec) -> int:
    """QLoRA: bytes of the largest block linear dequantized while it runs (fp16 from Lightning's
    ``BitsandbytesPrecision``, then cast to e: (2 + e) x out x in, ``MatMul4Bit``); 0 for LoRA."""
    if ts.method != "qlora":
        return 0
    big = max((ls.in_features * ls.out_features for ls in block_linear_shapes(ms) if not ls.is_param), default=0)
    return (2 + DTYPE_BYTES[ts.dtype]) * big


def weights(ms: ModelSpec, ts: TrainSpec, trainable: int) -> int:
    """Stored weights, bytes: the frozen model in the weights' dtype (``bf16-true``), under QLoRA
    every linear -- the head included, :func:`qlora_inputs` -- as NF4 (4.5 bits, 4.127 with double
    quantization: ``memguard_core.estimator.weights.nf4_storage_bytes``) and the embedding and norms in the
    dtype; the adapters in the dtype too (LitGPT converts the whole module). With the
    ``StableEmbedding`` swap (:func:`stable_embedding`) the old embedding stays too:
    ``finetune/lora.py``'s ``main`` keeps it in a local (``old_embedding``) for the whole run."""
    e = DTYPE_BYTES[ts.dtype]
    p = ms.params
    if ts.method == "qlora":
        quant = p.attention + p.mlp + p.experts + p.lm_head
        b = quant * weight_bits(ms, ts) / 8 + (p.total - quant) * e
    else:
        b = p.total * e
    if stable_embedding(ts):
        b += ms.vocab_size * ms.hidden_size * e
    return int(b + trainable * e)


#: What the loss moment of each head moment is, for the estimate's note.
_HEAD_MOMENTS = {"loss": "the first loss chunk's backward", "head_backward": "the 4-bit head's backward",
                 "forward_end": "the end of the forward (Fabric's fp32 copy of the logits)",
                 "next_forward": "the next forward beside the kept graph"}


def step_terms(ms: ModelSpec, ts: TrainSpec, trainable: int, shared: Dict[str, Any]) -> Tuple[StepTerms, str]:
    """A LitGPT LoRA / QLoRA step's terms (bytes) and the head moment its loss moment is.

    ``shared`` holds the terms the model code does not change (gradients, optimizer, vision, mask,
    runtime). The loss moment is the largest of the moments the step peaks at (:func:`head_moments`:
    the first loss chunk's backward; the 4-bit head's backward; the next forward beside a kept
    graph), each adding its head terms to the blocks'. The head's dense weight exists only while the
    head runs; the backward ends in the bottom block, whose 4-bit linears are dequantized one at a time.
    """
    tokens = ts.batch_size * ts.seq_length
    saves, quant = block_saves(ms, ts), qlora_inputs(ms, ts)
    stable = stable_embedding_terms(ms, ts)
    n = ms.num_layers  # LitGPT adapts every block (check refuses lora_layers)
    per = (n - 1) * (saves.block + quant.block) + saves.first + quant.first
    scores = int(tokens * n * saves.lse)
    heads = head_moments(ms, ts)
    moment = max(heads, key=lambda k: sum(heads[k].values()))
    h = heads[moment]
    return StepTerms(weights=weights(ms, ts, trainable), weight_copies=h["weight_copies"],
                     backward_weight_copies=block_dequant(ms, ts),
                     blocks=int(tokens * (per + stable["per_token"])) - scores, scores=scores, lora=0,
                     one_block=int(tokens * (saves.block + quant.block)), logits=h["logits"],
                     head_inputs=h["activations"], recompute=0, last_step=0,
                     kept_gradient=stable["gradient"], kept_transient=stable["transient"], **shared), moment


def note(ts: TrainSpec, head_moment: str) -> str:
    """The estimate's note on LitGPT's model code and its loss moment (a key of :func:`head_moments`)."""
    return ("LitGPT's model code: fused qkv LoRA on " + ", ".join(sorted(lora_parts(ts)))
            + f", adapters in {ts.dtype}, head in chunks of {LM_HEAD_CHUNK}; the loss moment is "
            + _HEAD_MOMENTS[head_moment])
