"""Model and training specifications: what the estimator and the planner reason about.

``ModelSpec`` describes the architecture (shapes and exact parameter counts by kind);
``TrainSpec`` the training settings. Build a ``ModelSpec`` by introspection, never by hand:
``model_spec_from_hf_config`` (a config.json path, a dict or an ``AutoConfig``, counted exactly on
the meta device), ``model_spec_from_module`` (a live ``torch.nn.Module``, PEFT and bitsandbytes
aware) or ``model_spec_from_numbers`` (the fields of ``ml-memguard``'s ``preflight(...)``).

This module imports no framework at import time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from .errors import ConfigError, require_choice, require_positive_int

METHODS = ("full", "lora", "qlora")
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adafactor", "adamw-8bit", "paged-adamw-8bit",
              "paged-adamw-32bit")
#: Optimizer names as users spell them -> ``OPTIMIZERS`` (HF ``TrainingArguments.optim`` values,
#: ``transformers/training_args.py`` ``OptimizerNames``; underscores read as hyphens first).
OPTIMIZER_ALIASES = {"adamw-torch": "adamw", "adamw-torch-fused": "adamw", "adamw-bnb-8bit": "adamw-8bit",
                     "paged-adamw": "paged-adamw-32bit"}
#: The optimizers whose states bitsandbytes pages to CUDA unified memory (``bnb.optim.PagedAdamW*``).
PAGED_OPTIMIZERS = ("paged-adamw-8bit", "paged-adamw-32bit")
DTYPES = ("fp32", "bf16", "fp16")
FRAMEWORKS = ("hf", "lightning", "mlx", "torch")
#: Whose model code runs: transformers' modules (+ PEFT), or LitGPT's own (``memguard_core._litgpt``).
MODEL_CODES = ("transformers", "litgpt")
#: Data-parallel memory layouts (memguard_core/sharding.py says what each divides and adds).
SHARDINGS = ("none", "ddp", "fsdp-full", "fsdp-grad-op", "fsdp-hybrid", "fsdp-no-shard", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "params")
DEVICES = ("cpu", "cuda", "mlx", "mps")
ATTN_IMPLS = ("eager", "sdpa", "flash")


class _PeftDefaultTargets(tuple):
    """The LoRA targets of a ``TrainSpec`` built without ``lora_targets``: read as ``q_proj, v_proj``
    until :func:`with_default_lora_targets` replaces them by PEFT's default for the model type.
    Unequal to the same names given explicitly, so specs that resolve differently never compare
    (or hash) equal."""

    __slots__ = ()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _PeftDefaultTargets) and tuple.__eq__(self, other)

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("peft-default", tuple(self)))

    def __repr__(self) -> str:
        return f"DEFAULT_LORA_TARGETS{tuple.__repr__(self)}"


#: ``TrainSpec.lora_targets`` when none are given: PEFT's default for the model type
#: (:func:`peft_default_lora_targets`) wherever the model type is known; ``q_proj, v_proj`` for
#: a spec from plain numbers or a model type PEFT has no default for.
DEFAULT_LORA_TARGETS = _PeftDefaultTargets(("q_proj", "v_proj"))

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
    """(mapping, where it came from). peft/utils/constants.py imports torch and transformers, so
    unless peft is already imported its source is read (``ast.literal_eval`` of the dict) without
    importing it; the vendored copy when peft is not installed or the file has changed shape."""
    mod = sys.modules.get("peft.utils.constants")
    if mod is not None and isinstance(getattr(mod, _PEFT_MAPPING_NAME, None), dict):
        return getattr(mod, _PEFT_MAPPING_NAME), "peft"
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
    (``model_code="litgpt"``: its own default, ``memguard_core._litgpt.lora_parts``). ``estimate``
    and ``plan`` call it first. Imports nothing."""
    if not isinstance(train_spec.lora_targets, _PeftDefaultTargets) or train_spec.method == "full" \
            or getattr(model_spec, "source", None) == "numbers" or train_spec.model_code == "litgpt":
        return train_spec
    names = peft_default_lora_targets(getattr(model_spec, "model_type", None))
    if names is None:
        return train_spec
    return train_spec.replace(lora_targets=names)


@dataclass(frozen=True)
class LinearShape:
    """One linear projection inside a transformer block.

    Attributes:
        name: module name as frameworks spell it (``q_proj``, ``c_attn``, ``gate_proj``, ...).
        in_features / out_features: weight shape is ``(out_features, in_features)``.
        count: how many such modules one block holds (``num_experts`` for expert weights).
        kind: ``attention`` | ``mlp`` | ``experts`` | ``router`` | ``shared_experts``.
        bias: whether the projection has a bias vector.
        path: dotted path inside the block, expert indices removed (``self_attn.q_proj``,
            ``mlp.experts.gate_up_proj``); LoRA targets match it the way PEFT matches module
            names (equal, or a ``.``-suffix). Empty: ``name`` is used.
        is_param: a bare weight tensor rather than a module (transformers 5 fused experts,
            ``(E, out, in)``): PEFT reaches it only through ``target_parameters`` by a dotted
            name (``experts.gate_up_proj``), never through ``target_modules`` or ``all-linear``.
    """

    name: str
    in_features: int
    out_features: int
    count: int = 1
    kind: str = "attention"
    bias: bool = False
    path: str = ""
    is_param: bool = False

    @property
    def params(self) -> int:
        return self.count * (self.in_features * self.out_features + (self.out_features if self.bias else 0))


@dataclass(frozen=True)
class ParamCounts:
    """Exact parameter counts by kind (elements, not bytes). Tied weights are counted once
    (``lm_head`` is 0 when the head is tied to the input embedding).

    ``attention``, ``mlp``, ``experts``, ``router`` and ``norms`` cover all blocks together;
    ``norms`` also holds the final norm; ``embeddings`` holds token (and learned position) embeddings.
    ``vision`` holds a vision-language model's vision tower and multimodal projector (everything
    outside the language model's blocks whose module path names the vision side, see
    ``_VISION_PARTS``); frozen under LoRA unless the targets reach its linears (``all-linear``, or
    names PEFT's suffix rule matches there: ``ModelSpec.vision_tower``), which then get adapters.
    """

    embeddings: int = 0
    attention: int = 0
    mlp: int = 0
    experts: int = 0
    router: int = 0
    norms: int = 0
    lm_head: int = 0
    other: int = 0
    vision: int = 0

    # norms of the blocks only (a subset of ``norms``, without the final norm)
    norms_in_blocks: int = 0

    @property
    def total(self) -> int:
        return (self.embeddings + self.attention + self.mlp + self.experts + self.router
                + self.norms + self.lm_head + self.other + self.vision)

    @property
    def blocks(self) -> int:
        """Parameters inside the transformer blocks (what mlx_lm's full fine-tune trains)."""
        return self.attention + self.mlp + self.experts + self.router + self.norms_in_blocks

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("norms_in_blocks")
        return d


@dataclass(frozen=True)
class VisionTower:
    """The vision tower (ViT) and projector of a vision-language model, as the estimator needs them
    when LoRA reaches their linears (:func:`vision_tower_from_config`).

    Attributes:
        model_type: the VLM's ``model_type`` (the family whose modeling file the rules follow).
        hidden_size / intermediate_size / num_layers / num_heads: the tower's blocks.
        patches_per_image: tokens the blocks run on per image, all tiles together, before any merger
            or pixel shuffle, at the image size :func:`image_tokens_per_image` assumes.
        projector_tokens: tokens the projector's linears run on per image (after a merger / pixel
            shuffle / pooling).
        norm: ``layernorm`` | ``rmsnorm`` (the blocks' pre-norms).
        act: the MLP's activation: ``quick_gelu`` | ``gelu`` (exact or tanh) | ``silu_gated``.
        block_linears: the linears of ONE block, ``path`` relative to the block (``attn.qkv``,
            ``self_attn.q_proj``, ``mlp.fc1``).
        projector_linears: the projector's linears (``path`` from the VLM's vision-side module name:
            ``merger.mlp.0``, ``multi_modal_projector.linear_1``), ``in_features`` per projector token.
        projector_norm: features of the norm ahead of the projector's first linear, per projector
            token (Qwen2-VL's ``ln_q``; 0: none).
        projector_act: features of the activation between the projector's two linears (0: none).
        extra_patch_features: further hidden-sized tensors per patch the tower saves outside its
            blocks once they need a gradient (a final ``post_layernorm``, Gemma-3's average pool).
        unused_linears: linears PEFT wraps whose output never reaches the loss (a SigLIP pooling
            ``head`` with ``vision_use_head``): adapters, no activations.
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patches_per_image: int
    projector_tokens: int
    norm: str = "layernorm"
    act: str = "gelu"
    block_linears: tuple = ()
    projector_linears: tuple = ()
    projector_norm: int = 0
    projector_act: int = 0
    extra_patch_features: int = 0
    unused_linears: tuple = ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // max(self.num_heads, 1)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, as the memory estimator needs it.

    Attributes:
        name: free-form label (model id or config path).
        model_type: HF ``model_type`` (``llama``, ``gpt2``, ``qwen2``, ``mixtral``, ...).
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim:
            the usual config numbers (``num_kv_heads < num_heads`` is GQA).
        num_experts / num_experts_per_tok / moe_intermediate_size: MoE routing (0 for dense).
        tie_word_embeddings: lm_head shares the input embedding.
        params: exact counts by kind (see ``ParamCounts``).
        block_linears: the linear projections of ONE block (used for LoRA sizes and LoRA
            input buffers); blocks are assumed homogeneous.
        weight_bits: storage bits of the block linear weights (32, 16, 8, 4.5 for NF4,
            4.127 for NF4 with double quantization). Embeddings, head and norms are never
            quantized and are stored in ``dense_bits``.
        dense_bits: storage bits of non-quantized weights (32 for fp32, 16 for bf16/fp16).
        trainable_params: exact count of trainable parameters when known from a live module
            (``None``: derive it from the TrainSpec).
        lora_rank_found: LoRA rank found on a live PEFT module (``None`` if none).
        adapter_params: elements of adapter tensors (LoRA A/B, DoRA magnitudes, PEFT
            ``modules_to_save`` copies) found on a live module; not part of ``params``.
        source: ``hf-config`` | ``module`` | ``numbers``.
        attention_dropout: dropout probability on the attention probabilities in training
            (config ``attention_dropout`` / ``attn_pdrop``; see ``dropout_probabilities``).
        residual_dropout: dropout probability on each sub-layer's output before the residual add
            (``resid_pdrop`` / ``hidden_dropout`` / ``residual_dropout`` / OPT's ``dropout``).
        embedding_dropout: dropout probability on the embedding output (``embd_pdrop`` /
            ``embedding_dropout``).
        attn_logit_softcapping / final_logit_softcapping: Gemma-2's ``tanh`` soft-capping of the
            attention scores / of the logits (the config's cap; 0.0 = none).
        weight_dtype: the stored dtype the source declares (``fp32`` | ``bf16`` | ``fp16``; the
            config's ``torch_dtype``, a live module's embedding dtype), ``None`` when unknown.
            For specs not read from a live module the TrainSpec decides what is counted: see
            :func:`weights_for_training`.
        max_position_embeddings: the longest sequence the positions cover (config
            ``max_position_embeddings`` / ``n_positions``; 0 when unknown).
        image_tokens: tokens one image adds to the language model's sequence for a
            vision-language model (:func:`image_tokens_per_image`; 0 for text-only models).
        vision_tower: the vision tower's numbers (:class:`VisionTower`), read from the config of a
            supported vision-language family; ``None`` for text-only models and families whose
            tower memguard does not read (Mllama).
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    params: ParamCounts
    block_linears: tuple = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    weight_bits: float = 16.0
    dense_bits: float = 16.0
    trainable_params: Optional[int] = None
    lora_rank_found: Optional[int] = None
    source: str = "numbers"
    adapter_params: int = 0
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    weight_dtype: Optional[str] = None
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    max_position_embeddings: int = 0
    image_tokens: int = 0
    vision_tower: Optional[VisionTower] = None

    @property
    def total_params(self) -> int:
        return self.params.total

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class TrainSpec:
    """Training settings that drive memory.

    Attributes:
        batch_size: micro-batch size (rows one forward pass sees), >= 1.
        seq_length: tokens per row (padded length), >= 1.
        grad_accum: gradient accumulation steps (effective batch = batch_size x grad_accum x world_size).
        method: ``full`` | ``lora`` | ``qlora``.
        lora_rank: LoRA rank r.
        lora_targets: module names LoRA wraps, or ``("all-linear",)``. Not given (or ``None``):
            PEFT's default for the model type (``LoraConfig(target_modules=None)``:
            :func:`peft_default_lora_targets`, gpt2 ``c_attn``, llama ``q_proj, v_proj``), applied by
            ``estimate`` / ``plan`` (:func:`with_default_lora_targets`); ``q_proj, v_proj`` for a
            model from plain numbers.
        lora_layers: LoRA on the last N blocks only (mlx_lm's ``num_layers``); ``None`` = all.
        lora_dropout: PEFT ``LoraConfig.lora_dropout``, a probability in [0, 1). With p > 0 each
            LoRA'd linear runs ``lora_A(dropout(x))``: ``lora_A`` saves the dropout's output (a
            tensor per linear) and the dropout its mask (``estimate._lora_input_bytes``).
        optimizer: ``adam`` | ``adamw`` | ``sgd`` (no momentum, as HF's ``sgd``) | ``sgd-momentum`` |
            ``adafactor`` | ``adamw-8bit`` | ``paged-adamw-8bit`` | ``paged-adamw-32bit`` (bitsandbytes
            paged AdamW: the states of tensors from 1e5 elements on live in CUDA unified memory,
            outside ``torch.cuda.max_memory_allocated``). HF ``optim`` spellings are accepted
            (``paged_adamw_8bit``, ``paged_adamw_32bit``, ``adamw_8bit``, ``adamw_bnb_8bit``,
            ``adamw_torch``: :data:`OPTIMIZER_ALIASES`).
        dtype: compute dtype: ``fp32`` | ``bf16`` | ``fp16``. Without ``mixed_precision`` it is
            also the dtype the weights are stored in (pure bf16: weights created in bf16); the
            estimate counts them so for any spec not read from a live module
            (:func:`weights_for_training`).
        mixed_precision: weights kept in fp32 with autocast to ``dtype`` (HF ``bf16=True`` on fp32
            weights). False: weights are stored in ``dtype``.
        grad_checkpoint: activation (gradient) checkpointing per block.
        attn_impl: ``eager`` (O(s^2) scores kept) | ``sdpa`` | ``flash`` (O(s)).
        framework: ``hf`` | ``lightning`` | ``mlx`` | ``torch`` (whose conventions apply; ``torch`` is
            a plain PyTorch / accelerate loop: HF's without the ``Trainer``'s imports).
        device: which counter the estimate predicts: ``cpu`` (peak RSS, VmHWM), ``cuda`` (peak
            device memory incl. context), ``mlx`` (``mx.get_peak_memory()``), ``mps`` (PyTorch on
            Apple Silicon: ``torch.mps.driver_allocated_memory()``; not validated on a Mac).
        world_size: data-parallel processes (the effective batch; with ``sharding`` the shard group).
            ``ranks`` is its deprecated name (accepted by the constructor and readable, with a
            ``DeprecationWarning``).
        sharding: how the ranks lay out the model state (``memguard_core.sharding``): ``none`` (one
            process, or ranks that each hold everything without DDP's buckets) | ``ddp`` |
            ``fsdp-full`` | ``fsdp-grad-op`` | ``fsdp-hybrid`` | ``fsdp-no-shard`` | ``zero1`` |
            ``zero2`` | ``zero3``. ``peak_bytes`` is then per rank.
        offload: ``none`` | ``optimizer`` (ZeRO ``offload_optimizer``) | ``params`` (FSDP
            ``CPUOffload(Policy)``, ZeRO-3 ``offload_param``; implies the optimizer's).
        shard_group_size: ranks one shard spans under ``fsdp-hybrid`` (HSDP's shard mesh dimension);
            ``None`` = ``world_size``.
        bucket_cap_mb: DDP ``bucket_cap_mb`` (MiB, default 25 as in ``DistributedDataParallel``).
        gradient_as_bucket_view: DDP ``gradient_as_bucket_view`` (``.grad`` are views of the buckets).
        fsdp_version: 2 (``fully_shard``) | 1 (``FullyShardedDataParallel``, flat parameters).
        zero_buckets: DeepSpeed bucket sizes a config sets (elements: its numbers, DeepSpeed's
            defaults for the keys it leaves out; not its "auto" ones), overriding the
            framework's values (``memguard_core.sharding.zero_buckets``): keys ``reduce``,
            ``allgather``, ``prefetch``, ``max_live``, ``persistence`` (integers >= 0) and
            ``overlap_comm`` (bool); only with ``zero1``..``zero3``. ``None`` = none set.
        resident_file_bytes: this process's file-backed resident pages (``RssFile``: mapped
            libraries) when training starts, bytes, as the adapters read it on Linux; ``None`` =
            the typical figure of :data:`memguard_core.estimate.CPU_FILE_PAGES_AT_START_BYTES`. It
            is part of VmHWM and depends on the page cache, not on the model (a freshly written
            copy of a venv reads higher): docs/estimator.md, "Runtime overhead".
        image_tokens: image tokens per row of a vision-language model, on top of ``seq_length``
            (the text tokens): the language model's sequence is ``seq_length + image_tokens``
            (images per row x :attr:`ModelSpec.image_tokens`); 0 for text-only rows.
        heap_trim: ``device="cpu"`` only: True (default) for a run that hands glibc's free heap back
            to the kernel at every optimizer step's end, as memguard's guard does
            (``GuardOptions.trim_heap``, which also fixes glibc's mmap threshold for a bf16 / fp16
            mixture-of-experts model: :func:`routed_half_precision_on_cpu`); False for a plain
            run, whose later steps also keep
            resident the pages the last step's freed tensors left (under activation checkpointing
            the last step's gradients: docs/estimator.md, "Gradient checkpointing on CPU").
        bnb_version: the bitsandbytes version of a QLoRA run (``"0.42.0"``); it decides whether
            each 4-bit linear keeps its input for the backward (before 0.43.2) or not
            (``memguard_core.estimate.bnb_4bit_keeps_input``). ``None`` = unknown: the older rule,
            the larger estimate. The HF adapter passes the installed version.
        keeps_last_graph: the training loop holds the last micro-batch's output (logits, loss)
            until the next forward returns -- a hand-written loop's ``logits = model(x)``
            reassigned each step -- so that step's autograd graph lives on. ``None`` = by
            framework: True for ``torch`` and for ``model_code="litgpt"`` (LitGPT's
            ``finetune/lora.py``), False for ``hf`` / ``lightning`` (their training steps hand a
            detached loss on). It matters only where the graph holds tensors the backward
            does not free (bitsandbytes before 0.43.2: ``estimate._bnb_last_step_inputs``).
        model_code: whose model code runs: ``transformers`` (transformers' modules, LoRA by PEFT;
            the default) | ``litgpt`` (LitGPT's own ``GPT`` and ``LoRAQKVLinear`` under its
            ``finetune/lora.py``: LoRA / QLoRA on the fused qkv linear, adapters in the weights'
            dtype, the head in chunks, Lightning's bitsandbytes precision quantizing every linear;
            ``memguard_core._litgpt`` says what it covers and refuses the rest).
        litgpt_version: the LitGPT release of a ``model_code="litgpt"`` run (``"0.4.13"``); from
            0.5.0 on its QLoRA swaps in a trainable ``StableEmbedding``
            (``memguard_core._litgpt.stable_embedding``). ``None`` = the current LitGPT.
    """

    batch_size: int = 1
    seq_length: int = 512
    grad_accum: int = 1
    method: str = "lora"
    lora_rank: int = 8
    lora_targets: tuple = DEFAULT_LORA_TARGETS
    lora_layers: Optional[int] = None
    lora_dropout: float = 0.0
    optimizer: str = "adamw"
    dtype: str = "bf16"
    mixed_precision: bool = False
    grad_checkpoint: bool = False
    attn_impl: str = "sdpa"
    framework: str = "hf"
    device: str = "cpu"
    world_size: int = 1
    resident_file_bytes: Optional[int] = None
    image_tokens: int = 0
    sharding: str = "none"
    offload: str = "none"
    shard_group_size: Optional[int] = None
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    fsdp_version: int = 2
    zero_buckets: Optional[Dict[str, Any]] = dataclasses.field(default=None, hash=False)
    bnb_version: Optional[str] = None
    keeps_last_graph: Optional[bool] = None
    heap_trim: bool = True
    model_code: str = "transformers"
    litgpt_version: Optional[str] = None
    ranks: dataclasses.InitVar[Optional[int]] = None

    def __post_init__(self, ranks: Optional[int] = None) -> None:
        if ranks is not None:
            from ._deprecation import warn_renamed

            require_positive_int("ranks", ranks)
            warn_renamed("ranks", "world_size", stacklevel=4)
            if self.world_size not in (1, ranks):
                raise ConfigError("ranks", f"not given together with world_size={self.world_size} (its new name)",
                                  ranks)
            object.__setattr__(self, "world_size", ranks)
        require_positive_int("batch_size", self.batch_size)
        rf = self.resident_file_bytes
        if rf is not None and (isinstance(rf, bool) or not isinstance(rf, int) or rf < 0):
            raise ConfigError("resident_file_bytes", "an integer >= 0 (bytes) or None", rf)
        require_positive_int("seq_length", self.seq_length)
        require_positive_int("grad_accum", self.grad_accum)
        it = self.image_tokens
        if isinstance(it, bool) or not isinstance(it, int) or it < 0:
            raise ConfigError("image_tokens", "an integer >= 0 (image tokens per row)", it)
        require_positive_int("world_size", self.world_size)
        object.__setattr__(self, "method", require_choice("method", self.method, METHODS))
        object.__setattr__(self, "optimizer", require_choice("optimizer", optimizer_alias(self.optimizer), OPTIMIZERS))
        bv = self.bnb_version
        if bv is not None and not (isinstance(bv, str) and re.match(r"\s*\d+\.\d+", bv)):
            raise ConfigError("bnb_version", "a bitsandbytes version such as '0.42.0', or None", bv)
        if not isinstance(self.heap_trim, bool):
            raise ConfigError("heap_trim", "True (the guard returns the free heap at every step's end) or False",
                              self.heap_trim)
        lv = self.litgpt_version
        if lv is not None and not (isinstance(lv, str) and re.match(r"\s*\d+\.\d+", lv)):
            raise ConfigError("litgpt_version", "a LitGPT version such as '0.5.13', or None", lv)
        klg = self.keeps_last_graph
        if klg is not None and not isinstance(klg, bool):
            raise ConfigError("keeps_last_graph", "True, False or None (by framework)", klg)
        object.__setattr__(self, "dtype", require_choice("dtype", self.dtype, DTYPES))
        object.__setattr__(self, "attn_impl", require_choice("attn_impl", self.attn_impl, ATTN_IMPLS))
        object.__setattr__(self, "framework", require_choice("framework", self.framework, FRAMEWORKS))
        object.__setattr__(self, "model_code", require_choice("model_code", self.model_code, MODEL_CODES))
        object.__setattr__(self, "device", require_choice("device", self.device, DEVICES))
        from .sharding import validate_sharding  # the per-rank rules live there

        validate_sharding(self)
        if self.method != "full":
            require_positive_int("lora_rank", self.lora_rank)
        if self.lora_layers is not None:
            require_positive_int("lora_layers", self.lora_layers)
        ld = self.lora_dropout
        if isinstance(ld, bool) or not isinstance(ld, (int, float)) or not 0.0 <= float(ld) < 1.0:
            raise ConfigError("lora_dropout", "a probability p with 0 <= p < 1 (PEFT LoraConfig.lora_dropout)", ld)
        object.__setattr__(self, "lora_dropout", float(ld))
        targets = self.lora_targets
        if isinstance(targets, _PeftDefaultTargets):
            return  # PEFT's default, resolved against the model (with_default_lora_targets)
        if targets is None:  # as LoraConfig(target_modules=None)
            object.__setattr__(self, "lora_targets", DEFAULT_LORA_TARGETS)
            return
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError("lora_targets", "a non-empty list of module names or 'all-linear'",
                              self.lora_targets)
        object.__setattr__(self, "lora_targets", tuple(targets))

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step: micro-batch x accumulation x world_size."""
        return self.batch_size * self.grad_accum * self.world_size

    @property
    def paged(self) -> bool:
        """A bitsandbytes paged optimizer (:data:`PAGED_OPTIMIZERS`): its large states live in CUDA
        unified memory, outside the caching allocator's counters."""
        return self.optimizer in PAGED_OPTIMIZERS

    @property
    def last_graph_kept(self) -> bool:
        """``keeps_last_graph``, or by framework when None: a plain ``torch`` loop keeps it."""
        if self.keeps_last_graph is not None:
            return self.keeps_last_graph
        # LitGPT's finetune/lora.py writes ``logits = model(...)`` every iteration
        return self.framework == "torch" or self.model_code == "litgpt"

    def replace(self, **changes: Any) -> "TrainSpec":
        """A copy with ``changes`` (field names; ``ranks`` is the deprecated ``world_size``)."""
        # ranks=None: dataclasses.replace would otherwise read the deprecated alias back
        return dataclasses.replace(self, **{"ranks": None, **changes})


def optimizer_alias(name: Any) -> Any:
    """``name`` as :data:`OPTIMIZERS` spells it: lower case, underscores read as hyphens, HF
    ``optim`` spellings mapped (:data:`OPTIMIZER_ALIASES`: ``paged_adamw_8bit`` ->
    ``paged-adamw-8bit``, ``adamw_bnb_8bit`` -> ``adamw-8bit``); anything else is returned as
    given (``TrainSpec`` then names the choices)."""
    if not isinstance(name, str):
        return name
    n = name.strip().lower().replace("_", "-")
    n = OPTIMIZER_ALIASES.get(n, n)
    return n if n in OPTIMIZERS else name


def _ranks(self: TrainSpec) -> int:
    from ._deprecation import warn_renamed

    warn_renamed("ranks", "world_size")
    return self.world_size


# the constructor's ``ranks`` (an InitVar) stays; reading it gives world_size, with a warning (use
# TrainSpec.replace, not dataclasses.replace, which would read it back)
TrainSpec.ranks = property(_ranks, doc="Deprecated alias of ``world_size``.")


# ---------------------------------------------------------------------------------------------
# Introspection
# ---------------------------------------------------------------------------------------------
#
# One classifier serves the three routes, so a spec counted from a config.json, from a live
# module and (where it can) from bare numbers splits its parameters the same way.

_log = logging.getLogger("memguard.spec")

# Storage bits of a quantized block-linear weight, including the per-block constants.
# NF4 (bitsandbytes, QLoRA): 4 bits per weight + one fp32 absmax per block of 64 weights
#   = 4 + 32/64 = 4.5.  Dettmers et al. 2023, "QLoRA", section 2 (blocksize 64).
# NF4 with double quantization: the absmax are themselves quantized to 8 bits with one fp32
#   constant per 256 of them: 4 + 8/64 + 32/(64*256) = 4.127 (QLoRA, section 2, "Double
#   Quantization": 0.127 bits per parameter).
# MLX affine quantization (mlx.nn.quantize, group_size 64, one fp16/bf16 scale and one bias per
#   group): b + 2*16/64 = b + 0.5 bits, which for b = 4 equals NF4's 4.5.
NF4_BITS = 4.5
NF4_DOUBLE_QUANT_BITS = 4.0 + 8.0 / 64 + 32.0 / (64 * 256)
GROUP64_OVERHEAD_BITS = 0.5

_DTYPE_BITS = {
    "float32": 32.0, "fp32": 32.0, "float": 32.0, "float64": 64.0, "double": 64.0,
    "bfloat16": 16.0, "bf16": 16.0, "float16": 16.0, "fp16": 16.0, "half": 16.0,
    "int8": 8.0, "uint8": 8.0, "float8_e4m3fn": 8.0, "float8_e5m2": 8.0,
}

_ROUTER_NAMES = frozenset({"gate", "router", "shared_expert_gate", "e_score_correction_bias"})
_SHARED_EXPERT_NAMES = frozenset({"shared_expert", "shared_experts", "shared_mlp"})
_MLP_NAMES = frozenset({"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "feedforward"})
_LORA_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B",
                         "lora_magnitude_vector", "lora_dropout"})


#: torch dtype names -> the estimator's dtype names.
_DTYPE_NAMES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def weights_for_training(model_spec: "ModelSpec", train_spec: "TrainSpec") -> "ModelSpec":
    """The model spec with its stored weights in the dtype the training settings imply.

    The contract: without ``mixed_precision`` the weights are stored in ``train_spec.dtype`` (pure
    bf16 / fp16 / fp32 training: HF ``from_pretrained(..., dtype=torch.bfloat16)`` and no
    ``bf16=True`` autocast); with ``mixed_precision`` they are fp32 masters and ``dtype`` is only
    the autocast dtype. A config's ``torch_dtype`` says how the checkpoint was saved, not how a
    user loads it, so it yields to the TrainSpec; a spec read from a live module
    (``source="module"``) keeps the dtypes it found (they are what will train). Quantized block
    linears (``weight_bits`` < 16: NF4, int8) keep their storage; the rest of the model
    (embeddings, head, norms) follows the rule above.

    Returns:
        ``model_spec`` itself when nothing changes, else a copy with ``dense_bits`` /
        ``weight_bits`` / ``weight_dtype`` set.
    """
    if model_spec.source == "module":
        return model_spec
    want = 32.0 if train_spec.mixed_precision else _DTYPE_BITS[train_spec.dtype]
    name = "fp32" if train_spec.mixed_precision else train_spec.dtype
    quantized = model_spec.weight_bits < 16
    wbits = model_spec.weight_bits if quantized else want
    if (model_spec.dense_bits, model_spec.weight_bits, model_spec.weight_dtype) == (want, wbits, name):
        return model_spec
    return model_spec.replace(dense_bits=want, weight_bits=wbits, weight_dtype=name)


def routed_half_precision_on_cpu(model_spec: "ModelSpec", train_spec: "TrainSpec") -> bool:
    """True for a mixture-of-experts model (``model_spec.is_moe``) whose matmuls run in bf16 or
    fp16 (pure or autocast: ``train_spec.dtype``) on torch's CPU backend (``train_spec.device``
    ``"cpu"``, framework not ``mlx``).

    Such a run allocates tensors of new sizes every step (each expert's rows follow the router) and
    its reduced-precision matmuls go to oneDNN, whose per-shape primitive caches place small
    long-lived entries among the step's temporaries (ATen ``mkldnn_matmul``; ideep's
    ``LRU_CACHE_CAPACITY`` and oneDNN's ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1,024 entries each).
    Under glibc's dynamic mmap threshold the freed space between them stays resident within the
    step: the guard pins the threshold for these runs (``GuardOptions.trim_heap``;
    docs/estimator.md, "MoE in bf16 on CPU").
    """
    return bool(model_spec.is_moe) and train_spec.device == "cpu" and train_spec.framework != "mlx" \
        and train_spec.dtype in ("bf16", "fp16")


def _dtype_bits(dtype: Any) -> Optional[float]:
    """Bits per element of a torch dtype or dtype name (``torch.bfloat16``, ``"bfloat16"``)."""
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "").strip().lower()
    return _DTYPE_BITS.get(name)


def _component_kind(parts: list, is_moe: bool) -> str:
    """Kind of a parameter inside a block from its dotted path (numeric parts removed).

    Order matters: router before experts (``mlp.gate``), shared experts before experts.
    """
    if is_moe and any(p in _ROUTER_NAMES for p in parts):
        return "router"
    if any(p in _SHARED_EXPERT_NAMES for p in parts):
        return "shared_experts"
    if "experts" in parts:
        return "experts"
    if any("attn" in p.lower() or "attention" in p.lower() for p in parts):
        return "attention"
    if any(p in _MLP_NAMES or "mlp" in p.lower() or "ffn" in p.lower() for p in parts):
        return "mlp"
    return "other"


#: Module names of a vision-language model's vision side (transformers 5 modeling code:
#: Qwen2-VL / Qwen2.5-VL ``model.visual`` (its ``merger`` inside), LLaVA / Gemma-3 / Mllama
#: ``model.vision_tower`` or ``vision_model`` + ``model.multi_modal_projector``, SmolVLM / Idefics3
#: ``model.vision_model`` + ``model.connector``, LLaVA-NeXT ``image_newline``).
_VISION_PARTS = frozenset({"visual", "vision_tower", "vision_model", "vision_encoder", "vision_embed_tokens",
                           "multi_modal_projector", "mm_projector", "vision_projector", "connector",
                           "image_newline", "vision"})


def _is_vision_path(parts: list) -> bool:
    """True when a parameter's module path (outside the blocks) lies on the vision side."""
    return any(p in _VISION_PARTS for p in parts)


def _is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower()


def _clean_path(path: str) -> str:
    """Drop PEFT wrapper parts (``base_layer``, ``original_module``) from a module path."""
    return ".".join(p for p in path.split(".") if p not in ("base_layer", "original_module"))


def _real_numel(param: Any, module: Any = None) -> int:
    """Element count of the weight a parameter stands for.

    bitsandbytes ``Params4bit`` stores two 4-bit values per uint8 byte in a flattened
    ``(n/2, 1)`` tensor; its ``quant_state.shape`` is the original shape
    (bitsandbytes/functional.py ``quantize_4bit``). Without a quant state (not yet quantized,
    still on the CPU) the tensor holds the real shape.
    """
    if type(param).__name__ == "Params4bit":
        qs = getattr(param, "quant_state", None)
        shape = getattr(qs, "shape", None)
        if shape is not None:
            return int(math.prod(shape))
        if param.dtype.is_floating_point:  # not quantized yet: real shape
            return int(param.numel())
        if module is not None and hasattr(module, "in_features") and hasattr(module, "out_features"):
            return int(module.in_features) * int(module.out_features)
        return int(param.numel()) * 2
    return int(param.numel())


def _find_blocks(model: Any, num_layers: Optional[int]):
    """The ``nn.ModuleList`` holding the transformer blocks: ``(prefix, modulelist)``.

    The list with ``num_layers`` entries (when known) holding the most parameters.
    """
    import torch.nn as nn

    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            if num_layers and len(mod) != num_layers:
                continue
            n = sum(p.numel() for p in mod.parameters())
            if best is None or n > best[2]:
                best = (name, mod, n)
    if best is None:
        return None, None
    return best[0], best[1]


def _linear_in_out(module: Any) -> Optional[tuple]:
    """(in_features, out_features, bias) of a linear-like module, else None.

    ``nn.Linear`` (and subclasses: bitsandbytes ``Linear4bit``/``Linear8bitLt``) holds weight
    ``(out, in)``; HF's ``Conv1D`` (transformers/pytorch_utils.py, GPT-2) holds weight ``(in, out)``
    with ``nx = in`` and ``nf = out``.
    """
    import torch.nn as nn

    if isinstance(module, nn.Linear):
        return int(module.in_features), int(module.out_features), module.bias is not None
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        nx = getattr(module, "nx", None)
        if nx is None:
            nx = module.weight.shape[0]
        return int(nx), int(module.nf), getattr(module, "bias", None) is not None
    return None


def _block_linears(block: Any, hidden_size: int, is_moe: bool) -> tuple:
    """Linear projections of one block as ``LinearShape`` s (expert copies merged, count=E)."""
    import torch.nn as nn

    found: dict = {}  # path -> [LinearShape fields]

    def add(path: str, name: str, fin: int, fout: int, bias: bool, kind: str, count: int = 1,
            is_param: bool = False) -> None:
        if path in found:
            found[path]["count"] += count
        else:
            found[path] = dict(name=name, in_features=fin, out_features=fout, count=count,
                               kind=kind, bias=bias, path=path, is_param=is_param)

    for mpath, mod in block.named_modules():
        parts = mpath.split(".") if mpath else []
        if any(p in _LORA_PARTS for p in parts) or "modules_to_save" in parts:
            continue
        if isinstance(mod, nn.Embedding) or _is_norm(mod):
            continue
        clean = [p for p in _clean_path(mpath).split(".") if p and not p.isdigit()]
        lin = _linear_in_out(mod)
        if lin is not None:
            kind = _component_kind(clean, is_moe)
            if kind == "other":
                kind = "mlp"
            add(".".join(clean), clean[-1] if clean else mpath, lin[0], lin[1], lin[2], kind)
            continue
        # Bare weights owned directly by a non-Linear module: fused experts (3D) and routers (2D).
        own = dict(mod.named_parameters(recurse=False))
        for pname, p in own.items():
            if pname.endswith("_bias") or pname == "bias":
                continue
            ppath = ".".join(clean + [pname]) if pname != "weight" else ".".join(clean)
            pparts = ppath.split(".")
            kind = _component_kind(pparts, is_moe)
            if kind == "other":
                kind = "mlp"
            if p.dim() == 3:
                # Fused expert weights (transformers 5, e.g. MixtralExperts.gate_up_proj of shape
                # (E, 2*I, H) used as F.linear weight; gpt-oss stores (E, H, 2*I)). The hidden
                # size is the input of gate/up and the output of down.
                e, a, b = (int(s) for s in p.shape)
                if "down" in pname:
                    fout = hidden_size if hidden_size in (a, b) else a
                    fin = b if fout == a else a
                else:
                    fin = hidden_size if hidden_size in (a, b) else b
                    fout = a if fin == b else b
                has_bias = (pname + "_bias") in own
                add(ppath, pname, fin, fout, has_bias, "experts" if kind != "shared_experts" else kind,
                    count=e, is_param=True)
            elif p.dim() == 2 and pname == "weight":
                has_bias = "bias" in own and own["bias"] is not None
                add(ppath, pparts[-1], int(p.shape[1]), int(p.shape[0]), has_bias, kind,
                    is_param=False)
    return tuple(LinearShape(**f) for f in found.values())


def _count_params(model: Any, *, num_layers: Optional[int], hidden_size: int, is_moe: bool,
                  tied: Optional[bool]) -> dict:
    """Count a model's parameters by kind from ``named_parameters``.

    Args:
        tied: ``True``/``False`` forces whether ``lm_head`` shares the input embedding (the config
            route: a meta-device build in transformers 5 leaves the head untied); ``None`` trusts
            the module (``named_parameters`` lists a shared tensor once).

    Returns a dict: ``counts`` (``ParamCounts``), ``block_linears``, ``adapter_params``,
    ``trainable`` (elements with ``requires_grad``, adapters included), ``lora_rank`` (max
    ``lora_A`` rank or None), ``quant`` (``None`` | ``"nf4"`` | ``"nf4-dq"`` | ``"int8"``),
    ``linear_bits`` (dtype bits of the block linear weights), ``embed_bits``, ``num_blocks``,
    ``block_prefix`` (dotted name of the block list, ``None`` when none was found) and
    ``per_block`` (block index -> dict of the elements that block adds to each ``ParamCounts``
    field, plus ``trainable``; a parameter listed once under several blocks counts in the first).
    """
    import torch.nn as nn

    modules = dict(model.named_modules())
    prefix, blocks = _find_blocks(model, num_layers)
    block_re = re.compile(r"^" + re.escape(prefix) + r"\.(\d+)\.") if prefix else None

    emb_in = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        emb_out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except Exception:  # some heads raise NotImplementedError
        emb_out = None
    emb_in_w = getattr(emb_in, "weight", None)
    out_ids = {id(p) for p in emb_out.parameters()} if emb_out is not None else set()

    c = dict(embeddings=0, attention=0, mlp=0, experts=0, router=0, norms=0, lm_head=0, other=0,
             vision=0, norms_in_blocks=0)
    adapter = trainable = 0
    per_block: dict = {}
    lora_dims: list = []
    quant = None
    linear_bits = None
    embed_bits = _dtype_bits(getattr(emb_in_w, "dtype", None))

    for pname, p in model.named_parameters():
        parts = pname.split(".")
        mpath = ".".join(parts[:-1])
        owner = modules.get(mpath)
        n = _real_numel(p, owner)
        if p.requires_grad:
            trainable += n
        if any(q in _LORA_PARTS for q in parts) or "modules_to_save" in parts:
            adapter += n
            if "lora_A" in parts and p.dim() == 2:
                lora_dims.append(int(p.shape[0]))
            continue
        tname = type(p).__name__
        if tname == "Params4bit":
            qs = getattr(p, "quant_state", None)
            dq = bool(getattr(qs, "nested", False) or getattr(p, "compress_statistics", False))
            quant = "nf4-dq" if dq else (quant or "nf4")
        elif tname == "Int8Params" and quant is None:
            quant = "int8"
        if id(p) in out_ids and p is not emb_in_w:  # a head tied in place is the embedding
            if tied and emb_in_w is not None and p is not emb_in_w and tuple(p.shape) == tuple(emb_in_w.shape):
                continue  # the head shares the embedding: counted once, there
            c["lm_head"] += n
            continue
        m = block_re.match(pname) if block_re else None
        if m is not None:
            bc = per_block.setdefault(int(m.group(1)), dict.fromkeys(c, 0))
            bc.setdefault("trainable", 0)
            if p.requires_grad:
                bc["trainable"] += n
            if _is_norm(owner):
                c["norms"] += n
                c["norms_in_blocks"] += n
                bc["norms"] += n
                bc["norms_in_blocks"] += n
                continue
            rel = _clean_path(pname[m.end():])
            rparts = [q for q in rel.split(".") if not q.isdigit()]
            kind = _component_kind(rparts[:-1] if rparts[-1] in ("weight", "bias") else rparts, is_moe)
            if kind == "shared_experts":
                kind = "mlp"
            elif kind == "other" and owner is not None and _linear_in_out(owner) is not None:
                kind = "mlp"  # a block linear outside any named sub-module (OPT's fc1/fc2)
            if kind in ("attention", "mlp", "experts") and p.dim() >= 2 and linear_bits is None \
                    and tname not in ("Params4bit", "Int8Params"):
                linear_bits = _dtype_bits(p.dtype)
            c[kind] += n
            bc[kind] += n
            continue
        if _is_vision_path(parts[:-1]):
            c["vision"] += n
        elif isinstance(owner, nn.Embedding) or owner is emb_in:
            c["embeddings"] += n
        elif owner is not None and _is_norm(owner):
            c["norms"] += n
        else:
            c["other"] += n

    # The rank is the most common lora_A height: PEFT's lora_A is nn.Linear(in, r) (weight (r, in)),
    # but a fused-expert ParamWrapper stacks the experts' A matrices as (r * E, in).
    lora_rank = max(set(lora_dims), key=lambda d: (lora_dims.count(d), -d)) if lora_dims else None
    linears = ()
    if blocks is not None and len(blocks):
        linears = _block_linears(blocks[len(blocks) - 1], hidden_size, is_moe)
    return dict(counts=ParamCounts(**c), block_linears=linears, adapter_params=adapter,
                trainable=trainable, lora_rank=lora_rank, quant=quant, linear_bits=linear_bits,
                embed_bits=embed_bits, num_blocks=len(blocks) if blocks is not None else 0,
                block_prefix=prefix if blocks is not None else None, per_block=per_block)


def _cfg_get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


#: Config fields of the three dropout probabilities, first present one wins. From the config
#: classes of transformers 5.x: ``GPT2Config`` / ``GPTJConfig`` / ``PhiConfig`` / ``Phi3Config``
#: (``attn_pdrop`` / ``attention_dropout``, ``resid_pdrop``, ``embd_pdrop``), ``LlamaConfig`` and
#: its descendants (``attention_dropout`` only), ``OPTConfig`` (``attention_dropout``, ``dropout``
#: after the attention and after ``fc2``), ``GPTNeoXConfig`` / ``StableLmConfig`` / ``FalconConfig``
#: / ``BloomConfig`` (``hidden_dropout``), ``Starcoder2Config`` (``residual_dropout``,
#: ``embedding_dropout``), ``GPTNeoConfig`` (``resid_dropout``, ``embed_dropout``).
DROPOUT_FIELDS = {
    "attention_dropout": ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout"),
    "residual_dropout": ("resid_pdrop", "residual_dropout", "hidden_dropout", "resid_dropout",
                         "hidden_dropout_prob", "dropout"),
    "embedding_dropout": ("embd_pdrop", "embedding_dropout", "embed_dropout"),
}


def dropout_probabilities(cfg: Any) -> dict:
    """The dropout probabilities a transformers config applies in training, by role
    (``attention_dropout``, ``residual_dropout``, ``embedding_dropout``; 0.0 when the config has
    none), read through ``DROPOUT_FIELDS``. A value that is not a number in [0, 1) reads as 0.0
    (some configs keep a module name or None there)."""
    out = {}
    for role, names in DROPOUT_FIELDS.items():
        v = 0.0
        for n in names:
            x = getattr(cfg, n, None)
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                v = float(x) if 0.0 <= float(x) < 1.0 else 0.0
                break
        out[role] = v
    return out


#: Image tokens per image a vision-language decoder sees, when the config does not fix it, by
#: model type: the family's documented default resolution. Qwen2-VL / Qwen2.5-VL resize each image
#: dynamically (processor ``min_pixels`` .. ``max_pixels``); 448 x 448 px -> (448 / 14)^2 patches /
#: ``spatial_merge_size``^2 = 256 tokens is counted (``Qwen2VLImageProcessor``: one token per 28 x 28
#: px). Mllama feeds the image through cross-attention layers, so the decoder sequence does not grow.
IMAGE_TOKENS_DEFAULT_PX = {"qwen2_vl": 448, "qwen2_5_vl": 448, "qwen3_vl": 448}
#: Tiles one image becomes at the processor's default settings, by model type: Idefics3 / SmolVLM
#: split an image into up to 4 x 4 tiles plus a downscaled global view (``do_image_splitting=True``,
#: ``max_image_size`` = 4 tiles per edge: ``Idefics3ImageProcessor``); LLaVA-NeXT's ``anyres`` adds up
#: to 2 x 2 grid tiles to the base view (``image_grid_pinpoints`` up to 672 x 672).
IMAGE_TILES_DEFAULT = {"idefics3": 17, "smolvlm": 17, "llava_next": 5}


def image_tokens_per_image(cfg: Any) -> int:
    """Tokens one image adds to the language model's sequence, from a vision-language config
    (0 for a text-only config and for cross-attention models such as Mllama).

    Rules (transformers 5 configs / processors): ``mm_tokens_per_image`` (Gemma-3: 256);
    ``image_seq_len`` (Idefics3 / SmolVLM); else ``(image_size / patch_size)^2`` patches of the
    vision config, divided by ``scale_factor^2`` (Idefics3 / SmolVLM pixel shuffle) or by
    ``spatial_merge_size^2`` (Qwen2-VL merger), with LLaVA's ``vision_feature_select_strategy``
    "default" dropping the CLS token (576 for LLaVA-1.5's 336 px / 14); Qwen2-VL-style dynamic
    resolution at ``IMAGE_TOKENS_DEFAULT_PX``; times the tiles of ``IMAGE_TILES_DEFAULT`` where the
    family's processor splits an image by default.
    """
    if not _is_vision_language(cfg) or cfg.model_type == "mllama":
        return 0
    return IMAGE_TILES_DEFAULT.get(cfg.model_type, 1) * _tokens_per_tile(cfg)


def _tokens_per_tile(cfg: Any) -> int:
    for key in ("mm_tokens_per_image", "image_seq_len", "image_seq_length"):
        v = getattr(cfg, key, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return int(v)
    vc = cfg.vision_config
    patch = getattr(vc, "patch_size", None) or 14
    size = getattr(vc, "image_size", None) or IMAGE_TOKENS_DEFAULT_PX.get(cfg.model_type, 448)
    if isinstance(size, (list, tuple)):
        size = size[0]
    n = (int(size) // int(patch)) ** 2
    merge = getattr(vc, "spatial_merge_size", None)
    scale = getattr(cfg, "scale_factor", None) or getattr(vc, "scale_factor", None)
    if isinstance(merge, int) and merge > 1:
        n //= merge * merge
    elif isinstance(scale, int) and scale > 1:
        n //= scale * scale
    return int(n)


#: Vision-language families whose tower :func:`vision_tower_from_config` reads, by ``model_type``.
VISION_TOWER_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "gemma3", "idefics3", "smolvlm")


def vision_tower_from_config(cfg: Any) -> Optional[VisionTower]:
    """The vision tower and projector of a vision-language config (:class:`VisionTower`), or
    ``None`` for a text-only config and a family not in :data:`VISION_TOWER_FAMILIES` (Mllama's
    tiled two-encoder tower with gated cross-attention, Qwen3-VL's deepstack mergers: not read).

    Layouts (transformers 5 modeling files; linear paths as PEFT sees them):

    * Qwen2-VL (``qwen2_vl/modeling_qwen2_vl.py`` ``Qwen2VLVisionBlock``): LayerNorm ``norm1`` /
      ``norm2``, fused ``attn.qkv`` + ``attn.proj``, ``mlp.fc1`` / ``mlp.fc2`` with QuickGELU; width
      ``embed_dim``, MLP ``embed_dim * mlp_ratio``; ``PatchMerger`` ``ln_q`` + ``merger.mlp.0`` /
      ``merger.mlp.2`` (GELU between) on ``spatial_merge_size^2`` patches per token.
    * Qwen2.5-VL (``qwen2_5_vl``): the same with RMSNorm, a gated SiLU MLP (``mlp.gate_proj`` /
      ``up_proj`` / ``down_proj``), width ``hidden_size``, output ``out_hidden_size``.
    * LLaVA / LLaVA-NeXT (CLIP or SigLIP ``vision_config``; ``clip/modeling_clip.py``): LayerNorm
      ``layer_norm1`` / ``layer_norm2``, ``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` /
      ``out_proj``, ``mlp.fc1`` / ``mlp.fc2``; CLIP adds a CLS token to the patches; every block runs
      and its saved tensors are live at the loss (the tower's output object, last block included,
      outlives the forward), although only ``vision_feature_layer`` (-2) reaches
      ``multi_modal_projector.linear_1`` / ``linear_2`` (GELU between).
    * Gemma-3 (SigLIP, ``gemma3/modeling_gemma3.py``): SigLIP blocks, ``post_layernorm``, then
      ``Gemma3MultiModalProjector``'s average pool, RMSNorm and a bare ``mm_input_projection_weight``
      matmul (no ``nn.Linear``: ``all-linear`` adapts none of the projector).
    * Idefics3 / SmolVLM (``idefics3/modeling_idefics3.py``): SigLIP-style blocks, ``post_layernorm``,
      pixel shuffle, then ``connector.modality_projection.proj``.

    ``patches_per_image`` is at the image size and tiling :func:`image_tokens_per_image` assumes.
    """
    if not _is_vision_language(cfg):
        return None
    mt = str(getattr(cfg, "model_type", ""))
    if mt not in VISION_TOWER_FAMILIES:
        return None
    vc = cfg.vision_config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text_h = _positive_int(getattr(text, "hidden_size", None))
    tiles = IMAGE_TILES_DEFAULT.get(mt, 1)
    tokens = image_tokens_per_image(cfg)
    act_name = str(getattr(vc, "hidden_act", "gelu"))
    act = "quick_gelu" if act_name == "quick_gelu" else "gelu"

    def lin(path: str, fin: int, fout: int, bias: bool = True) -> LinearShape:
        kind = "attention" if path.split(".")[0] in ("attn", "self_attn") else "mlp"
        return LinearShape(path.rsplit(".", 1)[-1], int(fin), int(fout), kind=kind, bias=bias, path=path)

    if mt in ("qwen2_vl", "qwen2_5_vl"):
        merge = int(getattr(vc, "spatial_merge_size", 2) or 2)
        heads = _positive_int(getattr(vc, "num_heads", None))
        if mt == "qwen2_vl":
            h = _positive_int(getattr(vc, "embed_dim", None))
            i = int(h * float(getattr(vc, "mlp_ratio", 4)))
            out = _positive_int(getattr(vc, "hidden_size", None))
            mlp = (lin("mlp.fc1", h, i), lin("mlp.fc2", i, h))
            norm = "layernorm"
        else:
            h = _positive_int(getattr(vc, "hidden_size", None))
            i = _positive_int(getattr(vc, "intermediate_size", None))
            out = _positive_int(getattr(vc, "out_hidden_size", None))
            mlp = (lin("mlp.gate_proj", h, i), lin("mlp.up_proj", h, i), lin("mlp.down_proj", i, h))
            norm, act = "rmsnorm", "silu_gated"
        if not (h and i and heads and out):
            return None
        m2 = merge * merge
        return VisionTower(
            model_type=mt, hidden_size=h, intermediate_size=i, num_layers=_positive_int(getattr(vc, "depth", None)),
            num_heads=heads, patches_per_image=tokens * m2, projector_tokens=tokens, norm=norm, act=act,
            block_linears=(lin("attn.qkv", h, 3 * h), lin("attn.proj", h, h)) + mlp,
            projector_linears=(lin("merger.mlp.0", h * m2, h * m2), lin("merger.mlp.2", h * m2, out)),
            projector_norm=h * m2, projector_act=h * m2)
    h = _positive_int(getattr(vc, "hidden_size", None))
    i = _positive_int(getattr(vc, "intermediate_size", None))
    heads = _positive_int(getattr(vc, "num_attention_heads", None))
    layers = _positive_int(getattr(vc, "num_hidden_layers", None))
    patch = _positive_int(getattr(vc, "patch_size", None))
    size = getattr(vc, "image_size", None)
    size = _positive_int(size[0] if isinstance(size, (list, tuple)) else size)
    if not (h and i and heads and layers and patch and size and text_h):
        return None
    per_tile = (size // patch) ** 2
    blocks = (lin("self_attn.q_proj", h, h), lin("self_attn.k_proj", h, h), lin("self_attn.v_proj", h, h),
              lin("self_attn.out_proj", h, h), lin("mlp.fc1", h, i), lin("mlp.fc2", i, h))
    # SigLIP's attention-pooling head (``SiglipMultiheadAttentionPoolingHead``: nn.MultiheadAttention's
    # ``out_proj`` is an nn.Linear subclass) runs on one probe token and no VLM uses its output
    head = ((lin("head.attention.out_proj", h, h), lin("head.mlp.fc1", h, i), lin("head.mlp.fc2", i, h))
            if getattr(vc, "vision_use_head", False) else ())
    if mt in ("llava", "llava_next"):
        cls = 1 if "clip" in str(getattr(vc, "model_type", "")) else 0
        fl = getattr(cfg, "vision_feature_layer", -2)
        fls = list(fl) if isinstance(fl, (list, tuple)) else [fl]  # a list: those layers concatenated
        bias = bool(getattr(cfg, "multimodal_projector_bias", True))
        return VisionTower(
            model_type=mt, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
            patches_per_image=tiles * (per_tile + cls), projector_tokens=tokens, act=act, block_linears=blocks,
            unused_linears=head,
            projector_linears=(lin("multi_modal_projector.linear_1", h * len(fls), text_h, bias),
                               lin("multi_modal_projector.linear_2", text_h, text_h, bias)),
            projector_act=text_h)
    if mt == "gemma3":
        # post_layernorm's input and the projector's average pool input, per patch
        return VisionTower(model_type=mt, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
                           patches_per_image=per_tile, projector_tokens=tokens, act=act, block_linears=blocks,
                           extra_patch_features=2 * h, unused_linears=head)
    scale = int(getattr(cfg, "scale_factor", 1) or 1)  # idefics3 / smolvlm
    return VisionTower(
        model_type=mt, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
        patches_per_image=tiles * per_tile, projector_tokens=tokens, act=act, block_linears=blocks,
        projector_linears=(lin("connector.modality_projection.proj", h * scale * scale, text_h, False),),
        extra_patch_features=h, unused_linears=head)


def vision_lora_linears(model_spec: "ModelSpec", targets: Any) -> List[tuple]:
    """The vision-side linears LoRA ``targets`` reach, as ``(LinearShape, blocks)`` pairs (``blocks``:
    the tower's depth for a block linear, 1 for a projector linear); empty without a
    :attr:`ModelSpec.vision_tower`.

    PEFT 0.21 ``tuners/tuners_utils.py``: ``_maybe_include_all_linear_layers`` turns ``all-linear``
    into every ``nn.Linear`` / ``Conv1D`` of the model except the output embedding (and a
    sequence-classification head) -- no model family's vision tower or projector is excluded;
    ``check_target_module_exists`` matches a listed name against every module path by equality or
    ``"." + name`` suffix, so a ``q_proj`` target also wraps a CLIP / SigLIP tower's
    ``self_attn.q_proj``. Patch embeddings are convolutions: never wrapped."""
    vt = getattr(model_spec, "vision_tower", None)
    if vt is None:
        return []
    ts = [str(t).strip() for t in targets]
    all_linear = any(t.lower() in ("all-linear", "all_linear") for t in ts)
    out = []
    for lins, n in ((vt.block_linears, vt.num_layers), (vt.projector_linears, 1), (vt.unused_linears, 1)):
        for lin in lins:
            if all_linear or any(_target_matches(lin, t) for t in ts):
                out.append((lin, n))
    return out


def _config_numbers(cfg: Any) -> dict:
    """The ModelSpec numbers of a transformers config (text config of a multimodal one).

    Sources: transformers' config classes (``LlamaConfig``: ``num_key_value_heads`` defaults to
    ``num_attention_heads``, ``head_dim`` to ``hidden_size // num_attention_heads``;
    ``MixtralConfig.num_local_experts``; ``Qwen2MoeConfig.num_experts``/``moe_intermediate_size``;
    ``DeepseekV3Config.n_routed_experts``; ``GPT2Config.n_inner`` defaulting to ``4 * n_embd``).
    """
    hidden = _cfg_get(cfg, "hidden_size", "n_embd", "d_model")
    heads = _cfg_get(cfg, "num_attention_heads", "n_head")
    layers = _cfg_get(cfg, "num_hidden_layers", "n_layer")
    vocab = _cfg_get(cfg, "vocab_size")
    for field_name, v in (("hidden_size", hidden), ("num_attention_heads", heads),
                          ("num_hidden_layers", layers), ("vocab_size", vocab)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(field_name, "a positive integer in the model config", v)
    kv = _cfg_get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    if kv is None and getattr(cfg, "multi_query", False):
        kv = 1
    kv = int(kv or heads)
    head_dim = _cfg_get(cfg, "head_dim")
    if not isinstance(head_dim, int) or head_dim < 1:
        if hidden % heads:
            raise ConfigError("num_attention_heads", f"a divisor of hidden_size ({hidden}), or a head_dim "
                              "in the model config", heads)
        head_dim = hidden // heads
    if heads % kv:
        raise ConfigError("num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv)
    experts = int(_cfg_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0)
    per_tok = int(_cfg_get(cfg, "num_experts_per_tok", "moe_topk", default=0) or 0) if experts else 0
    inter = _cfg_get(cfg, "intermediate_size", "n_inner", "ffn_dim")
    moe_inter = int(_cfg_get(cfg, "moe_intermediate_size", "expert_intermediate_size", default=0) or 0)
    if experts and not moe_inter and inter:
        moe_inter = int(inter)  # Mixtral convention: intermediate_size is per expert
    return dict(hidden_size=int(hidden), num_heads=int(heads), num_layers=int(layers),
                vocab_size=int(vocab), num_kv_heads=kv, head_dim=int(head_dim),
                intermediate_size=int(inter) if isinstance(inter, int) else 0,
                num_experts=experts, num_experts_per_tok=per_tok, moe_intermediate_size=moe_inter,
                attn_logit_softcapping=_positive_float(_cfg_get(cfg, "attn_logit_softcapping")),
                final_logit_softcapping=_positive_float(_cfg_get(cfg, "final_logit_softcapping")),
                max_position_embeddings=_positive_int(_cfg_get(cfg, "max_position_embeddings", "n_positions",
                                                               "max_sequence_length")),
                **dropout_probabilities(cfg))


def _positive_int(v: Any) -> int:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _positive_float(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0.0


def _fill_intermediate(nums: dict, linears: tuple) -> None:
    """Take intermediate_size from the MLP linears when the config leaves it implicit (GPT-2)."""
    if nums["intermediate_size"]:
        return
    h = nums["hidden_size"]
    for lin in linears:
        if lin.kind in ("mlp", "shared_experts") and lin.in_features == h and lin.out_features != h:
            nums["intermediate_size"] = lin.out_features
            return
    for lin in linears:
        if lin.kind == "experts" and lin.in_features == h:
            nums["intermediate_size"] = lin.out_features
            return


_REQUIRED_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _load_config_dict(config: Any) -> tuple:
    """``(dict, label)`` from a path to config.json, a directory holding one, or a mapping."""
    if isinstance(config, Mapping):
        return dict(config), "config"
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, "r", encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError("config", "a readable config.json path or a directory holding one",
                              f"{path} ({exc.strerror or exc})") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("config", f"valid JSON in {path}", f"{exc.msg} at line {exc.lineno}") from None
        if not isinstance(d, dict):
            raise ConfigError("config", f"a JSON object in {path}", type(d).__name__)
        return d, path
    raise ConfigError("config", "a config.json path, a directory, a dict or a PretrainedConfig",
                      type(config).__name__)


def _config_from_dict(d: dict, label: str) -> Any:
    """A transformers config from a raw dict, checking the fields memguard needs exist."""
    from transformers import AutoConfig, CONFIG_MAPPING

    mt = d.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise ConfigError(f"{label}: model_type", "the transformers model_type (e.g. 'llama')", mt)
    if mt not in CONFIG_MAPPING:
        raise ConfigError(f"{label}: model_type", "a model_type this transformers knows", mt)
    cls = CONFIG_MAPPING[mt]
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d
    amap = getattr(cls, "attribute_map", {}) or {}
    sub = getattr(cls, "sub_configs", {}) or {}
    if text is not d and "text_config" in sub:
        amap = getattr(sub["text_config"], "attribute_map", {}) or {}
    for key in _REQUIRED_KEYS[1:]:
        alias = amap.get(key)
        if key not in text and (alias is None or alias not in text):
            raise ConfigError(f"{label}: {key}" + (f" (or {alias})" if alias else ""),
                              "present in the model config", None)
    _check_heads(text, amap, label)
    d = {k: v for k, v in d.items() if k not in ("quantization_config", "model_type")}
    if "torch_dtype" in d and "dtype" not in d:  # transformers 5 renamed it (and warns)
        d["dtype"] = d.pop("torch_dtype")
    try:
        return AutoConfig.for_model(mt, **d)
    except Exception as exc:  # TypeError / ValueError, huggingface_hub's strict-dataclass validators
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise ConfigError(label, f"a valid {mt} config", str(cause)) from None


def _check_heads(text: dict, amap: dict, label: str) -> None:
    """The head counts of a raw config dict divide what they must (else transformers' validators
    raise deep inside the config class): ``num_attention_heads`` divides ``hidden_size`` unless the
    config gives ``head_dim``, and ``num_key_value_heads`` divides ``num_attention_heads``.

    Raises:
        ConfigError: naming the field and the path.
    """
    def get(key):
        v = text.get(key, text.get(amap.get(key, ""), None))
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    hidden, heads, kv = get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads")
    if hidden and heads and not get("head_dim") and hidden % heads:
        raise ConfigError(f"{label}: num_attention_heads", f"a divisor of hidden_size ({hidden}), or a "
                          "head_dim in the config", heads)
    if heads and kv and heads % kv:
        raise ConfigError(f"{label}: num_key_value_heads", f"a divisor of num_attention_heads ({heads})", kv)


_META_CACHE: dict = {}

# Private switch: False forces the full meta build for every config (the tests compare both routes).
_FAST_COUNT = True

# Config keys that make blocks differ by their index in transformers 5.23 (modeling_*.py of the
# model types named), with the values that keep every block alike. A key set otherwise sends the
# config to the full build.
_LAYOUT_RULES = {
    # qwen2_moe / qwen3_moe / qwen3_next / flint / qwen3_omni_moe: a block is sparse iff
    # ``layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0``
    "decoder_sparse_step": lambda v, L: v in (None, 1),
    # deepseek_v2 / deepseek_v3 / glm4_moe / glm4v_moe / dots1 / mistral4: dense below k
    "first_k_dense_replace": lambda v, L: v in (None, 0),
    # afmoe / lfm2_moe: ``moe_enabled = layer_idx >= num_dense_layers``
    "num_dense_layers": lambda v, L: v in (None, 0),
    # deepseek (v1 layout): a MoE block every ``moe_layer_freq`` layers
    "moe_layer_freq": lambda v, L: v in (None, 1),
    # llama4: a MoE block every ``interleave_moe_layer_step`` layers
    "interleave_moe_layer_step": lambda v, L: v in (None, 1),
    # ernie4_5_moe: MoE iff ``(i + 1) % interval == 0 and start <= i <= end``
    "moe_layer_interval": lambda v, L: v in (None, 1),
    "moe_layer_start_index": lambda v, L: v in (None, 0),
    "moe_layer_end_index": lambda v, L: v is None or v == -1 or (isinstance(v, int) and v >= L - 1),
    # jamba / zamba: attention and expert blocks every ``period`` layers from ``offset``
    "attn_layer_period": lambda v, L: v is None,
    "attn_layer_offset": lambda v, L: v is None,
    "expert_layer_period": lambda v, L: v is None,
    "expert_layer_offset": lambda v, L: v is None,
    # inkling2: a block-attention residual module at block boundaries and on layer_idx > 0
    "n_layers_per_attn_res_block": lambda v, L: v is None,
    # gemma3n / gemma4: the last layers share KV; per-layer embeddings sized by the layer count
    "num_kv_shared_layers": lambda v, L: v in (None, 0),
    "hidden_size_per_layer_input": lambda v, L: v in (None, 0),
    "kv_sharing_modes": lambda v, L: not v,
    # blip_2 / instructblip / evolla: cross attention every n layers
    "cross_attention_frequency": lambda v, L: v is None,
    "aligner_num_add_layers": lambda v, L: v is None,
    # nemotron_h: one character per layer selects the block type
    "hybrid_override_pattern": lambda v, L: not v,
    # DeciLM / Nemotron-NAS: one config per block; transformers' heterogeneous per-layer configs
    "block_configs": lambda v, L: not v,
    "per_layer_config": lambda v, L: not v,
    # mllama / zamba2 / qwen4_exp: lists of layer indices with an extra module
    "cross_attention_layers": lambda v, L: not v,
    "hybrid_layer_ids": lambda v, L: not v,
    "ple_layer_ids": lambda v, L: not v,
}
# Lists of layer indices that select a block kind (qwen2_moe-family ``mlp_only_layers``, llama4
# ``moe_layers``): alike when empty or when they hold every index (then cut to ``range(S)``).
_INDEX_LISTS = frozenset({"mlp_only_layers", "moe_layers"})
# List fields that are not per-layer (token ids; mamba's (min, max) clamp).
_HARMLESS_LISTS = frozenset({"architectures", "eos_token_id", "bos_token_id", "pad_token_id",
                             "time_step_limit", "suppress_tokens", "begin_suppress_tokens"})
# Scalars whose names look like layout keys but only derive a per-layer list the config also
# holds (``layer_types``: qwen2 ``max_window_layers``, gemma ``sliding_window_pattern``, afmoe
# ``global_attn_every_n_layers``, llama4 / smollm3 ``no_rope_layer_interval``) or name layers
# transformers does not build (``num_nextn_predict_layers``: DeepSeek multi-token prediction).
_HARMLESS_KEYS = frozenset({"num_hidden_layers", "num_layers", "n_layers", "n_layer",
                            "max_window_layers", "num_nextn_predict_layers", "num_mtp_layers",
                            "no_rope_layer_interval", "sliding_window_pattern",
                            "_sliding_window_pattern", "global_attn_every_n_layers",
                            "scale_attn_by_inverse_layer_idx"})
# Any other key that looks like a layout knob is unknown: set to anything but None/False/empty,
# the config goes to the full build.
_LAYOUT_KEY_RE = re.compile(r"first_k|dense_(layers|replace)|sparse_step|layer_(freq|step|period|offset|"
                            r"interval)|_(start|end)_index|every_n|per_layer|layers?_ids?$|layer_idxs?$|"
                            r"_idxs$|block_configs?|override_pattern|shared_layers|_layers$")


def _freeze(v: Any) -> Any:
    """A hashable stand-in for a per-layer value (dicts and lists as sorted JSON)."""
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, sort_keys=True, default=str)
    return v


_PROPS_BY_CLASS: dict = {}


def _list_properties(cls: type) -> tuple:
    """Names of a config class's properties that may hold per-layer values (``layer`` /
    ``block`` / ``modes`` in the name; others are not read: some warn as deprecated). Cached."""
    names = _PROPS_BY_CLASS.get(cls)
    if names is None:
        names = tuple(n for n in dir(cls) if re.search(r"layer|block|modes", n)
                      and isinstance(getattr(cls, n, None), property))
        _PROPS_BY_CLASS[cls] = names
    return names


def _truncation_plan(cfg: Any, num_layers: int):
    """How to count ``cfg`` from short copies: ``(n_a, n_b, fields, types)`` or a reason string.

    ``fields``: ``{name: list}`` to cut to the first ``n`` entries (per-layer lists, and index lists
    holding every layer); ``types[i]``: the tuple of layer ``i``'s per-layer values. ``n_a`` is the
    shortest prefix holding every distinct tuple, ``n_b > n_a`` the shortest holding each tuple
    twice (once when it occurs once).
    """
    L = num_layers
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if text is not cfg:
        return "composite config (the text stack is a sub-config)"
    if _cfg_get(cfg, "num_hidden_layers", "n_layer") != L:
        return "the layer count is not num_hidden_layers"
    if getattr(cfg, "is_heterogeneous", False):
        return "heterogeneous per-layer config"
    d = cfg.to_dict()
    # per-layer lists a config computes in a property (jamba ``layers_block_type``, bamba,
    # recurrent_gemma): not in to_dict, so they cannot be cut; any that varies sends the config to
    # the full build
    for name in _list_properties(type(cfg)):
        if name in d:
            continue
        try:
            v = getattr(cfg, name)
        except Exception:
            continue
        if isinstance(v, (list, tuple)) and len(v) == L and len({_freeze(x) for x in v}) > 1:
            return f"per-layer property {name} varies"
    per_layer: dict = {}
    fields: dict = {}
    for k, v in d.items():
        rule = _LAYOUT_RULES.get(k)
        if rule is not None:
            if not rule(v, L):
                return f"{k}={v!r} lays the blocks out by index"
            continue
        if k in _INDEX_LISTS:
            if not v:
                continue
            if isinstance(v, (list, tuple)) and sorted(set(v)) == list(range(L)):
                fields[k] = "all"
                continue
            return f"{k}={v!r} selects some layers"
        if isinstance(v, (list, tuple)):
            if k in _HARMLESS_LISTS or len(v) == 0:
                continue
            if len(v) == L:
                per_layer[k] = v
                fields[k] = v
                continue
            return f"list {k} has {len(v)} entries, not one per layer ({L})"
        unset = v is None or v is False or (isinstance(v, (str, dict)) and not v)
        if _LAYOUT_KEY_RE.search(k) and k not in _HARMLESS_KEYS and not unset:
            return f"unknown layout key {k}={v!r}"
    names = sorted(per_layer)
    types = [tuple(_freeze(per_layer[k][i]) for k in names) for i in range(L)]
    first: dict = {}
    second: dict = {}
    for i, t in enumerate(types):
        if t not in first:
            first[t] = i
        elif t not in second:
            second[t] = i
    n_a = 1 + max(first.values())
    n_b = max(n_a + 1, 1 + max(second.get(t, first[t]) for t in first))
    if n_a + n_b >= L:
        return f"the short copies ({n_a} + {n_b} blocks) are not shorter than the model ({L})"
    return n_a, n_b, fields, types


def _is_vision_language(cfg: Any) -> bool:
    """A composite config with a vision side (``vision_config`` among its sub-configs)."""
    return getattr(cfg, "vision_config", None) is not None


def _build_meta(cfg: Any) -> Any:
    """The model a config describes, built under ``torch.device("meta")`` and accelerate's
    ``init_empty_weights`` (every tensor on the meta device; the second guard catches code that
    creates parameters on an explicit device): ``AutoModelForImageTextToText`` for a
    vision-language config (the class users fine-tune: vision tower, projector and language model;
    ``AutoModelForCausalLM`` would build Mllama's text model alone or refuse Qwen2-VL / LLaVA),
    ``AutoModelForCausalLM`` otherwise."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), init_empty_weights():
        if _is_vision_language(cfg):
            from transformers import AutoModelForImageTextToText

            try:
                return AutoModelForImageTextToText.from_config(cfg)
            except ValueError:  # a composite config the image-text mapping does not list
                pass
        return AutoModelForCausalLM.from_config(cfg)


def _head_tied(model: Any, tied: bool) -> bool:
    # transformers 5 ties only the pairs a class lists in ``_tied_weights_keys``: a class without
    # any keeps its head even when the config says tie_word_embeddings.
    if tied and hasattr(model, "_tied_weights_keys") and not model._tied_weights_keys:
        return False
    return tied


def _full_count(cfg: Any, nums: dict, tied: bool) -> dict:
    """Count the whole model built on the meta device (every block)."""
    try:
        model = _build_meta(cfg)
    except ConfigError:
        raise
    except Exception as exc:  # whatever the modeling code raises on an inconsistent config
        raise ConfigError("config", f"a config transformers can build ({cfg.model_type})",
                          f"{type(exc).__name__}: {exc}") from None
    tied = _head_tied(model, tied)
    out = _count_params(model, num_layers=nums["num_layers"], hidden_size=nums["hidden_size"],
                        is_moe=nums["num_experts"] > 0, tied=tied)
    del model
    out.pop("per_block", None)
    out["tied"] = tied
    out["counted_by"] = "full"
    return out


def _count_short(cfg: Any, n: int, fields: dict, nums: dict, tied: bool) -> Optional[dict]:
    """Count a copy of ``cfg`` cut to ``n`` layers; ``None`` when a block shares a parameter."""
    import copy

    small = copy.deepcopy(cfg)
    small.num_hidden_layers = n  # attribute_map turns it into n_layer (GPT-2) and the like
    if _cfg_get(small, "num_hidden_layers", "n_layer") != n:
        return None
    for k, v in fields.items():
        setattr(small, k, list(range(n)) if v == "all" else type(v)(v[:n]))
    model = _build_meta(small)
    tied = _head_tied(model, tied)
    is_moe = nums["num_experts"] > 0
    out = _count_params(model, num_layers=n, hidden_size=nums["hidden_size"], is_moe=is_moe, tied=tied)
    prefix = out["block_prefix"]
    if prefix is None or out["num_blocks"] != n:
        return None
    # a parameter reachable from a block and from anywhere else (Zamba's shared blocks) would be
    # counted once by the full build, not once per block
    names: dict = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(pname)
    for group in names.values():
        if len(group) > 1 and any(g.startswith(prefix + ".") for g in group):
            return None
    blocks = model.get_submodule(prefix)
    out["linears_by_block"] = [_block_linears(b, nums["hidden_size"], is_moe) for b in blocks]
    out["tied"] = tied
    return out


_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(ParamCounts))


def _truncated_count(cfg: Any, nums: dict, tied: bool) -> Optional[dict]:
    """Exact counts from two short copies of the model, or ``None`` when that is not sure.

    Blocks are alike when every per-layer value (``layer_types``, ``mlp_layer_types``, any list
    with one entry per layer) is alike and no key of ``_LAYOUT_RULES`` lays blocks out by index.
    The model is built with ``n_a`` and with ``n_b`` layers (see ``_truncation_plan``); in both,
    every block must hold the same counts by kind and the same linears as the blocks of its
    per-layer tuple, and everything outside the blocks must be the same. The full model's counts
    are then the outside counts plus, for each of its layers, the counts of its tuple's block; its
    ``block_linears`` are those of its last layer's tuple. Any failure returns ``None`` (the
    caller builds the whole model).
    """
    L = nums["num_layers"]
    try:
        plan = _truncation_plan(cfg, L)
        if isinstance(plan, str):
            _log.debug("full meta build for %s: %s", getattr(cfg, "model_type", "?"), plan)
            return None
        n_a, n_b, fields, types = plan
        a = _count_short(cfg, n_a, fields, nums, tied)
        b = _count_short(cfg, n_b, fields, nums, tied) if a is not None else None
    except Exception as exc:  # a config the short copy cannot take: the full build decides
        _log.debug("full meta build for %s: short copy failed (%s: %s)",
                   getattr(cfg, "model_type", "?"), type(exc).__name__, exc)
        return None
    if a is None or b is None:
        _log.debug("full meta build for %s: shared block parameters or no block list", cfg.model_type)
        return None
    keys = _PARAM_FIELDS + ("trainable",)
    zero = dict.fromkeys(keys, 0)

    def block(out: dict, j: int) -> tuple:
        c = out["per_block"].get(j, zero)
        return tuple(c.get(k, 0) for k in keys), out["linears_by_block"][j]

    def outside(out: dict) -> tuple:
        tot = dataclasses.asdict(out["counts"])
        tot["trainable"] = out["trainable"]
        for c in out["per_block"].values():
            for k in keys:
                tot[k] -= c.get(k, 0)
        return tuple(tot[k] for k in keys)

    ref: dict = {}
    for j in range(n_b):
        entry = block(b, j)
        if ref.setdefault(types[j], entry) != entry:
            _log.debug("full meta build for %s: blocks %s differ", cfg.model_type, types[j])
            return None
    same = all(block(a, j) == ref[types[j]] for j in range(n_a))
    same = same and outside(a) == outside(b)
    for k in ("tied", "adapter_params", "lora_rank", "quant", "linear_bits", "embed_bits", "block_prefix"):
        same = same and a[k] == b[k]
    if not same or b["adapter_params"] or b["quant"] is not None:
        _log.debug("full meta build for %s: the short copies disagree", cfg.model_type)
        return None
    total = list(outside(b))
    for t in types:
        for i, v in enumerate(ref[t][0]):
            total[i] += v
    tot = dict(zip(keys, total))
    trainable = tot.pop("trainable")
    return dict(counts=ParamCounts(**tot), block_linears=ref[types[-1]][1], adapter_params=0,
                trainable=trainable, lora_rank=None, quant=None, linear_bits=b["linear_bits"],
                embed_bits=b["embed_bits"], num_blocks=L, block_prefix=b["block_prefix"],
                tied=b["tied"], counted_by=f"short copies ({n_a} and {n_b} of {L} layers)")


def _meta_count(cfg: Any, nums: dict, tied: bool) -> dict:
    """Count a config's parameters on the meta device (no weight memory); cached per config.

    Fast path (``_truncated_count``): when the blocks are provably alike up to their per-layer
    values, two short copies of the model (a few layers each) are built and the per-block counts
    are extended to all layers: the time no longer grows with the depth. Otherwise (a layout key
    such as ``first_k_dense_replace``, ``decoder_sparse_step`` or ``mlp_only_layers`` set, a
    composite config, shared block parameters, any doubt) the whole model is built
    (``_full_count``). Both give the same result; ``counted_by`` says which ran.
    """
    try:
        key = ("fast:" if _FAST_COUNT else "full:") + json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    except Exception:  # unserializable config: no cache
        key = None
    if key is not None and key in _META_CACHE:
        return _META_CACHE[key]
    out = _truncated_count(cfg, nums, tied) if _FAST_COUNT else None
    if out is None:
        out = _full_count(cfg, nums, tied)
    if key is not None:
        if len(_META_CACHE) >= 64:
            _META_CACHE.pop(next(iter(_META_CACHE)))
        _META_CACHE[key] = out
    return out


def _quant_bits_from_config(qc: Any) -> Optional[float]:
    """Weight bits implied by a config's ``quantization_config`` (bitsandbytes, GPTQ, AWQ).

    bitsandbytes 4-bit: NF4_BITS / NF4_DOUBLE_QUANT_BITS; 8-bit: 8. GPTQ/AWQ ``bits`` with
    ``group_size`` g: ``bits + (16 + bits) / g`` (an fp16 scale and a ``bits``-wide zero point per
    group, AutoGPTQ/AutoAWQ packing).
    """
    if not isinstance(qc, Mapping):
        qc = getattr(qc, "to_dict", lambda: None)()
        if not isinstance(qc, Mapping):
            return None
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        return NF4_DOUBLE_QUANT_BITS if qc.get("bnb_4bit_use_double_quant") else NF4_BITS
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        return 8.0
    bits = qc.get("bits")
    if isinstance(bits, (int, float)) and not isinstance(bits, bool) and 1 <= bits <= 16:
        g = qc.get("group_size") or qc.get("q_group_size") or 0
        return float(bits) + ((16.0 + bits) / g if isinstance(g, int) and g > 0 else 0.0)
    return None


def _quant_bits_arg(quantization_bits: Any, double_quant: bool) -> Optional[float]:
    if quantization_bits is None:
        return None
    if isinstance(quantization_bits, bool) or not isinstance(quantization_bits, (int, float)):
        raise ConfigError("quantization_bits", "None, 4, 8, 16 or 32", quantization_bits)
    if quantization_bits == 4:
        return NF4_DOUBLE_QUANT_BITS if double_quant else NF4_BITS
    if quantization_bits in (8, 16, 32):
        return float(quantization_bits)
    raise ConfigError("quantization_bits", "None, 4, 8, 16 or 32", quantization_bits)


def model_spec_from_hf_config(config: Any, name: Optional[str] = None, *,
                              quantization_bits: Optional[int] = None,
                              double_quant: bool = False) -> ModelSpec:
    """Introspect a Hugging Face causal-LM config, counting parameters exactly.

    The model is built with ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``
    and accelerate's ``init_empty_weights`` (no weight memory); the counts are cached per config.
    When the blocks are provably alike up to their per-layer values (``layer_types`` and other
    one-entry-per-layer lists), only two short copies (a few layers each) are built and the
    per-block counts are extended to every layer, so the time does not grow with the depth
    (~10-40 ms after the imports, 135M to 70B); a config with a layout key that makes blocks
    differ by index (``first_k_dense_replace``, ``decoder_sparse_step``, ``mlp_only_layers``,
    Jamba periods, ...), a composite (multimodal) config, or short copies that disagree falls
    back to building every block (time grows with the layer count). Both routes give the same
    ModelSpec. Every parameter is classified by kind (see ``ParamCounts``);
    ``config.tie_word_embeddings`` is respected explicitly (transformers 5 leaves a meta-built
    head untied), so a tied head counts 0.

    Args:
        config: path to a ``config.json``, a directory holding one, a dict (a parsed
            config.json) or a ``transformers.PretrainedConfig``.
        name: label; defaults to the path or ``_name_or_path`` or ``model_type``.
        quantization_bits: load-time quantization of the block linears: 4 (bitsandbytes NF4,
            4.5 bits/weight, 4.127 with ``double_quant``), 8, 16 or 32. ``None``: take it from the
            config's ``quantization_config`` if any, else the config dtype.
        double_quant: NF4 double quantization (``bnb_4bit_use_double_quant``).

    Returns:
        ``ModelSpec`` with ``source="hf-config"``. ``dense_bits`` is the config dtype's bits
        (``torch_dtype``/``dtype``; 32 when absent, transformers' default float32).

    Raises:
        ConfigError: unreadable path, invalid JSON, missing ``model_type`` / ``hidden_size`` /
            ``num_hidden_layers`` / ``num_attention_heads`` / ``vocab_size`` (the message names
            the field and the path), unknown model_type, or a config transformers cannot build.
    """
    qbits = _quant_bits_arg(quantization_bits, double_quant)
    raw_qc = None
    if hasattr(config, "to_dict") and hasattr(config, "model_type") and not isinstance(config, Mapping):
        cfg = config
        label = getattr(cfg, "_name_or_path", "") or cfg.model_type
        raw_qc = getattr(cfg, "quantization_config", None)
    else:
        d, label = _load_config_dict(config)
        raw_qc = d.get("quantization_config")
        cfg = _config_from_dict(d, label if label != "config" else "config")
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    nums = _config_numbers(text_cfg)
    tied = bool(getattr(text_cfg, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings", False)))
    counted = _meta_count(cfg, nums, tied)
    tied = counted["tied"]
    _fill_intermediate(nums, counted["block_linears"])
    # ``torch_dtype`` is read from __dict__: transformers 5 warns on the deprecated attribute.
    dense = _dtype_bits(getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype")) or 32.0
    if qbits is None:
        qbits = _quant_bits_from_config(raw_qc)
    weight_bits = qbits if qbits is not None else dense
    if qbits is not None and qbits < 16:
        dense = min(dense, 16.0)  # bitsandbytes keeps the rest in the compute dtype (fp16/bf16)
    declared = _DTYPE_NAMES.get(str(getattr(cfg, "dtype", None) or vars(cfg).get("torch_dtype"))
                                .replace("torch.", ""))
    return ModelSpec(
        name=name or str(label), model_type=str(cfg.model_type), params=counted["counts"],
        block_linears=counted["block_linears"], tie_word_embeddings=tied,
        weight_bits=float(weight_bits), dense_bits=float(dense), source="hf-config",
        weight_dtype=declared, image_tokens=image_tokens_per_image(cfg),
        vision_tower=vision_tower_from_config(cfg), **nums)


def model_spec_from_module(model: Any, name: Optional[str] = None) -> ModelSpec:
    """Introspect a live ``torch.nn.Module``: a HF ``PreTrainedModel`` or a PEFT ``PeftModel``.

    Counts come from ``named_parameters`` (a tied head, being the same tensor, is listed once).
    LoRA/DoRA adapter tensors (``lora_A``/``lora_B``/``lora_magnitude_vector``) and PEFT
    ``modules_to_save`` copies are kept out of ``params`` (which describe the base architecture)
    and reported in ``adapter_params``; ``trainable_params`` counts every element with
    ``requires_grad``; ``lora_rank_found`` is the largest ``lora_A`` weight's first dimension
    (PEFT's ``lora_A`` is ``nn.Linear(in, r)``, weight ``(r, in)``).

    bitsandbytes: a ``Params4bit`` weight packs two 4-bit values per uint8 (its ``numel`` is
    half the real count; ``quant_state.shape`` holds the real shape); ``weight_bits`` becomes
    4.5 (NF4) or 4.127 when the quant state is nested (double quantization,
    ``compress_statistics``); ``Int8Params`` gives 8. Otherwise ``weight_bits`` is the dtype of
    the block linears and ``dense_bits`` that of the input embedding.

    Raises:
        ConfigError: ``model`` is not a torch module, or its shapes cannot be found (no config
            and no block list / embedding).
    """
    try:
        import torch.nn as nn
    except ImportError:  # pragma: no cover
        raise ConfigError("model", "a torch.nn.Module", type(model).__name__) from None
    if not isinstance(model, nn.Module):
        raise ConfigError("model", "a torch.nn.Module (HF PreTrainedModel or PEFT PeftModel)",
                          type(model).__name__)
    base = model
    if hasattr(model, "get_base_model") and callable(model.get_base_model):
        base = model.get_base_model()
    cfg = getattr(base, "config", None)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    nums = None
    if text_cfg is not None:
        try:
            nums = _config_numbers(text_cfg)
        except ConfigError:
            nums = None
    if nums is None:
        nums = _numbers_from_structure(base)
    counted = _count_params(base, num_layers=nums["num_layers"], hidden_size=nums["hidden_size"],
                            is_moe=nums["num_experts"] > 0, tied=None)
    _fill_intermediate(nums, counted["block_linears"])
    emb_in = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    emb_out = None
    try:
        emb_out = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    except Exception:
        pass
    tied = bool(emb_in is not None and emb_out is not None
                and getattr(emb_out, "weight", None) is getattr(emb_in, "weight", 0))
    lora_rank = counted["lora_rank"]
    peft_cfgs = getattr(model, "peft_config", None)
    if lora_rank is not None and isinstance(peft_cfgs, Mapping):
        active = getattr(model, "active_adapter", None)
        pc = peft_cfgs.get(active) if isinstance(active, str) else None
        pc = pc or next(iter(peft_cfgs.values()), None)
        if isinstance(getattr(pc, "r", None), int):
            lora_rank = pc.r  # the adapter's own rank (PEFT LoraConfig.r)
    dense = counted["embed_bits"] or counted["linear_bits"] or 32.0
    quant = counted["quant"]
    if quant == "nf4":
        wbits = NF4_BITS
    elif quant == "nf4-dq":
        wbits = NF4_DOUBLE_QUANT_BITS
    elif quant == "int8":
        wbits = 8.0
    else:
        wbits = counted["linear_bits"] or dense
    label = name or getattr(cfg, "_name_or_path", "") or getattr(cfg, "model_type", "") or type(base).__name__
    return ModelSpec(
        name=str(label), model_type=str(getattr(cfg, "model_type", None) or type(base).__name__),
        params=counted["counts"], block_linears=counted["block_linears"], tie_word_embeddings=tied,
        weight_bits=float(wbits), dense_bits=float(dense), trainable_params=counted["trainable"],
        lora_rank_found=lora_rank, adapter_params=counted["adapter_params"],
        image_tokens=image_tokens_per_image(cfg) if cfg is not None else 0,
        vision_tower=vision_tower_from_config(cfg) if cfg is not None else None, source="module", **nums)


def _numbers_from_structure(model: Any) -> dict:
    """ModelSpec numbers of a module without a usable config: from its embedding and blocks.

    Heads cannot be read from weights; ``num_heads`` is taken as ``hidden // 64`` (the common
    head size) and marked by ``head_dim = 64``.
    """
    import torch.nn as nn

    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    _, blocks = _find_blocks(model, None)
    if emb is None or blocks is None:
        raise ConfigError("model", "a model with a config, or an nn.Embedding and a block ModuleList",
                          type(model).__name__)
    vocab, hidden = (int(s) for s in emb.weight.shape)
    heads = max(1, hidden // 64)
    return dict(hidden_size=hidden, num_heads=heads, num_layers=len(blocks), vocab_size=vocab,
                num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=0,
                num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)


_QUANT_MODEL_BITS = (2, 3, 4, 5, 6, 8)


def _bits_from_model_bits(model_bits: Any) -> tuple:
    """``(weight_bits, dense_bits)`` for ``ml-memguard``'s ``model_bits``.

    16 / 32: unquantized, everything in that width. 2, 3, 4, 5, 6, 8: quantized block linears at
    ``b + 0.5`` bits (group-64 constants: MLX affine quantization stores an fp16 scale and bias
    per 64 weights, bitsandbytes NF4 an fp32 absmax per 64: both 0.5 bit/weight), the rest in 16
    bits. A non-integer in (1, 32] (e.g. 4.127) is taken as the effective bits as given.
    """
    if isinstance(model_bits, bool) or not isinstance(model_bits, (int, float)):
        raise ConfigError("model_bits", "one of 2, 3, 4, 5, 6, 8, 16, 32 (or effective bits in (1, 32])",
                          model_bits)
    b = float(model_bits)
    if b in (16.0, 32.0):
        return b, b
    if b.is_integer() and int(b) in _QUANT_MODEL_BITS:
        return b + GROUP64_OVERHEAD_BITS, 16.0
    if not b.is_integer() and 1.0 < b <= 32.0:
        return b, 16.0 if b < 16 else b
    raise ConfigError("model_bits", "one of 2, 3, 4, 5, 6, 8, 16, 32 (or effective bits in (1, 32])",
                      model_bits)


def model_spec_from_numbers(model_params: int, hidden_dim: int, num_layers: int, num_heads: int,
                            num_kv_heads: Optional[int] = None, model_bits: float = 16,
                            vocab_size: int = 32000, intermediate_size: Optional[int] = None,
                            num_experts: int = 0, num_experts_per_tok: int = 0,
                            tie_word_embeddings: bool = False, name: str = "custom") -> ModelSpec:
    """A llama-like ``ModelSpec`` from ``ml-memguard``'s ``preflight(...)`` numbers.

    Shapes follow Llama (transformers ``LlamaForCausalLM``): per block q/k/v/o projections
    (``head_dim = hidden_dim / num_heads``, k/v ``num_kv_heads * head_dim`` wide, no bias), a SwiGLU
    MLP gate/up/down, two RMSNorms (weight only); a final norm; token embedding and, unless tied,
    an lm_head. With ``num_experts > 0`` the MLP is a Mixtral-style sparse MoE: router
    ``gate`` (hidden -> E) and fused experts ``gate_up_proj``/``down_proj`` (count E), laid out
    as in transformers 5.

    ``model_params`` is split so the kinds add up to it exactly: embeddings, head, attention,
    norms and router come from the shapes, the MLP (or experts) takes the rest. Without
    ``intermediate_size`` it is derived from that rest (``rest // (3 * hidden * layers [* E])``).

    Raises:
        ConfigError: a non-positive or non-integer count, ``hidden_dim`` not divisible by
            ``num_heads``, ``num_heads`` not divisible by ``num_kv_heads``, bad ``model_bits``,
            ``num_experts_per_tok`` outside ``[1, num_experts]``, or ``model_params`` smaller
            than the embeddings + attention + norms the shapes imply.
    """
    P = require_positive_int("model_params", model_params)
    H = require_positive_int("hidden_dim", hidden_dim)
    L = require_positive_int("num_layers", num_layers)
    nh = require_positive_int("num_heads", num_heads)
    kv = nh if num_kv_heads is None else require_positive_int("num_kv_heads", num_kv_heads)
    V = require_positive_int("vocab_size", vocab_size)
    E = require_positive_int("num_experts", num_experts, allow_zero=True)
    k = require_positive_int("num_experts_per_tok", num_experts_per_tok, allow_zero=True)
    inter = None if intermediate_size is None else require_positive_int("intermediate_size",
                                                                         intermediate_size)
    if H % nh:
        raise ConfigError("hidden_dim", f"a multiple of num_heads ({nh})", H)
    if kv > nh or nh % kv:
        raise ConfigError("num_kv_heads", f"a divisor of num_heads ({nh})", kv)
    if E:
        if k == 0:
            k = min(2, E)  # Mixtral's top-2 routing when the caller does not say
        if k > E:
            raise ConfigError("num_experts_per_tok", f"an integer in [1, num_experts={E}]", k)
    elif k:
        raise ConfigError("num_experts_per_tok", "0 when num_experts is 0", k)
    if not isinstance(tie_word_embeddings, bool):
        raise ConfigError("tie_word_embeddings", "a bool", tie_word_embeddings)
    if not isinstance(name, str) or not name:
        raise ConfigError("name", "a non-empty string", name)
    weight_bits, dense_bits = _bits_from_model_bits(model_bits)

    hd = H // nh
    attn_block = H * nh * hd + 2 * H * kv * hd + nh * hd * H
    norms_block = 2 * H
    router_block = E * H
    embeddings = V * H
    lm_head = 0 if tie_word_embeddings else V * H
    fixed = embeddings + lm_head + L * (attn_block + norms_block + router_block) + H
    ffn = P - fixed
    per_unit = L * 3 * H * (E or 1)
    if ffn < (per_unit if inter is None else 0):
        raise ConfigError("model_params",
                          f"at least {fixed + per_unit:,} for these shapes (embeddings, attention, "
                          f"norms{', router' if E else ''} and a minimal MLP)", P)
    if inter is None:
        inter = ffn // per_unit
    counts = ParamCounts(embeddings=embeddings, attention=L * attn_block,
                         mlp=0 if E else ffn, experts=ffn if E else 0, router=L * router_block,
                         norms=L * norms_block + H, lm_head=lm_head, other=0,
                         norms_in_blocks=L * norms_block)
    lin = [LinearShape("q_proj", H, nh * hd, 1, "attention", False, "self_attn.q_proj"),
           LinearShape("k_proj", H, kv * hd, 1, "attention", False, "self_attn.k_proj"),
           LinearShape("v_proj", H, kv * hd, 1, "attention", False, "self_attn.v_proj"),
           LinearShape("o_proj", nh * hd, H, 1, "attention", False, "self_attn.o_proj")]
    if E:
        lin += [LinearShape("gate", H, E, 1, "router", False, "mlp.gate"),
                LinearShape("gate_up_proj", H, 2 * inter, E, "experts", False,
                            "mlp.experts.gate_up_proj", True),
                LinearShape("down_proj", inter, H, E, "experts", False, "mlp.experts.down_proj", True)]
    else:
        lin += [LinearShape("gate_proj", H, inter, 1, "mlp", False, "mlp.gate_proj"),
                LinearShape("up_proj", H, inter, 1, "mlp", False, "mlp.up_proj"),
                LinearShape("down_proj", inter, H, 1, "mlp", False, "mlp.down_proj")]
    return ModelSpec(
        name=name, model_type="mixtral" if E else "llama", vocab_size=V, hidden_size=H,
        intermediate_size=inter, num_layers=L, num_heads=nh, num_kv_heads=kv, head_dim=hd,
        params=counts, block_linears=tuple(lin), num_experts=E, num_experts_per_tok=k,
        moe_intermediate_size=inter if E else 0, tie_word_embeddings=tie_word_embeddings,
        weight_bits=weight_bits, dense_bits=dense_bits, source="numbers")


_EMBED_TARGETS = ("embed_tokens", "wte", "word_embeddings", "tok_embeddings")
_HEAD_TARGETS = ("lm_head", "output", "embed_out")


def _target_matches(lin: LinearShape, target: str) -> bool:
    """PEFT's rule (peft/tuners/tuners_utils.py ``check_target_module_exists``): a target matches
    a module whose name equals it or ends with ``"." + target``. Fused expert tensors
    (``is_param``) are reached only by a dotted name (``target_parameters`` style)."""
    path = lin.path or lin.name
    hit = path == target or path.endswith("." + target)
    if lin.is_param:
        return hit and "." in target
    return hit


def check_train_spec(model_spec: ModelSpec, train_spec: TrainSpec) -> List[str]:
    """Check training settings against the model they train; return warnings (strings, also
    logged on ``memguard.spec``) for settings that run but are probably not meant.

    Errors (``ConfigError`` naming the field):
        lora_layers: more blocks than the model has.
        lora_rank: above the larger width of every LoRA'd linear (a rank no layer can use; PEFT
            would still allocate ``r x (in + out)`` per layer).
    Warnings:
        lora_rank above the smaller width of a LoRA'd linear (legal in PEFT, no gain in rank);
        ``seq_length + image_tokens`` above the config's ``max_position_embeddings`` (learned
        position tables raise an index error; RoPE models extrapolate unless scaled).
    """
    ms, ts = model_spec, train_spec
    warnings: List[str] = []
    if ts.method != "full":
        if ts.lora_layers is not None and ts.lora_layers > ms.num_layers:
            raise ConfigError("lora_layers", f"at most the model's {ms.num_layers} blocks", ts.lora_layers)
        targets = [t.strip() for t in ts.lora_targets]
        all_linear = any(t.lower() in ("all-linear", "all_linear") for t in targets)
        hit = [lin for lin in ms.block_linears
               if (all_linear and not lin.is_param and lin.kind not in ("router", "experts"))
               or any(_target_matches(lin, t) for t in targets)]
        r = int(ts.lora_rank)
        if hit and r > max(max(lin.in_features, lin.out_features) for lin in hit):
            widest = max(hit, key=lambda lin: max(lin.in_features, lin.out_features))
            raise ConfigError("lora_rank", f"at most the width of the LoRA'd layers (the widest, {widest.name}, "
                              f"is {widest.in_features} -> {widest.out_features})", r)
        narrow = [lin for lin in hit if r > min(lin.in_features, lin.out_features)]
        if narrow:
            lin = min(narrow, key=lambda x: min(x.in_features, x.out_features))
            warnings.append(f"lora_rank {r} is above the width of {lin.name} ({lin.in_features} -> "
                            f"{lin.out_features}): the adapter cannot use more than "
                            f"{min(lin.in_features, lin.out_features)} there")
    tokens = ts.seq_length + ts.image_tokens
    if ms.max_position_embeddings and tokens > ms.max_position_embeddings:
        what = f"seq_length {ts.seq_length}" + (f" + image_tokens {ts.image_tokens}" if ts.image_tokens else "")
        warnings.append(f"{what} is above the model's max_position_embeddings "
                        f"({ms.max_position_embeddings})")
    for w in warnings:
        _log.warning("memguard: %s", w)
    return warnings


def lora_trainable_params(model_spec: ModelSpec, train_spec: TrainSpec) -> int:
    """Elements of the LoRA adapters ``train_spec`` asks for on ``model_spec``.

    A LoRA pair on a linear ``in -> out`` adds ``A (r, in)`` and ``B (out, r)``: ``r * (in + out)``
    (Hu et al. 2021, "LoRA", section 4.1; PEFT ``lora.Linear``); fused experts get one pair per
    expert (``count``). Targets match block linears by name as PEFT does; ``"all-linear"`` is every
    module linear of a block except the router and the experts (MoE experts are adapted only when
    named, e.g. ``experts.gate_up_proj``). A vision-language model's tower and projector linears
    that the targets reach count too (:func:`vision_lora_linears`). Only the last ``lora_layers`` blocks when set
    (mlx_lm's ``num_layers``). ``lm_head`` / ``embed_tokens`` targets add ``r * (hidden + vocab)``.

    Returns:
        int, elements (0 for ``method="full"`` is NOT implied: the count is computed anyway).

    Raises:
        ConfigError (field ``lora_targets``): no target names anything in the model (PEFT raises
            too).
    """
    r = int(train_spec.lora_rank)
    targets = [t.strip() for t in train_spec.lora_targets]
    all_linear = any(t.lower() in ("all-linear", "all_linear") for t in targets)
    per_block = 0
    matched = set()
    for lin in model_spec.block_linears:
        hit = False
        if all_linear and not lin.is_param and lin.kind not in ("router", "experts"):
            hit = True
        for t in targets:
            if _target_matches(lin, t):
                hit = True
                matched.add(t)
        if hit:
            per_block += lin.count * r * (lin.in_features + lin.out_features)
    L = model_spec.num_layers
    n_blocks = L if train_spec.lora_layers is None else min(int(train_spec.lora_layers), L)
    total = per_block * n_blocks
    # a vision-language model's tower / projector linears that the targets reach (PEFT wraps them too)
    for lin, n in vision_lora_linears(model_spec, targets):
        total += n * lin.count * r * (lin.in_features + lin.out_features)
        matched.update(t for t in targets if _target_matches(lin, t))
    outside = model_spec.hidden_size + model_spec.vocab_size
    for t in targets:
        if t in _EMBED_TARGETS or t in _HEAD_TARGETS:
            total += r * outside
            matched.add(t)
    if not all_linear and not matched:
        names = sorted({lin.name for lin in model_spec.block_linears})
        why = ""
        if isinstance(train_spec.lora_targets, _PeftDefaultTargets):
            why = (f"; none were given and PEFT has no default for model_type {model_spec.model_type!r} "
                   "(LoraConfig needs target_modules)")
        raise ConfigError("lora_targets", "module names in the model's blocks (" + ", ".join(names)
                          + ") or 'all-linear'" + why, list(targets))
    return total


def trainable_params(model_spec: ModelSpec, train_spec: TrainSpec) -> int:
    """Elements that receive gradients and optimizer state.

    - A live module's count (``model_spec.trainable_params``) wins when it fits the method:
      ``lora``/``qlora`` with an adapter found on the module, ``full`` without one. (A plain HF
      model before ``get_peft_model`` has every parameter trainable: for ``lora`` the adapter
      size is derived instead.)
    - ``full``: framework ``hf`` / ``lightning`` train every parameter (``params.total``); ``mlx``
      trains the transformer blocks only, the last ``lora_layers`` of them when set (mlx_lm
      ``tuner/utils.py``/``lora.py``: ``--fine-tune-type full`` unfreezes
      ``model.layers[-num_layers:]``): ``params.blocks * n // num_layers``.
    - ``lora`` / ``qlora``: ``lora_trainable_params``.

    Raises:
        ConfigError: see ``lora_trainable_params``.
    """
    live = model_spec.trainable_params
    has_adapter = model_spec.lora_rank_found is not None
    if live is not None and (has_adapter == (train_spec.method != "full")):
        return int(live)
    if train_spec.method == "full":
        if train_spec.framework == "mlx":
            L = model_spec.num_layers
            n = L if train_spec.lora_layers is None else min(int(train_spec.lora_layers), L)
            return model_spec.params.blocks * n // L
        return model_spec.params.total
    return lora_trainable_params(model_spec, train_spec)
