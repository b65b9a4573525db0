"""Reading the task head (``memguard_core.estimator.heads.TaskHead``) off a torch model -- a live one
or the meta-device build of a config -- from its class and its module tree. torch is imported
inside functions only. docs/estimator.md, "Task heads".
"""

from __future__ import annotations

from typing import Any, List, Optional

from memguard_core.estimator.heads import (CAUSAL_LM, DEFAULT_HEAD, MASKED_LM, QUESTION_ANSWERING,
                                           SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, TaskHead, head_kind_of)

from .train_reading import peft_base


def _head_children(model: Any, base: Any) -> List[Any]:
    """The model's direct children other than its base model (``bert``, ``model``): the head's
    modules (``classifier``, ``score``, ``qa_outputs``, ``cls``, a ``pooler`` outside the base)."""
    return [m for _, m in model.named_children() if m is not base]


# Module-path parts of PEFT's adapters and copies (``lora_A``, ``modules_to_save.default``): not the
# head's own linears.
_PEFT_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout",
                         "modules_to_save"})


def _head_linears(children: List[Any]) -> List[tuple]:
    """``(index of the child, path inside it, linear)`` for every ``nn.Linear`` of the head's
    modules, in registration order, PEFT's adapters and ``modules_to_save`` copies left out."""
    import torch.nn as nn

    return [(i, path, x) for i, top in enumerate(children) for path, x in top.named_modules()
            if isinstance(x, nn.Linear) and not (set(path.split(".")) & _PEFT_PARTS)]


#: The modules PEFT's task types put in ``modules_to_save`` (peft/peft_model.py
#: ``PeftModelFor{SequenceClassification,TokenClassification,QuestionAnswering}``).
_PEFT_TASK_MODULES = {SEQUENCE_CLASSIFICATION: ("classifier", "score"),
                      TOKEN_CLASSIFICATION: ("classifier", "score"), QUESTION_ANSWERING: ("qa_outputs",)}


def _saved_by_peft_task(name: str) -> bool:
    """PEFT's ``SEQ_CLS`` task type trains the module at ``name`` (dotted, from the model): it puts
    ``classifier`` and ``score`` in ``modules_to_save`` (peft/peft_model.py
    ``PeftModelForSequenceClassification``), matched as name suffixes of the module or of a module
    above it (peft/utils/other.py ``_set_trainable``: ``key.endswith(target_key)``), so DistilBERT's
    ``pre_classifier`` trains too."""
    parts = [p for p in name.split(".") if p not in ("original_module", "base_layer")]
    suffixes = _PEFT_TASK_MODULES[SEQUENCE_CLASSIFICATION]
    return any(".".join(parts[:k]).endswith(suffixes) for k in range(1, len(parts) + 1))


def _peft_saved_params(model: Any, kind: str) -> int:
    """Elements PEFT trains beside the adapters of a model with a ``kind`` head (copies in
    ``modules_to_save``). On a model PEFT already wrapped: what its ``ModulesToSaveWrapper`` modules
    hold (each one's ``original_module``, whatever its name: a user's ``lm_head`` too; 0 when the
    LoRA config set no task type and no ``modules_to_save``). On a plain or meta-device build: the
    modules PEFT's task type for ``kind`` would put there, those whose dotted name ends with one of
    :data:`_PEFT_TASK_MODULES` (a string suffix, as peft/utils/other.py ``_set_trainable`` matches
    ``key.endswith(target_key)``), each counted once with what it holds."""
    names = list(model.named_modules())
    wrappers = [mod for _, mod in names if hasattr(mod, "original_module") and hasattr(mod, "modules_to_save")]
    if wrappers or any(set(n.split(".")) & _PEFT_PARTS for n, _ in names):
        return sum(int(p.numel()) for w in wrappers for n, p in w.original_module.named_parameters()
                   if not set(n.split(".")) & _PEFT_PARTS)
    suffixes = _PEFT_TASK_MODULES.get(kind)
    if not suffixes:
        return 0
    total, done = 0, []
    for name, mod in names:
        if any(name == d or name.startswith(d + ".") for d in done) or not name.endswith(suffixes):
            continue
        total += sum(int(p.numel()) for p in mod.parameters())
        done.append(name)
    return total


def _dropouts(mods: List[Any]) -> List[float]:
    import torch.nn as nn

    return [float(m.p) for top in mods for m in top.modules() if isinstance(m, nn.Dropout)]


def _is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def task_head_from_module(model: Any, kind: Optional[str] = None) -> TaskHead:
    """The task head of a transformers model (PEFT-wrapped or not).

    Args:
        model: the ``*For<Task>`` module (its class names the head: ``head_kind_of``).
        kind: the head kind when the caller knows it (``--head``); ``None`` reads it from the class.

    Returns:
        :data:`memguard_core.estimator.heads.DEFAULT_HEAD` for a causal LM (or a class naming no
        head); otherwise a ``TaskHead`` whose fields come from the module tree: ``num_labels``
        from the head's last linear (``classifier``, ``score``, ``out_proj``, ``qa_outputs``),
        ``final_norm`` from a norm among the base model's direct children (``model.norm``,
        ``transformer.ln_f``), ``reads`` / ``pooler_linear`` / ``pooler_trains`` from a ``pooler`` (BERT, ALBERT,
        DeBERTa-v2) or a head of more than one linear (RoBERTa, ELECTRA, DistilBERT), ``dropout``
        the largest dropout probability in the head, ``transform`` a hidden-to-hidden linear in an
        LM head (BERT's ``BertPredictionHeadTransform``), ``peft_saved_params`` the elements of the
        head modules PEFT's task type trains under LoRA (``_peft_saved_params``).

    Raises:
        ConfigError: (field ``architectures``, one line) a class naming a head the estimator does
            not count (``DeiTForImageClassificationWithTeacher``, ``ViTForMaskedImageModeling``).
    """
    import torch.nn as nn

    m = peft_base(model)
    arch = type(m).__name__
    kind = kind or head_kind_of(arch) or CAUSAL_LM
    if kind == CAUSAL_LM:
        return DEFAULT_HEAD
    base = getattr(m, "base_model", m)
    children = _head_children(m, base) if base is not m else []
    names = [n for n, c in m.named_children() if c is not base]
    hidden = getattr(getattr(m, "config", None), "hidden_size", None)
    found = _head_linears(children)
    linears = [x for _, _, x in found]
    final_norm = base is not m and any(_is_norm(c) for _, c in base.named_children())
    pooler = getattr(base, "pooler", None)
    pooler = pooler if isinstance(pooler, nn.Module) else next(
        (c for n, c in m.named_children() if n == "pooler"), None)
    dropout = max(_dropouts(children + ([pooler] if pooler is not None else [])), default=0.0)
    if kind == MASKED_LM:
        transform = any(x.in_features == x.out_features == hidden for x in linears)
        return TaskHead(kind=kind, final_norm=final_norm, transform=transform, architecture=arch)
    labels = int(linears[-1].out_features) if linears else int(getattr(m.config, "num_labels", 2))
    if kind == QUESTION_ANSWERING:
        labels = 2
    reads, pooler_linear, pooler_trains = "all_tokens", False, False
    if kind == SEQUENCE_CLASSIFICATION:
        # a pooler, or more than the one classifier linear (RoBERTa's dense + out_proj, DistilBERT's
        # pre_classifier + classifier), reads the first token; the decoders' lone ``score`` every one
        if pooler is not None:
            reads, pooler_linear = "first_token", not any(p > 0 for p in _dropouts([pooler]))
        elif len(found) > 1:
            i, path = found[0][:2]  # the head module holding the first linear
            reads, pooler_linear = "first_token", not any(p > 0 for p in _dropouts([children[i]]))
            pooler_trains = _saved_by_peft_task(f"{names[i]}.{path}".rstrip("."))
    return TaskHead(kind=kind, num_labels=max(labels, 1), reads=reads, final_norm=final_norm,
                    pooler_linear=pooler_linear, pooler_trains=pooler_trains, dropout=min(dropout, 0.99),
                    architecture=arch, peft_saved_params=_peft_saved_params(m, kind))
