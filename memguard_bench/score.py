"""Scoring a measured bench case: the model and train specs rebuilt from the child's record (so
``--reuse`` re-scores a saved measurement with today's estimator), the estimate, and the result row
(signed error, phase, the CPU bf16 MoE label). docs/benchmarks.md.
"""

from __future__ import annotations

from .cases import arch_of
from .seed import seed_estimate_bytes

__all__ = ["CPU_BF16_MOE", "model_spec_from_dict", "specs_of", "cpu_bf16_moe", "score"]

#: The label of the cases whose CPU counter carries a backend effect beyond the estimator's tensors:
#: a mixture-of-experts model computing in bf16 on torch's CPU backend (the experts' slices take new
#: sizes every step and glibc keeps the freed space resident; docs/estimator.md, "MoE in bf16 on CPU").
#: A guarded run fixes the mmap threshold (``memguard_core.step_heap.fix_mmap_threshold``) and so do these cases' children.
CPU_BF16_MOE = "cpu-bf16-moe"

#: ModelSpec fields read from the config that records made before the field existed lack.
_CONFIG_FIELDS = ("attention_dropout", "residual_dropout", "embedding_dropout", "attn_logit_softcapping",
                  "final_logit_softcapping")


def model_spec_from_dict(d: dict):
    """A ``ModelSpec`` from its ``dataclasses.asdict`` form (as a child records it), nested types
    (parameter counts, linear shapes, a vision tower, the task head) rebuilt."""
    from memguard_core.estimator.specs import BlockKind, LinearShape, ModelSpec, ParamCounts, VisionTower

    from memguard_core.estimator.mlx import MlxParamCounts

    d = dict(d)
    # a live mlx_lm model's counts carry its norm weights apart (MlxParamCounts)
    counts = MlxParamCounts if "norm_weights_in_blocks" in d["params"] else ParamCounts
    d["params"] = counts(**d["params"])
    d["block_kinds"] = tuple(BlockKind(**x) for x in d.get("block_kinds") or ())
    d["block_linears"] = tuple(LinearShape(**x) for x in d.get("block_linears") or ())
    d["decoder_block_linears"] = tuple(LinearShape(**x) for x in d.get("decoder_block_linears") or ())
    if isinstance(d.get("head"), dict):  # the task head (a record from before it has none: a causal LM)
        from memguard_core.estimator.heads import TaskHead

        d["head"] = TaskHead(**d["head"])
    vt = d.get("vision_tower")
    if isinstance(vt, dict):  # a recorded vision-language spec: its tower's linears as LinearShape too
        vt = dict(vt)
        for key in ("block_linears", "projector_linears", "unused_linears"):
            vt[key] = tuple(LinearShape(**x) if isinstance(x, dict) else x for x in vt.get(key) or ())
        d["vision_tower"] = VisionTower(**vt)
    return ModelSpec(**d)


def _with_config_fields(case: dict, spec: dict) -> dict:
    """A recorded HF model spec with the config-derived fields it lacks (a record measured before
    they existed) read from the case's architecture config, so ``--reuse`` scores today's model."""
    if case.get("backend") != "hf" or all(f in spec for f in _CONFIG_FIELDS):
        return spec
    try:
        from transformers import AutoConfig

        from memguard_core.estimator.config_fields import config_numbers

        arch = arch_of(case)
        nums = config_numbers(AutoConfig.for_model(arch.pop("model_type"), **arch))
    except Exception:
        return spec
    return dict(spec, **{f: nums[f] for f in _CONFIG_FIELDS if f not in spec and f in nums})


def specs_of(case: dict, rec: dict):
    """(ModelSpec, TrainSpec) of a measured case: the model as introspected in the child; the
    settings from the case (HF) or as ``memguard_mlx`` read them from mlx_lm's args (MLX)."""
    from memguard_core.estimator.specs import TrainSpec

    ms = model_spec_from_dict(_with_config_fields(case, rec["model_spec"]))
    if rec.get("train_spec"):
        t = dict(rec["train_spec"])
        t["lora_targets"] = tuple(t["lora_targets"])
        if "ranks" in t:  # records written before TrainSpec.ranks became world_size
            t["world_size"] = t.pop("ranks")
        ts = TrainSpec(**t)
        return _with_block_kinds(case, ms, ts), ts
    kw = case["train"]
    ts = TrainSpec(batch_size=kw["batch_size"], seq_length=kw["seq_length"], grad_accum=kw["grad_accum"],
                   target_length=kw.get("target_length"), method=kw["method"], lora_rank=kw["lora_rank"], lora_targets=tuple(kw["lora_targets"]),
                   lora_layers=kw["lora_layers"], lora_dropout=kw.get("lora_dropout", 0.0),
                   optimizer=kw["optimizer"], dtype=kw["dtype"],
                   mixed_precision=kw["mixed_precision"], grad_checkpoint=kw["grad_checkpoint"],
                   attn_impl=kw["attn_impl"], framework="hf", device=case.get("device", "cpu"),
                   resident_file_bytes=rec.get("resident_file_bytes"),
                   heap_trim=bool(rec.get("heap_trim", case.get("trim_heap", True))),
                   glibc=rec.get("glibc"))   # records before 2026-11-29 have none: measured on glibc 2.36
    return _with_block_kinds(case, ms, ts), ts


def _with_block_kinds(case: dict, ms, ts):
    """``ms`` with the block kinds the case's config builds and the census of those the rules do
    not model (``memguard_hf.block_trace``), as ``memguard estimate`` and the guard read them."""
    if case.get("backend") != "hf" or ms.block_kinds:
        return ms
    from transformers import AutoConfig

    from memguard_hf.block_trace import with_block_kinds

    arch = arch_of(case)
    return with_block_kinds(AutoConfig.for_model(arch.pop("model_type"), **arch), ms, ts)


def cpu_bf16_moe(ms, ts) -> bool:
    """True for a mixture-of-experts model (``ms.is_moe``) whose matmuls run in bf16 (pure bf16 or
    bf16 autocast) on torch's CPU backend (``ts.framework`` hf / lightning, ``ts.device`` cpu):
    the cases :data:`CPU_BF16_MOE` labels and the reports summarise apart."""
    from memguard_core.estimator.trainable import routed_half_precision_on_cpu

    return routed_half_precision_on_cpu(ms, ts) and ts.dtype == "bf16"


def score(case: dict, rec: dict, *, seed: bool = True) -> dict:
    """Estimate a measured case; returns a result row (name, backend, counter, estimate_bytes,
    actual_bytes, error = (estimate - actual) / actual, phase, seconds, breakdown, seed_*)."""
    from memguard_core.estimator.estimate import estimate

    ms, ts = specs_of(case, rec)
    est = estimate(ms, ts)
    actual = int(rec["peak_bytes"])
    row = dict(name=case["name"], backend=case["backend"], held_out=bool(case.get("held_out")),
               counter=rec.get("counter", ts.device),
               estimate_bytes=int(est.peak_bytes), actual_bytes=actual,
               error=(est.peak_bytes - actual) / actual, phase=est.phase, seconds=rec.get("seconds"),
               breakdown=est.breakdown)
    if case.get("full_depth"):
        row.update(full_depth=True, arch_fitted=bool(case.get("arch_fitted")),
                   arch_rules=bool(case.get("arch_rules")), date=rec.get("date"))
    if cpu_bf16_moe(ms, ts):
        row["cpu_backend_effect"] = CPU_BF16_MOE
    if rec.get("step_peak_bytes"):
        row["step_peak_bytes"] = list(rec["step_peak_bytes"])
    if seed:
        sb = seed_estimate_bytes(ms, ts)
        if sb is not None:
            row["seed_estimate_bytes"] = sb
            row["seed_error"] = (sb - actual) / actual
    return row
