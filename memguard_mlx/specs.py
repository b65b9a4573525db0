"""Introspection of a live MLX model (an ``mlx_lm.models.<arch>.Model``) and of mlx_lm's
``TrainingArgs`` into memguard's ``ModelSpec`` / ``TrainSpec``.

Counting rules (the arrays are read, nothing is typed by hand):

* parameters come from ``mlx.utils.tree_flatten(model.parameters())`` (frozen ones included:
  ``Module.parameters()`` returns every array member, ``trainable_parameters()`` only the unfrozen
  ones -- ``mlx/nn/layers/base.py``);
* a LoRA layer (mlx_lm ``tuner/lora.py`` ``LoRALinear``: ``linear`` + ``lora_a (in, r)`` +
  ``lora_b (r, out)``; ``DoRALinear`` adds ``m``) is counted as its base ``linear``; ``lora_a`` /
  ``lora_b`` / ``m`` go to ``adapter_params``, and the rank is ``lora_a.shape[1]``;
* a quantized linear (``mlx.nn.QuantizedLinear``: ``weight`` uint32 holding ``32 / bits`` values per
  element, one ``scales`` and one ``biases`` entry per ``group_size`` weights -- ``mx.quantize``
  docs) is counted as ``out x in`` real weights with ``in = packed_in * 32 / bits``; its storage
  bits per weight are measured from the arrays' bytes: ``(weight + scales + biases) * 8 / (out*in)``
  (= ``bits + 32 / group_size`` for 16-bit scales/biases);
* kinds by path as the HF route classifies them (``memguard_core.estimator.components.component_kind``); mlx_lm's
  MoE keeps the stacked experts in ``switch_mlp`` (``models/switch_layers.py``), counted as experts.

mlx is imported only inside functions.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional, Tuple

from memguard_core.errors import ConfigError
from memguard_core.estimator.components import component_kind as _component_kind
from memguard_core.estimator.mlx import MlxParamCounts
from memguard_core.estimator.specs import LinearShape, ModelSpec, ParamCounts, TrainSpec, dtype_bits as _dtype_bits

from .block_kinds import block_kinds

logger = logging.getLogger("memguard.mlx")

__all__ = ["model_spec_from_mlx_module", "train_spec", "lora_layers_of", "seq_length_of",
           "optimizer_name"]

_LORA_ARRAYS = ("lora_a", "lora_b", "m")
_EMBED_NAMES = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embedding", "embed_in")
_HEAD_NAMES = ("lm_head", "output", "embed_out")
_MOE_EXPERT_PARTS = ("switch_mlp", "experts")


def _mx_dtype_bits(dtype: Any) -> Optional[float]:
    return _dtype_bits(str(dtype).replace("mlx.core.", ""))


def _is_lora(module: Any) -> bool:
    return hasattr(module, "lora_a") and hasattr(module, "lora_b")


def _is_quantized(module: Any) -> bool:
    return hasattr(module, "scales") and hasattr(module, "bits") and hasattr(module, "group_size")


def _is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def _leaf_modules(model: Any):
    """``(path, module)`` of every module owning arrays directly (mlx ``Module.named_modules``)."""
    return [(p, m) for p, m in model.named_modules()]


def _own_arrays(module: Any) -> Dict[str, Any]:
    """Arrays held directly by ``module`` (not by its children)."""
    import mlx.core as mx

    return {k: v for k, v in module.items() if isinstance(v, mx.array)}


def _real_in_features(module: Any) -> Tuple[int, int]:
    """``(in, out)`` of a (possibly quantized) linear's base weight ``(out, in_packed)``."""
    w = module.weight
    out, inp = int(w.shape[-2]), int(w.shape[-1])
    if _is_quantized(module):
        inp = inp * 32 // int(module.bits)
    return inp, out


def _clean(path: str) -> list:
    """Path parts without indices and without the LoRA wrapper's ``linear`` child."""
    return [p for p in path.split(".") if p and not p.isdigit() and p != "linear"]


def _kind(parts: list, is_moe: bool) -> str:
    if any(p in _MOE_EXPERT_PARTS for p in parts):
        return "experts"
    k = _component_kind(parts, is_moe)
    return "mlp" if k in ("other", "shared_experts") else k


def lora_layers_of(model: Any) -> Dict[str, Any]:
    """LoRA found on ``model``: ``{"rank": r|None, "targets": (names...), "blocks": n,
    "adapter_params": elements, "scale": float|None}`` (mlx_lm ``LoRALinear``/``DoRALinear``/
    ``LoRASwitchLinear``: rank = ``lora_a.shape[-1]``)."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    rank, targets, blocks, adapter, scale = None, set(), set(), 0, None
    for path, mod in model.named_modules():
        if not _is_lora(mod):
            continue
        rank = int(mod.lora_a.shape[-1])
        scale = float(getattr(mod, "scale", 0.0)) if scale is None else scale
        parts = [p for p in path.split(".") if p]
        targets.add(parts[-1] if parts else path)
        nums = [p for p in parts if p.isdigit()]
        if nums:
            blocks.add(int(nums[0]))
        for name in _LORA_ARRAYS:
            a = getattr(mod, name, None)
            if a is not None and hasattr(a, "size"):
                adapter += int(a.size)
    return {"rank": rank, "targets": tuple(sorted(targets)), "blocks": len(blocks),
            "adapter_params": adapter, "scale": scale,
            "num_layers": len(layers) if layers is not None else None}


def _model_args_numbers(model: Any) -> Dict[str, Any]:
    """Config numbers from ``model.args`` (mlx_lm ``ModelArgs``), else from the structure."""
    a = getattr(model, "args", None)

    def get(*names, default=None):
        for n in names:
            v = getattr(a, n, None) if a is not None else None
            if v is not None:
                return v
        return default

    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError("model", "an mlx_lm model with a `layers` list of transformer blocks",
                          type(model).__name__)
    emb = None
    for path, mod in model.named_modules():
        if type(mod).__name__ in ("Embedding", "QuantizedEmbedding"):
            emb = mod
            break
    hidden = get("hidden_size", "dim", "n_embd", "d_model")
    vocab = get("vocab_size")
    if emb is not None:
        vocab = vocab or int(emb.weight.shape[0])
        if hidden is None:
            hidden = int(emb.weight.shape[1]) * (32 // int(emb.bits) if _is_quantized(emb) else 1)
    if hidden is None or vocab is None:
        raise ConfigError("model", "an mlx_lm model with ModelArgs (hidden_size, vocab_size) or an "
                          "embedding", type(model).__name__)
    heads = get("num_attention_heads", "n_heads", "n_head") or max(1, int(hidden) // 64)
    kv = get("num_key_value_heads", "n_kv_heads") or heads
    head_dim = get("head_dim") or int(hidden) // int(heads)
    return dict(hidden_size=int(hidden), vocab_size=int(vocab), num_layers=len(layers),
                num_heads=int(heads), num_kv_heads=int(kv), head_dim=int(head_dim),
                intermediate_size=int(get("intermediate_size", "hidden_dim", default=0) or 0),
                num_experts=int(get("num_local_experts", "num_experts", "n_routed_experts", default=0) or 0),
                num_experts_per_tok=int(get("num_experts_per_tok", default=0) or 0),
                moe_intermediate_size=int(get("moe_intermediate_size", default=0) or 0))


def _block_prefixes(model: Any) -> Dict[str, int]:
    """``{module path: block index}`` of the transformer blocks: the modules in ``model.layers``
    wherever they sit in the tree (``model.layers.3`` in Llama, ``model.h.3`` in GPT-NeoX, whose
    ``Model.layers`` property returns ``model.h``)."""
    ids = {id(b): i for i, b in enumerate(model.layers)}
    return {path: ids[id(mod)] for path, mod in model.named_modules() if id(mod) in ids and path}


def _block_of(path: str, prefixes: Dict[str, int]) -> Tuple[Optional[int], str]:
    """(block index, path inside the block) of a module path, or (None, path) outside the blocks."""
    for pre, i in prefixes.items():
        if path == pre or path.startswith(pre + "."):
            return i, path[len(pre) + 1:]
    return None, path


def model_spec_from_mlx_module(model: Any, args: Any = None, name: Optional[str] = None) -> ModelSpec:
    """``ModelSpec`` of a live MLX language model (mlx_lm ``Model``), LoRA and quantization aware.

    Args:
        model: an ``mlx.nn.Module`` with ``layers`` (the transformer blocks) as mlx_lm models have;
            its ``args`` (``ModelArgs``) gives heads / vocab when present.
        args: optional mlx_lm ``TrainingArgs`` (unused for the count; accepted so call sites can
            pass what they have).
        name: label (default: ``model.args.model_type`` or the class name).

    Returns:
        ModelSpec with ``source="module"``: exact parameter counts by kind (elements; a quantized
        weight counts its real ``out x in`` elements, LoRA arrays are excluded and reported in
        ``adapter_params``), ``block_linears`` of block 0, ``weight_bits`` of the block linears
        measured from the arrays' bytes, ``dense_bits`` of the embedding / norms dtype,
        ``trainable_params`` from ``model.trainable_parameters()``, ``lora_rank_found``.

    Raises:
        ConfigError: not an mlx_lm-like model (no ``layers``, no embedding or ModelArgs numbers).
    """
    from mlx.utils import tree_flatten

    nums = _model_args_numbers(model)
    is_moe = nums["num_experts"] > 0
    counts = dict(embeddings=0, attention=0, mlp=0, experts=0, router=0, norms=0, lm_head=0, other=0,
                  norms_in_blocks=0, norm_weights_in_blocks=0)
    q_elems = q_bytes = 0  # quantized block linears: real elements and stored bytes
    lin_elems = lin_bytes = 0  # all block linears (quantized or not)
    dense_bits = None
    block_lin: Dict[str, dict] = {}
    seen = set()
    prefixes = _block_prefixes(model)
    for path, mod in model.named_modules():
        if _is_lora(mod):
            continue  # its arrays are adapters; the base `linear` child is visited on its own
        own = _own_arrays(mod)
        if not own:
            continue
        block_idx, rel = _block_of(path, prefixes)
        in_block = block_idx is not None
        clean = _clean(rel if in_block else path)
        quant = _is_quantized(mod)
        if quant or (hasattr(mod, "weight") and not _is_norm(mod) and own.get("weight") is not None
                     and own["weight"].ndim >= 2 and type(mod).__name__ not in ("Embedding",)):
            fin, fout = _real_in_features(mod)
            count = int(mod.weight.shape[0]) if mod.weight.ndim == 3 else 1
            n = fin * fout * count
            nbytes = sum(int(v.nbytes) for k, v in own.items() if k != "bias")
            bias = "bias" in own
            nb = int(own["bias"].size) if bias else 0
            is_emb = type(mod).__name__ in ("QuantizedEmbedding",) or any(p in _EMBED_NAMES for p in clean)
            if is_emb:
                counts["embeddings"] += n + nb
                if dense_bits is None and not quant:
                    dense_bits = _mx_dtype_bits(mod.weight.dtype)
                continue
            if not in_block:
                key = "lm_head" if any(p in _HEAD_NAMES for p in clean) else "other"
                counts[key] += n + nb
                continue
            kind = _kind(clean, is_moe)
            counts[kind] += n + nb
            lin_elems += n
            lin_bytes += nbytes
            if quant:
                q_elems += n
                q_bytes += nbytes
            if block_idx == 0:
                bpath = ".".join(clean)
                block_lin.setdefault(bpath, dict(name=clean[-1], in_features=fin, out_features=fout,
                                                 count=count, kind=kind, bias=bias, path=bpath,
                                                 is_param=False))
            continue
        # arrays that are not linear weights: embeddings, norms, biases of other modules
        for k, v in own.items():
            key_id = (path, k)
            if key_id in seen:
                continue
            seen.add(key_id)
            n = int(v.size)
            if type(mod).__name__ == "Embedding" or any(p in _EMBED_NAMES for p in clean):
                counts["embeddings"] += n
                dense_bits = dense_bits or _mx_dtype_bits(v.dtype)
            elif _is_norm(mod):
                counts["norms"] += n
                if in_block:
                    counts["norms_in_blocks"] += n
                    if k == "weight":  # a LayerNorm's bias is no further norm input
                        counts["norm_weights_in_blocks"] += n
                dense_bits = dense_bits or _mx_dtype_bits(v.dtype)
            elif in_block:
                kind = _kind(clean, is_moe)
                counts[kind] += n
            else:
                counts["other"] += n
    trainable = sum(int(v.size) for _, v in tree_flatten(model.trainable_parameters()))
    lora = lora_layers_of(model)
    tied = counts["lm_head"] == 0
    dense = float(dense_bits or 32.0)
    if q_elems:
        wbits = q_bytes * 8.0 / q_elems if q_elems == lin_elems else lin_bytes * 8.0 / max(1, lin_elems)
    else:
        wbits = lin_bytes * 8.0 / lin_elems if lin_elems else dense
    if nums["intermediate_size"] == 0:
        ups = [v["out_features"] for v in block_lin.values() if v["name"] in ("gate_proj", "up_proj", "w1", "fc1")]
        nums["intermediate_size"] = max(ups) if ups else 4 * nums["hidden_size"]
    a = getattr(model, "args", None)
    label = name or str(getattr(a, "model_type", None) or type(model).__name__)
    lin_shapes = tuple(LinearShape(**v) for v in block_lin.values())
    return ModelSpec(name=label, model_type=str(getattr(a, "model_type", None) or type(model).__name__),
                     params=MlxParamCounts(**counts), block_linears=lin_shapes, tie_word_embeddings=tied,
                     weight_bits=float(round(wbits, 4)), dense_bits=dense, trainable_params=trainable,
                     lora_rank_found=lora["rank"], adapter_params=lora["adapter_params"],
                     source="module", block_kinds=block_kinds(model), **nums)


def optimizer_name(optimizer: Any) -> str:
    """memguard optimizer name of an ``mlx.optimizers`` instance (class name; SGD with momentum
    keeps one state per parameter: ``sgd-momentum``)."""
    cls = type(optimizer).__name__.lower()
    if cls == "adamw":
        return "adamw"
    if cls in ("adam", "adamax", "lion", "adabelief"):
        return "adam" if cls == "adam" else "adamw"
    if cls == "sgd":
        mom = getattr(optimizer, "momentum", 0.0)
        try:
            mom = float(mom)
        except Exception:
            mom = 0.0
        return "sgd-momentum" if mom else "sgd"
    if cls == "adafactor":
        return "adafactor"
    logger.warning("memguard: optimizer %s is not modelled; estimating it as adamw", type(optimizer).__name__)
    return "adamw"


def seq_length_of(dataset: Any, max_seq_length: int, scan_rows: int = 2048) -> int:
    """Tokens one forward sees, as mlx_lm's ``iterate_batches`` builds them: rows padded to
    ``1 + 32 * ceil(longest / 32)`` capped at ``max_seq_length``, and ``default_loss`` feeds
    ``batch[:, :-1]``: so ``min(1 + 32 * ceil(L / 32), max_seq_length) - 1`` for the longest of the
    first ``scan_rows`` rows (``CacheDataset.itemlen`` or ``len(dataset[i][0])``)."""
    longest = 0
    try:
        n = min(len(dataset), scan_rows)
        itemlen = getattr(dataset, "itemlen", None)
        for i in range(n):
            if itemlen is not None:
                L = int(itemlen(i))
            else:
                row = dataset[i]
                L = len(row[0]) if isinstance(row, tuple) else len(row)
            longest = max(longest, L)
    except Exception:
        logger.debug("memguard: could not scan the dataset for lengths", exc_info=True)
    if not longest:
        return max(1, int(max_seq_length) - 1)
    padded = min(1 + 32 * math.ceil(longest / 32), int(max_seq_length))
    return max(1, padded - 1)


def _dtype_name(model: Any) -> str:
    from mlx.utils import tree_flatten

    for k, v in tree_flatten(model.parameters()):
        if "norm" in k or k.endswith("embed_tokens.weight"):
            b = str(v.dtype)
            return "bf16" if "bfloat16" in b else "fp16" if "float16" in b else "fp32"
    return "fp32"


def _trained_blocks(model: Any) -> int:
    """Blocks of ``model.layers`` holding at least one trainable (unfrozen) array."""
    from mlx.utils import tree_flatten

    return sum(1 for block in model.layers if tree_flatten(block.trainable_parameters()))


def train_spec(model: Any, optimizer: Any, args: Any, model_spec: ModelSpec, *,
                         train_dataset: Any = None, seq_length: Optional[int] = None) -> TrainSpec:
    """``TrainSpec`` of an mlx_lm run: micro-batch ``args.batch_size``, accumulation
    ``args.grad_accumulation_steps``, ``grad_checkpoint``, the sequence length of the data (see
    :func:`seq_length_of`, or ``seq_length``), method (``qlora`` for quantized blocks with LoRA,
    ``lora`` when adapters are found, else ``full``), LoRA rank / targets / number of blocks found on
    the model (a full fine-tune of the last n blocks only, mlx_lm ``num_layers``: ``lora_layers=n``), the optimizer's class, the weights' dtype; ``framework="mlx"``, ``device="mlx"``
    (the estimate predicts ``mx.get_peak_memory()``).

    Raises:
        ConfigError: invalid numbers in ``args``.
    """
    lora = lora_layers_of(model)
    if lora["rank"] is not None:
        method = "qlora" if model_spec.weight_bits < 8 else "lora"
    else:
        method = "full"
    if seq_length is None:
        seq_length = seq_length_of(train_dataset, args.max_seq_length) if train_dataset is not None \
            else max(1, int(args.max_seq_length) - 1)
    kw: Dict[str, Any] = {}
    if method != "full":
        kw["lora_rank"] = lora["rank"]
        if lora["targets"]:
            kw["lora_targets"] = lora["targets"]
        if lora["blocks"] and lora["blocks"] < model_spec.num_layers:
            kw["lora_layers"] = lora["blocks"]
    else:
        trained = _trained_blocks(model)
        if 0 < trained < model_spec.num_layers:
            kw["lora_layers"] = trained  # mlx_lm's full fine-tune unfreezes the last num_layers blocks
    return TrainSpec(batch_size=int(args.batch_size), seq_length=int(seq_length),
                     grad_accum=int(args.grad_accumulation_steps), method=method,
                     optimizer=optimizer_name(optimizer), dtype=_dtype_name(model), mixed_precision=False,
                     grad_checkpoint=bool(args.grad_checkpoint), attn_impl="sdpa", framework="mlx",
                     device="mlx", **kw)
