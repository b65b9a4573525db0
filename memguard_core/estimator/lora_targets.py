"""PEFT's default LoRA targets per model type (``LoraConfig(target_modules=None)``), read from the
installed peft's source without importing it, with a copy of its table as the fall-back.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Optional

from .specs import ModelSpec, PeftDefaultTargets, TrainSpec

_log = logging.getLogger("memguard.spec")


#: PEFT's ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` (peft/utils/constants.py, peft
#: 0.21.2), used only when peft is not installed; with peft the installed table is read.
_PEFT_LORA_TARGETS_FALLBACK = {
    "t5": ["q", "v"], "mt5": ["q", "v"], "bart": ["q_proj", "v_proj"], "gpt2": ["c_attn"],
    "bloom": ["query_key_value"], "blip-2": ["q", "v", "q_proj", "v_proj"], "opt": ["q_proj", "v_proj"],
    "gptj": ["q_proj", "v_proj"], "gpt_neox": ["query_key_value"], "gpt_neo": ["q_proj", "v_proj"],
    "bert": ["query", "value"], "roberta": ["query", "value"], "xlm-roberta": ["query", "value"],
    "electra": ["query", "value"], "deberta-v2": ["query_proj", "value_proj"], "deberta": ["in_proj"],
    "layoutlm": ["query", "value"], "llama": ["q_proj", "v_proj"], "llama4": ["q_proj", "v_proj"],
    "chatglm": ["query_key_value"], "gpt_bigcode": ["c_attn"], "mpt": ["Wqkv"],
    "RefinedWebModel": ["query_key_value"], "RefinedWeb": ["query_key_value"], "falcon": ["query_key_value"],
    "btlm": ["c_proj", "c_attn"], "codegen": ["qkv_proj"], "mistral": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"], "stablelm": ["q_proj", "v_proj"], "phi": ["q_proj", "v_proj", "fc1", "fc2"],
    "gemma": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"], "gemma3_text": ["q_proj", "v_proj"],
    "gemma4": r".*language_model\..*\.(q_proj|v_proj)", "qwen2": ["q_proj", "v_proj"],
    "qwen3": ["q_proj", "v_proj"], "nemotron_h": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "rwkv": ["key", "value", "receptance", "output"],
    "rwkv7": ["r_proj", "k_proj", "v_proj", "o_proj", "key", "value"],
}
_PEFT_MAPPING_NAME = "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"


def _peft_lora_mapping() -> tuple:
    """(mapping, where it came from). peft/utils/constants.py imports torch and transformers, so its
    source is read (``ast.literal_eval`` of the dict) without importing it, whether or not peft is
    imported (the core imports no framework); the vendored copy when peft is not installed or the file
    has changed shape."""
    try:
        import ast
        import importlib.util

        found = importlib.util.find_spec("peft")  # locates the package, imports nothing
        locs = list(found.submodule_search_locations or []) if found is not None else []
        if locs:
            with open(os.path.join(locs[0], "utils", "constants.py"), encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == _PEFT_MAPPING_NAME
                                                        for t in node.targets):
                    return ast.literal_eval(node.value), "peft"
    except Exception as exc:  # an unreadable or reshaped peft: the vendored table
        _log.debug("peft's LoRA target table not read: %s", exc)
    return _PEFT_LORA_TARGETS_FALLBACK, "memguard's copy of peft 0.21.2"


def peft_default_lora_targets(model_type: Any) -> Optional[tuple]:
    """The modules PEFT adapts for ``LoraConfig(target_modules=None)`` on a model of
    ``model_type``: ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type]``
    (peft/utils/constants.py; applied in peft/tuners/tuners_utils.py
    ``BaseTuner._prepare_adapter_config``), read from the installed peft at call time without
    importing it (a copy of peft 0.21.2's table without peft).

    Returns:
        tuple of module names (gpt2 -> ``("c_attn",)``, gpt_neox -> ``("query_key_value",)``,
        llama -> ``("q_proj", "v_proj")``); a regex entry (gemma4's) yields the names of its last
        alternation group. ``None`` for a model type PEFT has no default for (PEFT then raises
        "Please specify `target_modules`").
    """
    mapping, _ = _peft_lora_mapping()
    names = mapping.get(str(model_type)) if model_type else None
    if isinstance(names, str):
        m = re.search(r"\(([\w|]+)\)\$?$", names)
        names = m.group(1).split("|") if m else None
    if not names or not all(isinstance(n, str) and n for n in names):
        return None
    return tuple(names)


def with_default_lora_targets(model_spec: "ModelSpec", train_spec: "TrainSpec") -> "TrainSpec":
    """``train_spec`` with PEFT's default LoRA targets for ``model_spec``'s model type when it
    was built without ``lora_targets`` (:data:`DEFAULT_LORA_TARGETS`); ``train_spec`` itself
    when targets were given, the method is ``full``, the spec comes from plain numbers (no model
    type: ``q_proj, v_proj`` stay), PEFT has no default for the type, or LitGPT's model code runs
    (``model_code="litgpt"``: its own default, ``memguard_core.estimator.litgpt.lora_parts``). ``estimate``
    and ``plan`` call it first. Imports nothing."""
    if not isinstance(train_spec.lora_targets, PeftDefaultTargets) or train_spec.method == "full" \
            or getattr(model_spec, "source", None) == "numbers" or train_spec.model_code == "litgpt":
        return train_spec
    names = peft_default_lora_targets(getattr(model_spec, "model_type", None))
    if names is None:
        return train_spec
    return train_spec.replace(lora_targets=names)
