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
    """What autograd keeps per token in one LitGPT block under LoRA on the fused qkv linear, bytes:
    the norms' inputs, the LoRA input (and its dropout mask), the adapter output's zero padding, the
    attention's roped q / k, v, output and fp32 logsumexp, and the MLP's activation inputs; the
    bottom block (``first``) keeps less, its input needing no gradient unless a trainable
    ``StableEmbedding`` feeds it. Tensor by tensor, with sources: docs/estimator.md, "LitGPT's model code".
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
    :func:`block_saves`, under QLoRA with bitsandbytes before 0.43.2: Lightning's
    ``BitsandbytesPrecision`` makes every linear 4-bit, and ``MatMul4Bit`` keeps its input whenever
    an input needs a gradient (the qkv, projection and MLP inputs; nothing for the bottom block's
    linears whose inputs need none). docs/estimator.md, "LitGPT's model code".
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
    blocks' saved tensors: ``{moment: {"logits": ..., "weight_copies": ..., "activations": ...}}``.

    Moments: ``loss`` (the first chunk's ``log_softmax`` backward beside Fabric's fp32 logits),
    ``forward_end`` (``convert_output``'s fp32 copies, beside the previous step's logits when the
    loop keeps them), and under QLoRA ``head_backward`` (the 4-bit head's backward, its weight
    dequantized) and, with the last step's output kept, ``next_forward``. ``activations`` are the
    final norm's and the 4-bit head's kept inputs (and the previous step's where the moment has
    them). docs/estimator.md, "LitGPT's model code".
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
