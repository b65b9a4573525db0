"""``trace_step``: one training step of a HF model's own code on fake tensors under the step tracker,
its live tensor bytes summed by stage, category and module (``memguard_hf.trace``; the method in
that package's docstring, the findings in docs/estimator.md).
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import nullcontext
from typing import Any, Dict, List, Optional, Tuple

from memguard_core.errors import MemGuardError
from memguard_core.estimator.specs import TrainSpec
from memguard_core.process_peak import process_peak_rss_bytes

from .build import (blocks_of, build_model, dtypes, has_experts, load_config, prepare_step, resolve_lora_targets,
                    validate)
from .result import CATEGORY, STAGES, ModuleRow, TraceResult

__all__ = ["trace_step"]

#: set to a list to receive (module, bytes, shape, dtype) of every forward tensor alive at the end of
#: the forward of the next trace (debugging the per-module rows)
_DEBUG_TENSORS: Optional[list] = None


def trace_step(config_or_path: Any, train_spec: TrainSpec, *, device: str = "cpu",
               top_modules: int = 20) -> TraceResult:
    """Run one training step of the model on fake tensors and measure its live tensor bytes.

    Args:
        config_or_path: a HF ``config.json`` path, a directory holding one, a dict (a parsed
            config.json) or a ``transformers.PretrainedConfig``. The whole model is built (every
            block): cut ``num_hidden_layers`` for a quick look.
        train_spec: the settings: ``batch_size`` x ``seq_length`` random token ids (labels = the
            ids; no padding, so no attention mask), ``dtype`` / ``mixed_precision`` (pure half weights, or
            fp32 weights + ``torch.autocast(dtype)``), ``method`` ``full`` | ``lora`` (PEFT,
            ``lora_rank``, ``lora_targets``, ``lora_layers``), ``grad_checkpoint`` (non-reentrant,
            as HF ``Trainer``), ``attn_impl`` ``eager`` | ``sdpa``, ``optimizer``, ``grad_accum``
            (> 1: the ``.grad`` of an earlier micro-batch is resident through the step).
        device: ``"cpu"`` only (see the ``memguard_hf.trace`` docstring).
        top_modules: how many per-module rows to keep (largest activation bytes first).

    Returns:
        :class:`TraceResult`, sizes in bytes.

    Raises:
        ConfigError: a bad config (unreadable, unknown ``model_type``, not buildable), a device
            other than ``cpu``, ``qlora``, ``adamw-8bit``, ``flash`` attention, the ``mlx``
            framework, LoRA targets that match nothing.
        MemGuardError: the installed torch's MemTracker lacks what the trace uses; the model's code
            cannot run on fake tensors (a data-dependent shape; the message names the op).
    """
    validate(train_spec, device)
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.weak import WeakIdKeyDictionary

    from .tracker import StepTracker, check_mem_tracker

    check_mem_tracker()
    t_start = time.perf_counter()
    cfg = load_config(config_or_path)
    ts = resolve_lora_targets(train_spec, cfg)
    amp, compute, wdtype = dtypes(ts)
    notes: List[str] = []

    t0 = time.perf_counter()
    model, inner = build_model(cfg, ts, wdtype)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = int(text_cfg.vocab_size)

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        opt, ids, batch = prepare_step(model, inner, ts, vocab, notes)
        build_s = time.perf_counter() - t0

        # MemTracker's names (``ModTracker``): the root's class name, then the attribute path
        root = type(model).__name__
        names: Dict[int, str] = {}
        for n, m in model.named_modules(remove_duplicate=False):
            names.setdefault(id(m), f"{root}.{n}" if n else root)
        params = WeakIdKeyDictionary()
        for t in list(model.parameters()) + list(model.buffers()):
            params[t.untyped_storage()] = True
        tr = StepTracker(names, params)
        tr.track_external(model, opt, ids)
        start = tr.current()

        handles = _stage_hooks(tr, inner, text_cfg, notes)
        autocast = torch.autocast("cpu", dtype=compute) if amp else nullcontext()
        try:
            at_loss, rows, after_bwd = _run_step(tr, model, opt, batch, autocast)
        except MemGuardError:
            raise
        except Exception as exc:
            raise MemGuardError(f"the {type(inner).__name__} step did not run on fake tensors: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        finally:
            for h in handles:
                h.remove()

    elapsed = time.perf_counter() - t_start
    settings = _settings(ts, inner, text_cfg, opt, wdtype, compute if amp else None)
    return _result(tr, start, at_loss, after_bwd, _module_rows(tr, rows, root, top_modules), settings,
                   elapsed, build_s, notes)


def _first_output(out):
    import torch

    h = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out
    return h if isinstance(h, torch.Tensor) else None


def _stage_hooks(tr, inner, text_cfg, notes: List[str]) -> list:
    """The hooks that move ``tr.stage`` along :data:`STAGES`: the decoder stack's output ends
    ``forward``; the gradient of the head's output (the logits) ends ``loss``; the lowest block
    whose output needs a gradient starts ``backward_end`` when its gradient arrives. Returns the
    handles (removed by the caller)."""
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    stack_body = inner.base_model if hasattr(inner, "base_model") and inner.base_model is not inner else None
    handles = [register_module_forward_pre_hook(tr.push), register_module_forward_hook(tr.pop, always_call=True)]

    def to_backward(_grad):
        if tr.stage == "loss":
            tr.stage = "backward"

    # the lowest block whose output needs a gradient: its backward starts ``backward_end``
    lowest: Dict[str, Any] = {"idx": None}

    def block_done(idx: int):
        def hook(_m, _a, out):
            h = _first_output(out)
            if tr.stage != "forward" or h is None or not h.requires_grad:
                return
            if lowest["idx"] is None or idx < lowest["idx"]:
                lowest["idx"] = idx

            def reached(_g):
                if idx == lowest["idx"] and tr.stage in ("loss", "backward"):
                    tr.stage = "backward_end"
            h.register_hook(reached)
        return hook

    for i, blk in enumerate(blocks_of(inner, text_cfg)):
        handles.append(blk.register_forward_hook(block_done(i)))

    def body_done(_m, _a, out):
        if tr.stage != "forward":
            return
        tr.stage = "loss"
        h = _first_output(out)
        if h is not None and h.requires_grad:
            h.register_hook(to_backward)

    def head_done(_m, _a, out):
        # the backward leaves the loss stage when the gradient of the head's output (the logits)
        # is ready: the head's own backward (its weight's gradient) is the backward stage's
        h = _first_output(out)
        if tr.stage == "loss" and h is not None and h.requires_grad:
            h.register_hook(to_backward)

    if stack_body is not None:
        handles.append(stack_body.register_forward_hook(body_done))
    else:
        notes.append("no decoder stack found (model.base_model): activations include the head's")
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        handles.append(head.register_forward_hook(head_done))
    return handles


def _run_step(tr, model, opt, batch: Dict[str, Any], autocast) -> Tuple[Dict[str, int], Dict[str, int],
                                                                          Dict[str, int]]:
    """The step under the tracker: forward (the loss as HF computes it), backward, optimizer step.
    Returns ``(live bytes at the loss, forward rows by module, categories after the backward)``."""
    with tr:
        with autocast:
            loss = model(**batch).loss
        if tr.stage == "forward":
            tr.stage = "loss"
        at_loss = dict(tr.live)
        rows = tr.forward_rows()
        if _DEBUG_TENSORS is not None:
            _DEBUG_TENSORS[:] = tr.forward_tensors()
        loss.backward()
        del loss
        tr.stage = "backward_end"  # (a model the backward leaves before any block)
        after_bwd = tr.current()
        tr.stage = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
    return at_loss, rows, after_bwd


def _module_rows(tr, rows: Dict[str, int], root: str, top_modules: int) -> List[ModuleRow]:
    """The ``top_modules`` largest forward rows, with each module's parameters and its forward /
    backward rises as MemTracker recorded them."""
    from torch.distributed._tools.mem_tracker import _ModState

    mods = []
    for st in tr.memory_tracking.values():
        snaps = st.snapshots

        def rise(peak_key, pre_key) -> int:
            pk, pr = snaps.get(peak_key), snaps.get(pre_key)
            if not pk or not pr:
                return 0
            return int(sum(d.get("Total", 0) for d in pk[0].values())
                       - sum(d.get("Total", 0) for d in pr[0].values()))

        mods.append((st.mod_fqn, int(getattr(st, "parameter_mem", 0)),
                     rise(_ModState.PEAK_FW, _ModState.PRE_FW), rise(_ModState.PEAK_BW, _ModState.PRE_BW)))
    by_name = {m[0]: m for m in mods}
    module_rows = []
    for name, nbytes in sorted(rows.items(), key=lambda kv: -kv[1])[:max(int(top_modules), 0)]:
        m = by_name.get(name)
        module_rows.append(ModuleRow(name=name or root, activation_bytes=int(nbytes),
                                     param_bytes=m[1] if m else 0, forward_peak_bytes=max(m[2], 0) if m else 0,
                                     backward_peak_bytes=max(m[3], 0) if m else 0))
    return module_rows


def _settings(ts: TrainSpec, inner, text_cfg, opt, wdtype, autocast_dtype) -> Dict[str, Any]:
    """What ran (``TraceResult.settings``)."""
    import torch

    experts = getattr(getattr(inner, "config", None), "_experts_implementation", None)
    settings = {
        "model_class": type(inner).__name__, "layers": int(getattr(text_cfg, "num_hidden_layers", 0) or 0),
        "weights_dtype": str(wdtype).replace("torch.", ""),
        "autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype is not None else None,
        "attn_implementation": getattr(getattr(inner, "config", None), "_attn_implementation", ts.attn_impl),
        "experts_implementation": experts if has_experts(inner) else None,
        "optimizer": type(opt).__name__ + (" (fused)" if opt.defaults.get("fused") else ""),
        "method": ts.method, "lora_rank": ts.lora_rank if ts.method != "full" else None,
        "lora_targets": list(ts.lora_targets) if ts.method != "full" else None,
        "grad_checkpoint": bool(ts.grad_checkpoint), "grad_accum": ts.grad_accum,
        "batch": [ts.batch_size, ts.seq_length],
        "torch": torch.__version__,
    }
    try:
        import transformers

        settings["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass
    return settings


def _cats(snap: Dict[str, int]) -> Dict[str, int]:
    return {v: int(snap.get(k, 0)) for k, v in CATEGORY.items()}


def _result(tr, start: Dict[str, int], at_loss: Dict[str, int], after_bwd: Dict[str, int],
            module_rows: List[ModuleRow], settings: Dict[str, Any], elapsed: float, build_s: float,
            notes: List[str]) -> TraceResult:
    """The :class:`TraceResult` of the tracker's figures: the peaks per stage and category and the
    terms comparable with the analytic breakdown."""
    phase_peaks = {s: max(int(tr.stage_peak[s]), 0) for s in STAGES}
    peak_phase = max(STAGES, key=lambda s: phase_peaks[s])
    phase_breakdowns = {s: _cats(tr.stage_snap.get(s, {})) for s in STAGES}
    opt_start = int(start.get("Optstate", 0))
    bwd = tr.stage_snap.get("backward_end", {})
    terms = {
        "weights": int(start.get("Parameter", 0)),
        "buffers": int(start.get("Buffer", 0)),
        "gradients": int(after_bwd.get("Gradient", 0)),
        "optimizer_states": opt_start,
        "optimizer_temporaries": max(int(tr.stage_snap.get("optimizer", {}).get("Optstate", opt_start)) - opt_start, 0),
        "weight_copies": int(at_loss.get("copy", 0)),
        "activations": int(at_loss.get("fwd", 0)),
        "logits": int(tr.logits_peak),
        "backward_working_set": int(bwd.get("Activation", 0) + bwd.get("Temp", 0)),
        "inputs": int(start.get("Other", 0)),
    }
    # This process's own peak (VmHWM on Linux), not ``ru_maxrss``: a process exec'd from a larger one
    # (a test runner, a notebook kernel) keeps that parent's resident set as its ``ru_maxrss`` floor
    # (fs/exec.c ``exec_mmap``), which says nothing of what the trace allocated.
    rss_bytes = process_peak_rss_bytes()
    if rss_bytes is None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rss_bytes = int(rss if sys.platform == "darwin" else rss * 1024)
    return TraceResult(
        peak_bytes=int(max(phase_peaks.values())), peak_phase=peak_phase,
        at_peak=phase_breakdowns[peak_phase], category_peaks=_cats(tr.cat_peak),
        phase_peaks=phase_peaks, phase_breakdowns=phase_breakdowns, terms=terms,
        modules=module_rows, seconds=float(elapsed), build_seconds=float(build_s),
        settings=settings, process_peak_rss_bytes=rss_bytes, notes=tuple(notes))
