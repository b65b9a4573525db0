"""Shapes and trainable parameters: the block's linears (from the spec, or the Llama layout built
from the numbers), PEFT's target matching, LoRA / full trainable counts, the training dtype of the
weights and the checks of a ``TrainSpec`` against a ``ModelSpec``. docs/estimator.md, "How the peak
is composed".
"""

from __future__ import annotations

import logging
from typing import Any, List, Tuple

from ..errors import ConfigError
from .heads import head_of
from .specs import DTYPE_BITS, LinearShape, ModelSpec, PeftDefaultTargets, TrainSpec

_log = logging.getLogger("memguard.spec")


def block_linear_shapes(ms: ModelSpec) -> Tuple[LinearShape, ...]:
    """One block's projections: ``ms.block_linears``, or the Llama layout synthesised from the
    config numbers when the spec has none (q/k/v/o with GQA, gate/up/down; MoE experts as
    ``count=num_experts``) -- transformers ``models/llama/modeling_llama.py``."""
    if ms.block_linears:
        return tuple(ms.block_linears)
    h, hd = ms.hidden_size, ms.head_dim
    q, kv = ms.num_heads * hd, ms.num_kv_heads * hd
    out = [LinearShape("q_proj", h, q), LinearShape("k_proj", h, kv), LinearShape("v_proj", h, kv),
           LinearShape("o_proj", q, h)]
    if ms.is_moe:
        i = ms.moe_intermediate_size or ms.intermediate_size
        out += [LinearShape("gate", h, ms.num_experts, kind="router"),
                LinearShape("gate_up_proj", h, 2 * i, count=ms.num_experts, kind="experts"),
                LinearShape("down_proj", i, h, count=ms.num_experts, kind="experts")]
    else:
        i = ms.intermediate_size
        out += [LinearShape("gate_proj", h, i, kind="mlp"), LinearShape("up_proj", h, i, kind="mlp"),
                LinearShape("down_proj", i, h, kind="mlp")]
    return tuple(out)


def _is_lora_target(ls: LinearShape, targets: tuple) -> bool:
    """PEFT's matching, as ``spec.lora_trainable_params`` applies it: a target matches a linear
    whose path (or name) equals it or ends with ``"." + target`` (PEFT
    ``check_target_module_exists``); ``all-linear`` takes every module linear of a block except
    the router and the experts; fused expert tensors (``is_param``) only by a dotted name."""
    path = getattr(ls, "path", "") or ls.name
    is_param = bool(getattr(ls, "is_param", False))
    for t in targets:
        if t.lower() in ("all-linear", "all_linear"):
            if not is_param and ls.kind not in ("router", "experts"):
                return True
            continue
        hit = path == t or path.endswith("." + t) or ls.name == t
        if hit and (not is_param or "." in t):
            return True
    return False


def lora_linears(ms: ModelSpec, ts: TrainSpec) -> List[LinearShape]:
    return [ls for ls in block_linear_shapes(ms) if _is_lora_target(ls, ts.lora_targets)]


def num_lora_layers(ms: ModelSpec, ts: TrainSpec) -> int:
    """LoRA blocks: the last ``lora_layers`` (mlx_lm ``num_layers``), all when None."""
    return ms.num_layers if ts.lora_layers is None else min(ts.lora_layers, ms.num_layers)


def _lora_params_per_layer(ms: ModelSpec, ts: TrainSpec) -> int:
    """LoRA adds A (r x in) and B (out x r) per wrapped linear: r * (in + out) parameters
    (Hu et al. 2021, "LoRA", sec. 4)."""
    return sum(ls.count * ts.lora_rank * (ls.in_features + ls.out_features)
               for ls in lora_linears(ms, ts))


def trainable_param_count(ms: ModelSpec, ts: TrainSpec) -> int:
    """Trainable parameters (elements) as the framework defines them: ``spec.trainable_params``
    (full, hf/lightning: every parameter; full, mlx: the blocks only -- mlx_lm's full fine-tune
    unfreezes ``model.layers[-num_layers:]``; lora/qlora: ``r * (in + out)`` per targeted linear of
    the LoRA'd blocks; a live module's own count when it fits the method). When the settings
    differ from the live adapter (the planner halved the rank or the LoRA layers), the adapters are
    derived from the shapes (``spec.lora_trainable_params``) instead of the stale live count, and
    what the live count holds beyond the adapters at the rank found (``modules_to_save`` copies) is
    kept.

    Raises:
        ConfigError: the LoRA targets match no linear of the block.
    """
    if not ms.block_linears:
        ms = ms.replace(block_linears=block_linear_shapes(ms))
    if (ts.method != "full" and ms.trainable_params is not None and ms.lora_rank_found is not None
            and (ts.lora_rank != ms.lora_rank_found or ts.lora_layers is not None)):
        n = lora_trainable_params(ms, ts)
        if ms.decoder_layers == 0:
            # what the live run trains beyond the adapters the shapes give (a user's modules_to_save,
            # e.g. lm_head) stays at any rank; an encoder-decoder's decoder adapters are added by
            # the estimate, so its live count is not split here
            found = lora_trainable_params(ms, ts.replace(lora_rank=ms.lora_rank_found, lora_layers=None))
            n += max(0, int(ms.trainable_params) - found)
        return n
    return trainable_params(ms, ts)


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
    want = 32.0 if train_spec.mixed_precision else DTYPE_BITS[train_spec.dtype]
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


def check_train_spec(model_spec: ModelSpec, train_spec: TrainSpec, *, log: bool = True) -> List[str]:
    """Check training settings against the model they train; return warnings (strings, also
    logged on ``memguard.spec`` unless ``log`` is False) for settings that run but are probably
    not meant.

    Errors (``ConfigError`` naming the field):
        framework: mlx for an encoder-decoder (mlx_lm has none).
        lora_layers: more blocks than the model has; any value for an encoder-decoder.
        lora_rank: above the larger width of every LoRA'd linear (a rank no layer can use; PEFT
            would still allocate ``r x (in + out)`` per layer).
    Warnings:
        lora_rank above the smaller width of a LoRA'd linear (legal in PEFT, no gain in rank);
        ``seq_length + image_tokens`` above the config's ``max_position_embeddings`` (learned
        position tables raise an index error; RoPE models extrapolate unless scaled).
    """
    ms, ts = model_spec, train_spec
    warnings: List[str] = []
    if ms.is_encoder_decoder and ts.framework == "mlx":
        raise ConfigError("framework", "torch for an encoder-decoder (mlx_lm trains decoder-only models)", "mlx")
    if ts.method != "full":
        if ms.is_encoder_decoder and ts.lora_layers is not None:
            raise ConfigError("lora_layers", "unset (every block) for an encoder-decoder: which of its two stacks "
                              "'the last N blocks' means is not defined", ts.lora_layers)
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
        if log:
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
    (mlx_lm's ``num_layers``). ``lm_head`` / ``embed_tokens`` targets add ``r * (hidden + vocab)``. A
    classifier or question-answering head adds the elements PEFT's task type trains in
    ``modules_to_save`` (``TaskHead.peft_saved_params``; not under mlx_lm).

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
    if train_spec.framework != "mlx":
        # PEFT's task type trains a classifier / QA head beside the adapters (``modules_to_save``)
        total += head_of(model_spec).peft_saved_params
    outside = model_spec.hidden_size + model_spec.vocab_size
    for t in targets:
        if t in _EMBED_TARGETS or t in _HEAD_TARGETS:
            total += r * outside
            matched.add(t)
    if not all_linear and not matched:
        names = sorted({lin.name for lin in model_spec.block_linears})
        why = ""
        if isinstance(train_spec.lora_targets, PeftDefaultTargets):
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
