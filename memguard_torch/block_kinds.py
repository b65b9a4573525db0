"""The kinds of block in a model's block list, read from its own module tree: which blocks the
estimator's rules count (linears, norms, attention, MLPs, experts, routers) and which hold something
else (a state-space mixer, a convolution, a custom module) that a census of saved tensors must
measure instead (:mod:`memguard_torch.saved_census`). docs/estimator.md, "Block kinds".
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from memguard_core.estimator.specs import BlockKind

__all__ = ["find_blocks", "block_kind", "block_kinds", "with_live_block_kinds"]

#: Class-name endings of the modules the rules count (``memguard_core.estimator.activations``):
#: norms, attention, MLPs, mixture-of-experts parts and the position encodings they use.
_RULE_SUFFIXES = ("Norm", "RMSNorm", "LayerNorm", "Attention", "SdpaAttention", "FlashAttention2", "MLP", "Mlp",
                  "FeedForward", "Experts", "Router", "TopKRouter", "Gate", "Gating", "SparseMoeBlock", "MoeBlock", "MoE",
                  "Moe", "RotaryEmbedding", "Embedding", "Dropout", "Identity", "Activation", "Block", "Layer")
#: Modules whose own parameters the rules count as a linear's (transformers' GPT-2 ``Conv1D`` is a
#: linear with its weight stored transposed; PEFT's LoRA wrappers and their adapter linears).
_LINEAR_LIKE = ("Conv1D", "Linear", "Linear8bitLt", "Linear4bit", "Embedding", "ParametrizedLinear")
#: torch / transformers / PEFT modules that are plumbing, activations or containers.
_PLUMBING_MODULES = ("torch.nn.modules.activation", "torch.nn.modules.container", "torch.nn.modules.dropout",
                     "torch.nn.modules.linear", "torch.nn.modules.normalization", "torch.nn.modules.sparse",
                     "transformers.activations", "peft.tuners.lora.layer", "peft.tuners.tuners_utils")


def find_blocks(model: Any, num_layers: Optional[int] = None) -> List[Any]:
    """The model's blocks: the ``nn.ModuleList`` holding the most parameters (with ``num_layers``
    entries when given, a vision tower's shorter list left aside); ``[]`` when there is none.

    Args:
        model: a ``torch.nn.Module`` (a PEFT wrapper is searched through).
        num_layers: the config's ``num_hidden_layers``, or None.
    """
    import torch.nn as nn

    best: List[Any] = []
    size = -1
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and (not num_layers or len(mod) == num_layers):
            k = sum(p.numel() for p in mod.parameters())
            if k > size:
                best, size = list(mod), k
    return best


def _counted_by_rules(mod: Any) -> bool:
    """Whether the rules count ``mod`` itself: a linear, a norm, an attention / MLP / expert module,
    an activation, a container; not a convolution or an unknown module."""
    import torch.nn as nn

    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return False
    cls = type(mod)
    if cls.__module__ in _PLUMBING_MODULES or cls.__name__ in _LINEAR_LIKE or cls.__name__.endswith("Linear"):
        return True
    name = cls.__name__
    if name.startswith(("lora", "Lora")) or "Norm" in name:
        return True
    return name.endswith(_RULE_SUFFIXES)


def _own_params_known(mod: Any) -> bool:
    """Whether ``mod``'s own (not its children's) parameters are of a kind the rules count: a
    linear's or embedding's weight and bias, a norm's scale, experts' fused weights, a router's
    weight, an attention's few per-head scalars (sinks); not a state-space model's ``A_log`` /
    ``D`` / ``dt_bias`` on its mixer."""
    own = [n for n, _ in mod.named_parameters(recurse=False)]
    if not own:
        return True
    name = type(mod).__name__
    if name in _LINEAR_LIKE or name.endswith("Linear") or "Norm" in name or name.endswith(("Experts", "Router", "TopKRouter", "Gate",
                                                                  "Gating", "Attention", "Embedding")):
        return True
    return type(mod).__module__ in _PLUMBING_MODULES


def _unknown(mod: Any) -> bool:
    """A module the rules cannot count: a convolution, or one holding parameters of a kind they do
    not know (a state-space mixer's ``A_log``). A module without parameters of its own whose
    children are known (BERT's ``SelfOutput``: a linear, a norm, a dropout) is transparent."""
    import torch.nn as nn

    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return True
    if not any(True for _ in mod.parameters(recurse=False)):
        return False
    return not (_counted_by_rules(mod) and _own_params_known(mod))


def block_kind(block: Any) -> Tuple[str, bool]:
    """``(name, modelled)`` of one block: ``modelled`` when no module inside is one the rules cannot
    count (:func:`_unknown`); ``name`` is then the block's class, else the class of the block's
    child that holds the first such module (the token mixer of a hybrid's block: ``Mamba2Mixer``,
    ``Lfm2ShortConv``)."""
    if _unknown(block) and not any(True for _ in block.children()):
        return type(block).__name__, False
    for child in block.children():
        if any(_unknown(m) for m in child.modules()):
            return type(child).__name__, False
    return type(block).__name__, True


def block_kinds(blocks: Sequence[Any]) -> Tuple[Tuple[BlockKind, ...], Dict[str, List[int]]]:
    """The kinds of ``blocks`` in order of first appearance, and the indices of the blocks of each
    kind (name -> indices).

    Returns:
        ``(kinds, indices)``: :class:`memguard_core.estimator.specs.BlockKind` per kind (count,
        modelled; no traced figure yet) and the block indices of each kind's name.
    """
    order: List[str] = []
    modelled: Dict[str, bool] = {}
    indices: Dict[str, List[int]] = {}
    for i, b in enumerate(blocks):
        name, known = block_kind(b)
        if name not in indices:
            order.append(name)
            indices[name] = []
            modelled[name] = known
        indices[name].append(i)
    return tuple(BlockKind(name=n, count=len(indices[n]), modelled=modelled[n]) for n in order), indices


def with_live_block_kinds(model: Any, ms: Any, ts: Any) -> Any:
    """``ms`` with the block kinds of a live ``model`` (read from its module tree); when some kind is
    not modelled and the model carries a transformers config, the census of
    ``memguard_hf.block_trace.with_block_kinds`` (reached as the ``blocks.hf`` feature, so this
    package needs no transformers) measures it on a copy built from that config -- never on the
    live model, whose modules may cache what a forward computes. Never raises: a failure is logged
    on ``memguard.torch`` and ``ms`` comes back as it was, or with the kinds untraced.

    Args:
        model: the unwrapped ``nn.Module`` (PEFT wrappers searched through).
        ms / ts: :class:`ModelSpec` / :class:`TrainSpec` of the run.
    """
    import logging

    log = logging.getLogger("memguard.torch")
    try:
        kinds, _ = block_kinds(find_blocks(model, ms.num_layers))
    except Exception as exc:  # a module tree this reader does not understand
        log.info("block kinds not read (%s: %s)", type(exc).__name__, exc)
        return ms
    ms = ms.replace(block_kinds=kinds)
    cfg = getattr(model, "config", None)
    if all(k.modelled for k in kinds) or not hasattr(cfg, "model_type") or not hasattr(cfg, "to_dict"):
        return ms
    try:
        from memguard_core.features import load

        traced = load("blocks.hf", "hf")(cfg, ms, ts)
    except Exception as exc:  # the hf extra missing, or the census failed
        log.info("blocks %s not traced (%s: %s): counted as rule blocks",
                 ", ".join(k.name for k in kinds if not k.modelled), type(exc).__name__, exc)
        return ms
    # the config's build must find the blocks the live model has; else keep the live reading
    if sum(k.count for k in traced.block_kinds) != sum(k.count for k in kinds):
        return ms
    return traced
