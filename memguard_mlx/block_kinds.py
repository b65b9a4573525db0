"""The kinds of block in an mlx_lm model's ``layers``, read from its module tree as
``memguard_torch.block_kinds`` reads a PyTorch model: which blocks the estimator's rules count and
which hold something else (a Mamba mixer, a short convolution, a gated delta net), named so the
estimate never counts them silently. docs/estimator.md, "Block kinds".
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from memguard_core.estimator.specs import BlockKind

__all__ = ["block_kinds", "kind_of"]

#: Class-name endings of the mlx_lm modules the rules count: linears (also the LoRA and quantized
#: ones), norms, attention, MLPs, mixture-of-experts parts, embeddings and position encodings.
_KNOWN_SUFFIXES = ("Linear", "Norm", "RMSNorm", "LayerNorm", "Attention", "MLP", "FeedForward", "GLU", "MoE",
                   "MoeBlock", "SparseMoeBlock", "Experts", "Router", "Gate", "Embedding", "RoPE", "Rope",
                   "Dropout", "Block", "Layer", "DecoderLayer", "TransformerBlock")


def _own_arrays(mod: Any) -> List[str]:
    import mlx.core as mx

    return [k for k, v in mod.items() if isinstance(v, mx.array)]


def _unknown(mod: Any) -> bool:
    """A module the rules cannot count: a convolution, or one holding arrays of its own whose class
    they do not know (a state-space mixer's ``A_log``, ``D``)."""
    import mlx.nn as nn

    if isinstance(mod, (nn.Conv1d, nn.Conv2d)):
        return True
    name = type(mod).__name__
    if not _own_arrays(mod):
        return False
    return not (name.endswith(_KNOWN_SUFFIXES) or "Norm" in name or name.startswith("LoRA"))


def _block_kind(block: Any) -> Tuple[str, bool]:
    for _path, child in block.children().items() if hasattr(block.children(), "items") else []:
        mods = child if isinstance(child, list) else [child]
        for m in mods:
            if hasattr(m, "named_modules") and any(_unknown(sub) for _p, sub in m.named_modules()):
                return type(m).__name__, False
    if _unknown(block):
        return type(block).__name__, False
    return type(block).__name__, True


def kind_of(block: Any) -> str:
    """The kind name :func:`block_kinds` gives ``block`` (the class of the module that sets it apart,
    else the block's own class)."""
    return _block_kind(block)[0]


def block_kinds(model: Any) -> Tuple[BlockKind, ...]:
    """The kinds of ``model.layers`` in order of first appearance (:class:`BlockKind`: name, count,
    whether the rules model it; never traced: the census runs PyTorch's code). ``()`` when the model
    has no ``layers`` list or its tree cannot be read (never raises)."""
    try:
        layers = list(getattr(model, "layers", None) or [])
    except Exception:
        return ()
    order: List[str] = []
    count: Dict[str, int] = {}
    modelled: Dict[str, bool] = {}
    for b in layers:
        try:
            name, known = _block_kind(b)
        except Exception:
            return ()
        if name not in count:
            order.append(name)
            count[name] = 0
            modelled[name] = known
        count[name] += 1
    return tuple(BlockKind(name=n, count=count[n], modelled=modelled[n]) for n in order)
