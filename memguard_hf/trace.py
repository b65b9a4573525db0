"""``memguard estimate --trace``: one training step of the model's own code on fake tensors, its
live tensor bytes counted by category, beside the analytic estimate.

    from memguard_core.spec import TrainSpec
    from memguard_hf.trace import trace_step
    tr = trace_step("config.json", TrainSpec(batch_size=4, seq_length=256, method="full", dtype="fp32"))
    tr.peak_bytes, tr.peak_phase, tr.terms["activations"], tr.modules[:5]

How (nothing of model size is allocated):

1. the architecture is built from its config on the meta device
   (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``), in the dtype the
   :class:`~memguard_core.spec.TrainSpec` implies -- ``dtype`` when ``mixed_precision`` is False
   (pure half weights), fp32 masters with ``torch.autocast(dtype)`` around the forward when it is
   True; LoRA is applied with PEFT ``get_peft_model(model, LoraConfig(r=lora_rank,
   target_modules=...))`` on the meta model (PEFT does not work on fake tensors: it moves each new
   adapter to its base layer's device with ``Module.to``, which swaps a FakeTensor parameter's
   payload with ``torch.utils.swap_tensors`` and fails, "Cannot swap t1 because it has weakref
   associated with it"; on the meta model the adapters are created and moved like the rest, and
   step 2 makes them fake);
2. ``model.to_empty(device="cpu")`` under ``torch._subclasses.fake_tensor.FakeTensorMode``: every
   parameter, buffer and activation from here on is a FakeTensor (shape, dtype, device and a meta
   storage; no data);
3. one steady-state training step runs: the optimizer's states are created first by a step on
   zero gradients (they exist from the 2nd step on, as the analytic ``loss`` moment assumes), then,
   under ``torch.distributed._tools.mem_tracker.MemTracker``, the forward with ``labels =
   input_ids`` (the loss as HF computes it: ``model(**batch).loss``, the model output dropped as
   ``Trainer.compute_loss`` does), ``loss.backward()`` and ``optimizer.step()``.

MemTracker (PyTorch ``torch/distributed/_tools/mem_tracker.py``; docs: "torch.distributed._tools
MemTracker", a ``TorchDispatchMode`` that "categorizes the tracked tensors as parameters, buffers,
activations, gradients, temporary memory and optimizer states") counts every tensor storage created
or registered in its context, by category: ``Parameter``, ``Buffer``, ``Gradient`` (labelled by
gradient hooks), ``Activation`` (created in the forward, and in a checkpointed block's recompute),
``Temp`` (created in the backward), ``Optstate`` (created in ``optimizer.step``), ``Other``
(``track_external`` tensors: the batch). A storage is freed when its last reference goes, so the
sums are the live tensor bytes at every op. This module adds to it (subclass ``_StepTracker``):
the stage of the step (:data:`STAGES`), the module that created each forward tensor (per-module
rows), autocast's cached weight casts (weight copies), a peak per stage and per category; and it
works around where MemTracker (torch 2.13) falls short:

* it hooks the gradient of every parameter, which raises on a frozen one ("cannot register a hook
  on a tensor that doesn't require gradient": LoRA's base) -- only trainable parameters are hooked;
* it updates every module's peak at every op (O(modules) per op, which dominates the trace time
  of a deep model) -- only the modules running are visited, with the same result;
* fake ``aten._grouped_mm`` (transformers' default MoE experts) accepts only bf16 inputs (its meta
  function follows the CUDA kernel) while the CPU kernel takes fp32 -- the output is shaped by the
  meta function on bf16 views, in the inputs' dtype.

The batch carries no attention mask (a batch without padding): on fake tensors transformers cannot
see that a mask of ones masks nothing and would build the 4-D mask and repeat sdpa's KV heads, which
the real run skips.

What a live-tensor trace cannot see: the runtime overhead (interpreter, libraries, CUDA context)
and the allocator's slack (glibc heap pages left resident on CPU, the caching allocator's reserved
blocks on CUDA), which the analytic estimate adds as ``runtime_overhead`` and ``allocator_slack``;
and anything allocated outside torch's dispatcher.

Only ``device="cpu"`` fake tensors: a fake ``cuda`` device needs a CUDA-enabled torch build (in a
CPU build ``to_empty(device="cuda")`` under FakeTensorMode aborts the process with "PyTorch is not
linked with support for cuda devices"), so other devices raise :class:`ConfigError` first. The live
bytes are those of the model's CPU code path (sdpa's CPU kernels, grouped_mm experts); CUDA rounds
each block up to 512 bytes.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from memguard_core.errors import ConfigError, MemGuardError
from memguard_core.estimator.readers_hf import is_vision_language as _is_vision_language
from memguard_core.spec import DEFAULT_LORA_TARGETS, TrainSpec, peft_default_lora_targets

__all__ = ["TraceResult", "ModuleRow", "trace_step", "compare", "comparison_table", "STAGES", "trace_for_cli",
           "trace_json", "print_trace"]

#: The stages of the traced step, in order:
#:   ``forward``       from the first op until the decoder stack (``model.base_model``) returns;
#:   ``loss``          the head, the loss, and the backward until the gradient of the head's output
#:                     (the logits) is ready: the logits' working set;
#:   ``backward``      the head's backward and the blocks' down to the lowest block the backward
#:                     reaches (exclusive): the saved activations are released block by block;
#:   ``backward_end``  that lowest block's backward, the embeddings' and the last gradient
#:                     accumulations: the end of the backward, where all gradients are held;
#:   ``optimizer``     ``optimizer.step()``.
#: The analytic ``loss`` moment (end of the forward / start of the backward) covers ``forward`` and
#: ``loss``, its ``backward`` moment (end of the backward) ``backward_end``, its ``optimizer``
#: moment ``optimizer``; nothing analytic corresponds to the ``backward`` stage alone.
STAGES = ("forward", "loss", "backward", "backward_end", "optimizer")

#: analytic moment -> the traced stages it covers
_MOMENT_STAGES = {"loss": ("forward", "loss"), "backward": ("backward_end",), "optimizer": ("optimizer",)}

#: MemTracker reference type value -> this module's category name
_CATEGORY = {"Parameter": "weights", "Buffer": "buffers", "Gradient": "gradients",
             "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer_states",
             "Other": "inputs"}

#: set to a list to receive (module, bytes, shape, dtype) of every forward tensor alive at the end of
#: the forward of the next trace (debugging the per-module rows)
_DEBUG_TENSORS: Optional[list] = None

_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ---------------------------------------------------------------------------------------------
# result


@dataclass(frozen=True)
class ModuleRow:
    """One module's share of the traced step (bytes).

    Attributes:
        name: the module's qualified name in the model as traced (PEFT-wrapped names included);
            the root model is its class name.
        activation_bytes: bytes of the tensors this module's own code created in the forward (not
            its children's) that are still alive at the end of the forward (saved for the backward,
            or held as outputs).
        param_bytes: bytes of the module's parameters (its children's included), as MemTracker
            counts them.
        forward_peak_bytes: how far the live bytes rose above their level at the module's first
            forward call, during that call (MemTracker's ``Peak-Forward`` minus ``Pre-Forward``).
        backward_peak_bytes: the same for its backward (``Peak-Backward`` minus ``Pre-Backward``);
            0 when its backward was not tracked.
    """

    name: str
    activation_bytes: int
    param_bytes: int = 0
    forward_peak_bytes: int = 0
    backward_peak_bytes: int = 0


@dataclass(frozen=True)
class TraceResult:
    """A traced training step. All sizes in bytes.

    Attributes:
        peak_bytes: peak of the live tensor bytes over the step (every category, the batch included).
        peak_phase: the stage of that peak (one of :data:`STAGES`).
        at_peak: category -> bytes at that peak: ``weights``, ``buffers``, ``gradients``,
            ``optimizer_states`` (with the optimizer's temporaries while it steps),
            ``activations`` (created in the forward or a recompute), ``temporaries`` (created in
            the backward), ``inputs`` (the batch).
        category_peaks: category -> the largest value the category reached (at any moment).
        phase_peaks: stage -> the peak of the live bytes within it.
        phase_breakdowns: stage -> the categories at that stage's peak.
        terms: the terms comparable with the analytic breakdown:
            ``weights`` (parameters), ``buffers``, ``gradients`` (all ``.grad`` after the
            backward), ``optimizer_states`` (before the step), ``optimizer_temporaries`` (the
            step's rise above its states), ``weight_copies`` (autocast's weight casts alive at
            the end of the forward), ``activations`` (tensors created in the forward up to the
            end of the decoder stack that are alive when the loss is returned: the blocks' saved
            tensors, the final norm's, under checkpointing each block's input), ``logits`` (peak
            of the tensors created by the head and the loss, forward and backward, until the
            gradient of the logits is ready: the ``loss`` stage), ``backward_working_set``
            (activations and temporaries at the ``backward_end`` stage's peak), ``inputs``.
        modules: per-module rows, the ``top_modules`` largest by ``activation_bytes``.
        seconds: wall time of reading the config, the build and the step (the imports of torch,
            transformers and peft excluded).
        build_seconds: of it, building the model, the adapters and the optimizer states.
        settings: what ran: model class, weights dtype, autocast dtype, attention and experts
            implementations, optimizer class, LoRA targets, checkpointing, batch shape.
        process_peak_rss_bytes: the process's peak resident set size (``ru_maxrss``) after the
            trace, for checking that nothing of model size was allocated.
        notes: assumptions that applied.
    """

    peak_bytes: int
    peak_phase: str
    at_peak: Dict[str, int]
    category_peaks: Dict[str, int]
    phase_peaks: Dict[str, int]
    phase_breakdowns: Dict[str, Dict[str, int]]
    terms: Dict[str, int]
    modules: List[ModuleRow]
    seconds: float
    build_seconds: float
    settings: Dict[str, Any] = field(default_factory=dict)
    process_peak_rss_bytes: int = 0
    notes: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-safe dict of every field (bytes as ints; ``modules`` as a list of dicts)."""
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d


# ---------------------------------------------------------------------------------------------
# the tracker


def _make_tracker_class():
    """``MemTracker`` subclass (built lazily: torch is imported only when tracing)."""
    import torch
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary

    needed = ("_track", "_update_peak_stats", "_curr_mem_snap", "_mod_tracker", "_pre_fw_hook",
              "_peak_mem", "_peak_mem_snap", "_track_module_params_and_buffers",
              "_param_to_grad_hook_handles", "_update_and_maybe_create_winfos", "_ref_class")
    probe = MemTracker()
    missing = [a for a in needed if not hasattr(probe, a)]
    if missing:
        raise MemGuardError(f"--trace needs torch's MemTracker with {', '.join(missing)} "
                            f"(torch {torch.__version__} lacks them; tested with torch 2.13)")
    to_copy = torch.ops.aten._to_copy.default
    grouped_mm = getattr(torch.ops.aten, "_grouped_mm", None)
    grouped_mm = getattr(grouped_mm, "default", None)

    def _grouped_mm_shape(func):
        """``aten._grouped_mm`` for fp32 / fp16 inputs on fake tensors. Its meta function (torch
        ``_meta_registrations.py`` ``_meta_grouped_mm_common``) accepts only bf16 -- the CUDA kernel's
        rule -- while the CPU kernel (torch >= 2.9) takes any float dtype, and transformers' MoE
        experts (``integrations/moe.py``, the default ``grouped_mm`` implementation) call it in the
        weights' dtype. The output's shape is the same for every dtype: the meta function runs on bf16
        views of the inputs (fake, not tracked, no data) and an empty tensor of that shape in the
        inputs' dtype is returned."""
        def run(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
            bf = torch.bfloat16
            r = func(mat_a.to(bf), mat_b.to(bf), offs=offs, bias=None if bias is None else bias.to(bf),
                     out_dtype=None)
            return torch.empty_strided(r.shape, r.stride(), dtype=out_dtype or mat_a.dtype, device=r.device)
        return run

    class _StepTracker(MemTracker):
        """MemTracker + stages, creating modules, weight casts, per-stage peaks (see module doc)."""

        def __init__(self, names: Dict[int, str], param_storages) -> None:
            super().__init__()
            self.stage = "forward"
            self._names = names                    # id(module) -> qualified name
            self._stack: List[str] = []            # modules whose forward is running
            self._params = param_storages          # WeakIdKeyDictionary of parameter storages
            self._tags = WeakIdKeyDictionary()     # storage -> (bytes, stage, kind, module, ref)
            self.live = {"fwd": 0, "copy": 0}      # live bytes of forward tensors / weight casts
            self._casting = False
            self._stats_by_fqn: Dict[str, Any] = {}
            self.stage_peak: Dict[str, int] = {s: -1 for s in STAGES}
            self.stage_snap: Dict[str, Dict[str, int]] = {}
            self.cat_peak: Dict[str, int] = {}
            self.logits_peak = 0

        # module stack (global forward hooks; the recompute of a checkpointed block runs them too)
        def push(self, module, *_):
            self._stack.append(self._names.get(id(module), type(module).__name__))

        def pop(self, *_):
            if self._stack:
                self._stack.pop()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # autocast's cast of a parameter (``cached_cast``: aten._to_copy of a leaf weight)
            self._casting = func is to_copy and bool(args) and isinstance(args[0], torch.Tensor) \
                and any(st in self._params for st in get_untyped_storages(args[0]))
            if grouped_mm is not None and func is grouped_mm and args and args[0].dtype != torch.bfloat16:
                func = _grouped_mm_shape(func)
            try:
                return super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._casting = False

        def _track(self, reftype, t):
            super()._track(reftype, t)
            if self.stage not in ("forward", "loss"):
                return
            for st in get_untyped_storages(t):
                if st in self._tags or st in self._params:
                    continue
                kind = "copy" if self._casting else ("fwd" if self.stage == "forward" else "head")
                n = st.nbytes()
                ref = weakref.ref(st, self._make_release(kind, n))
                self._tags[st] = (n, self.stage, kind, self._stack[-1] if self._stack else "", ref,
                                  (tuple(t.shape), str(t.dtype).replace("torch.", "")))
                if kind in self.live:
                    self.live[kind] += n

        def _make_release(self, kind: str, n: int):
            live = self.live

            def release(_ref) -> None:
                if kind in live:
                    live[kind] -= n
            return release

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # MemTracker registers a gradient hook on every parameter, which raises on a frozen one
            # ("cannot register a hook on a tensor that doesn't require gradient"): LoRA's frozen
            # base. Track them all, hook only those that train (the same two hooks MemTracker uses).
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                grad = self._ref_class.GRAD

                def hook(g):
                    if g is not None:
                        self._update_and_maybe_create_winfos(g, grad)
                for p in module.parameters():
                    if p.requires_grad and self._param_to_grad_hook_handles.get(p, None) is None:
                        self._param_to_grad_hook_handles[p] = (
                            p.register_hook(hook), p.register_post_accumulate_grad_hook(lambda q: hook(q.grad)))
            return out

        def _pre_fw_hook(self, module, inputs):
            super()._pre_fw_hook(module, inputs)
            st = self.memory_tracking.get(module)
            if st is not None:
                self._stats_by_fqn[st.mod_fqn] = st

        def _update_peak_stats(self, peak_state) -> None:
            # MemTracker's update, visiting only the modules now running (same result)
            curr = self._curr_mem_snap
            for fqn in self._mod_tracker.parents:
                ms = self._stats_by_fqn.get(fqn)
                if ms is None or ms.mod_fqn != fqn or peak_state not in ms.snapshots:
                    continue
                for dev, snap in curr.items():
                    if ms.local_peak.get(dev, 0) < snap["Total"]:
                        ms.local_peak[dev] = snap["Total"]
                        ms.snapshots[peak_state][-1][dev] = dict(snap)
            for dev, snap in curr.items():
                total = snap["Total"]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)
                for k, v in snap.items():
                    key = getattr(k, "value", k)
                    if v > self.cat_peak.get(key, 0):
                        self.cat_peak[key] = v
                if total > self.stage_peak[self.stage]:
                    self.stage_peak[self.stage] = total
                    self.stage_snap[self.stage] = {getattr(k, "value", k): v for k, v in snap.items()}
                if self.stage == "loss":
                    head = snap.get(self._ref_class.ACT, 0) + snap.get(self._ref_class.TEMP, 0) \
                        - self.live["fwd"] - self.live["copy"]
                    self.logits_peak = max(self.logits_peak, head)

        def current(self) -> Dict[str, int]:
            out: Dict[str, int] = {}
            for snap in self._curr_mem_snap.values():
                for k, v in snap.items():
                    key = getattr(k, "value", k)
                    out[key] = out.get(key, 0) + v
            return out

        def forward_rows(self) -> Dict[str, int]:
            """Live forward-tensor bytes by creating module (weight casts excluded)."""
            rows: Dict[str, int] = {}
            for _st, (n, _stage, kind, mod, _ref, _shape) in list(self._tags.items()):
                if kind == "fwd":
                    rows[mod] = rows.get(mod, 0) + n
            return rows

        def forward_tensors(self) -> List[Tuple[str, int, tuple, str]]:
            """Live forward tensors: (creating module, bytes, shape, dtype), for debugging."""
            return [(mod, n, shp[0], shp[1]) for _st, (n, _stage, kind, mod, _ref, shp)
                    in list(self._tags.items()) if kind == "fwd"]

    return _StepTracker


# ---------------------------------------------------------------------------------------------
# building


def _load_config(config_or_path: Any):
    """A transformers config from a path / directory / dict / ``PretrainedConfig``."""
    from memguard_core.estimator.readers_hf import config_from_dict as _config_from_dict, load_config_dict as _load_config_dict

    if hasattr(config_or_path, "to_dict") and hasattr(config_or_path, "model_type"):
        return config_or_path
    d, label = _load_config_dict(config_or_path)
    return _config_from_dict(d, label)


def _validate(ts: Any, device: Any) -> None:
    if not isinstance(ts, TrainSpec):
        raise ConfigError("train_spec", "a memguard_core.spec.TrainSpec", type(ts).__name__)
    if str(device) != "cpu":
        raise ConfigError("device", "'cpu' (the trace runs the step on fake CPU tensors; a fake cuda device "
                          "needs a CUDA build of torch, and in a CPU build it aborts the process)", device)
    # the trace runs the model's own torch code on fake tensors: the same step whichever loop
    # (HF Trainer, Lightning, a plain PyTorch loop) drives it; only mlx runs other code
    if ts.framework not in ("hf", "lightning", "torch"):
        raise ConfigError("framework", "hf, lightning or torch for --trace (it runs the torch model)",
                          ts.framework)
    if ts.method == "qlora":
        raise ConfigError("method", "full or lora for --trace (bitsandbytes 4-bit layers do not run on fake "
                          "CPU tensors)", ts.method)
    if ts.optimizer in ("adamw-8bit", "paged-adamw-8bit", "paged-adamw-32bit"):
        raise ConfigError("optimizer", "adam, adamw, sgd, sgd-momentum or adafactor for --trace "
                          "(bitsandbytes' 8-bit AdamW needs CUDA)", ts.optimizer)
    if ts.attn_impl not in ("eager", "sdpa"):
        raise ConfigError("attn_impl", "eager or sdpa for --trace (flash-attention kernels need CUDA)",
                          ts.attn_impl)


def _make_optimizer(params, name: str):
    """The optimizer HF ``Trainer`` builds for ``--optim`` (transformers ``training_args.py``):
    ``adamw`` -> ``adamw_torch_fused`` (its default), ``adam`` -> ``torch.optim.Adam(fused=True)``,
    ``sgd`` -> ``torch.optim.SGD`` without momentum, ``sgd-momentum`` -> momentum 0.9,
    ``adafactor`` -> ``transformers.optimization.Adafactor(scale_parameter=False,
    relative_step=False)``."""
    import torch

    lr = 5e-5
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)
    raise ConfigError("optimizer", "adam, adamw, sgd, sgd-momentum or adafactor", name)  # pragma: no cover


def _lora(model, cfg, ts: TrainSpec):
    from peft import LoraConfig, get_peft_model

    targets = ts.lora_targets
    tm: Any = "all-linear" if any(t.lower() in ("all-linear", "all_linear") for t in targets) else list(targets)
    kw: Dict[str, Any] = {}
    if ts.lora_layers is not None:
        n = int(getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg,
                        "num_hidden_layers"))
        kw["layers_to_transform"] = list(range(max(n - ts.lora_layers, 0), n))
    try:
        return get_peft_model(model, LoraConfig(r=ts.lora_rank, target_modules=tm, task_type="CAUSAL_LM",
                                                lora_dropout=ts.lora_dropout, **kw))
    except ValueError as exc:
        raise ConfigError("lora_targets", "module names of this model (or all-linear)",
                          f"{','.join(targets)} ({exc})") from None


# ---------------------------------------------------------------------------------------------
# entry


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
        device: ``"cpu"`` only (see the module docstring).
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
    _validate(train_spec, device)
    ts = train_spec
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.weak import WeakIdKeyDictionary
    from transformers import AutoModelForCausalLM

    Tracker = _make_tracker_class()
    t_start = time.perf_counter()
    cfg = _load_config(config_or_path)
    if ts.method != "full" and ts.lora_targets == DEFAULT_LORA_TARGETS:
        # no targets given: PEFT's default for this model type, as estimate() and plan() resolve it
        default = peft_default_lora_targets(getattr(cfg, "model_type", None))
        if default is not None:
            ts = ts.replace(lora_targets=default)
    amp = bool(ts.mixed_precision) and ts.dtype != "fp32"
    compute = getattr(torch, _TORCH_DTYPE[ts.dtype])
    wdtype = torch.float32 if amp else compute
    notes: List[str] = []

    t0 = time.perf_counter()
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5's deprecation notices
            auto = AutoModelForCausalLM
            if _is_vision_language(cfg):  # the class users fine-tune: vision tower + language model
                from transformers import AutoModelForImageTextToText as auto
            model = auto.from_config(cfg, dtype=wdtype, attn_implementation=ts.attn_impl)
    except ConfigError:
        raise
    except Exception as exc:  # whatever the modeling code raises on this config / implementation
        raise ConfigError("config", f"a config transformers can build with attn_implementation="
                          f"{ts.attn_impl!r} ({getattr(cfg, 'model_type', '?')})",
                          f"{type(exc).__name__}: {exc}") from None
    inner = model
    if ts.method != "full":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = _lora(model, cfg, ts)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = int(text_cfg.vocab_size)

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model.to_empty(device="cpu")
        # to_empty gives every parameter its own storage: tie the head back as from_pretrained does
        if hasattr(inner, "tie_weights"):
            inner.tie_weights()
        model.train()
        if ts.grad_checkpoint:
            kw = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:  # transformers < 5
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = _make_optimizer(trainable, ts.optimizer)
        # steady state: the states exist from the 2nd step on
        for p in trainable:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=ts.grad_accum == 1)
        if ts.grad_accum > 1:
            notes.append("grad_accum > 1: the .grad of an earlier micro-batch is resident through the step")
        ids = torch.randint(0, vocab, (ts.batch_size, ts.seq_length))
        # No attention_mask: a batch without padding. On fake tensors transformers cannot tell that
        # a mask of ones masks nothing (``masking_utils._ignore_causal_mask_sdpa`` gives up on a
        # tensor ``is_tracing`` flags, FakeTensors included), so it would build the 4-D mask and
        # make sdpa repeat the KV heads -- which the real run with a mask of ones skips.
        batch = {"input_ids": ids, "labels": ids}
        build_s = time.perf_counter() - t0

        # MemTracker's names (``ModTracker``): the root's class name, then the attribute path
        root = type(model).__name__
        names: Dict[int, str] = {}
        for n, m in model.named_modules(remove_duplicate=False):
            names.setdefault(id(m), f"{root}.{n}" if n else root)
        params = WeakIdKeyDictionary()
        for t in list(model.parameters()) + list(model.buffers()):
            params[t.untyped_storage()] = True
        tr = Tracker(names, params)
        tr.track_external(model, opt, ids)
        start = tr.current()

        stack_body = inner.base_model if hasattr(inner, "base_model") and inner.base_model is not inner else None
        handles = []
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles.append(register_module_forward_pre_hook(tr.push))
        handles.append(register_module_forward_hook(tr.pop, always_call=True))

        def first_output(out):
            h = out[0] if isinstance(out, (tuple, list)) or hasattr(out, "to_tuple") else out
            return h if isinstance(h, torch.Tensor) else None

        def to_backward(_grad):
            if tr.stage == "loss":
                tr.stage = "backward"

        # the lowest block whose output needs a gradient: its backward starts ``backward_end``
        blocks = _blocks(inner, text_cfg)
        lowest: Dict[str, Any] = {"idx": None}

        def block_done(idx: int):
            def hook(_m, _a, out):
                h = first_output(out)
                if tr.stage != "forward" or h is None or not h.requires_grad:
                    return
                if lowest["idx"] is None or idx < lowest["idx"]:
                    lowest["idx"] = idx

                def reached(_g):
                    if idx == lowest["idx"] and tr.stage in ("loss", "backward"):
                        tr.stage = "backward_end"
                h.register_hook(reached)
            return hook

        for i, blk in enumerate(blocks):
            handles.append(blk.register_forward_hook(block_done(i)))

        def body_done(_m, _a, out):
            if tr.stage != "forward":
                return
            tr.stage = "loss"
            h = first_output(out)
            if h is not None and h.requires_grad:
                h.register_hook(to_backward)

        def head_done(_m, _a, out):
            # the backward leaves the loss stage when the gradient of the head's output (the logits)
            # is ready: the head's own backward (its weight's gradient) is the backward stage's
            h = first_output(out)
            if tr.stage == "loss" and h is not None and h.requires_grad:
                h.register_hook(to_backward)

        if stack_body is not None:
            handles.append(stack_body.register_forward_hook(body_done))
        else:
            notes.append("no decoder stack found (model.base_model): activations include the head's")
        head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
        if isinstance(head, torch.nn.Module):
            handles.append(head.register_forward_hook(head_done))
        autocast = torch.autocast("cpu", dtype=compute) if amp else nullcontext()
        at_loss: Dict[str, int] = {}
        try:
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
        except MemGuardError:
            raise
        except Exception as exc:
            raise MemGuardError(f"the {type(inner).__name__} step did not run on fake tensors: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
        finally:
            for h in handles:
                h.remove()

    elapsed = time.perf_counter() - t_start

    def cats(snap: Dict[str, int]) -> Dict[str, int]:
        out = {v: int(snap.get(k, 0)) for k, v in _CATEGORY.items()}
        return out

    phase_peaks = {s: max(int(tr.stage_peak[s]), 0) for s in STAGES}
    peak_phase = max(STAGES, key=lambda s: phase_peaks[s])
    phase_breakdowns = {s: cats(tr.stage_snap.get(s, {})) for s in STAGES}
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
    mods = []
    for st in tr.memory_tracking.values():
        snaps = st.snapshots

        def rise(peak_key, pre_key) -> int:
            pk, pr = snaps.get(peak_key), snaps.get(pre_key)
            if not pk or not pr:
                return 0
            return int(sum(d.get("Total", 0) for d in pk[0].values())
                       - sum(d.get("Total", 0) for d in pr[0].values()))
        from torch.distributed._tools.mem_tracker import _ModState

        mods.append((st.mod_fqn, int(getattr(st, "parameter_mem", 0)),
                     rise(_ModState.PEAK_FW, _ModState.PRE_FW), rise(_ModState.PEAK_BW, _ModState.PRE_BW)))
    by_name = {m[0]: m for m in mods}
    module_rows = []
    for name, nbytes in sorted(rows.items(), key=lambda kv: -kv[1])[:max(int(top_modules), 0)]:
        m = by_name.get(name)
        module_rows.append(ModuleRow(name=name or root, activation_bytes=int(nbytes),
                                     param_bytes=m[1] if m else 0, forward_peak_bytes=max(m[2], 0) if m else 0,
                                     backward_peak_bytes=max(m[3], 0) if m else 0))
    experts = getattr(getattr(inner, "config", None), "_experts_implementation", None)
    settings = {
        "model_class": type(inner).__name__, "layers": int(getattr(text_cfg, "num_hidden_layers", 0) or 0),
        "weights_dtype": str(wdtype).replace("torch.", ""),
        "autocast": str(compute).replace("torch.", "") if amp else None,
        "attn_implementation": getattr(getattr(inner, "config", None), "_attn_implementation", ts.attn_impl),
        "experts_implementation": experts if _has_experts(inner) else None,
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
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = int(rss if sys.platform == "darwin" else rss * 1024)
    return TraceResult(
        peak_bytes=int(max(phase_peaks.values())), peak_phase=peak_phase,
        at_peak=phase_breakdowns[peak_phase], category_peaks=cats(tr.cat_peak),
        phase_peaks=phase_peaks, phase_breakdowns=phase_breakdowns, terms=terms,
        modules=module_rows, seconds=float(elapsed), build_seconds=float(build_s),
        settings=settings, process_peak_rss_bytes=rss_bytes, notes=tuple(notes))


def _blocks(model, text_cfg) -> list:
    """The transformer blocks: the ``nn.ModuleList`` with ``num_hidden_layers`` entries holding the
    most parameters (as ``memguard_core.spec`` finds them); ``[]`` when there is none."""
    import torch.nn as nn

    n = getattr(text_cfg, "num_hidden_layers", None)
    best, size = [], -1
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and (not n or len(mod) == n):
            k = sum(p.numel() for p in mod.parameters())
            if k > size:
                best, size = list(mod), k
    return best


def _has_experts(model) -> bool:
    return any(type(m).__name__.endswith("Experts") for m in model.modules())


# ---------------------------------------------------------------------------------------------
# comparison with the analytic estimate


def compare(trace: TraceResult, est) -> List[Dict[str, Any]]:
    """Traced vs analytic, term by term.

    Args:
        trace: a :class:`TraceResult`.
        est: a ``memguard_core.estimate.MemoryEstimate`` of the same model and settings.

    Returns:
        rows ``{"term", "traced", "analytic", "ratio"}`` (bytes; ratio = traced / analytic, None
        when the analytic term is 0 or the trace cannot see it):

        * ``weights``, ``gradients`` (the backward moment's), ``optimizer_states``,
          ``optimizer_temporaries`` (the optimizer moment's), ``weight_copies`` (autocast);
        * ``activations (end of forward)``: traced ``activations`` vs the loss moment's
          ``activations + attention_scores``;
        * ``logits + loss (peak)``: traced ``logits`` vs the loss moment's ``logits``;
        * ``peak, <moment> moment``: the traced peak over that moment's stages vs the analytic
          moment less ``runtime_overhead`` and ``allocator_slack``; ``peak of live tensors``: the
          same for the whole step;
        * ``runtime_overhead`` and ``allocator_slack`` (the analytic's, traced None: not visible to
          a tensor trace).
    """
    pb = est.phase_breakdowns or {est.phase: est.breakdown}
    lossb = pb.get("loss", est.breakdown)
    bwdb = pb.get("backward", est.breakdown)
    optb = pb.get("optimizer", est.breakdown)
    t = trace.terms
    rows: List[Dict[str, Any]] = []

    def add(term: str, traced: Optional[int], analytic: Optional[int]) -> None:
        ratio = None
        if traced is not None and analytic:
            ratio = round(traced / analytic, 4)
        rows.append({"term": term, "traced": None if traced is None else int(traced),
                     "analytic": None if analytic is None else int(analytic), "ratio": ratio})

    add("weights", t["weights"], lossb.get("weights", 0))
    add("gradients", t["gradients"], bwdb.get("gradients", 0))
    add("optimizer_states", t["optimizer_states"], optb.get("optimizer_states", 0))
    if t["optimizer_temporaries"] or optb.get("optimizer_temporaries", 0):
        add("optimizer_temporaries", t["optimizer_temporaries"], optb.get("optimizer_temporaries", 0))
    if t["weight_copies"] or lossb.get("weight_copies", 0):
        add("weight_copies", t["weight_copies"], lossb.get("weight_copies", 0))
    add("activations (end of forward)", t["activations"],
        lossb.get("activations", 0) + lossb.get("attention_scores", 0))
    add("logits + loss (peak)", t["logits"], lossb.get("logits", 0))

    def live(b: Dict[str, int]) -> int:
        return sum(v for k, v in b.items() if k not in ("runtime_overhead", "allocator_slack", "calibration"))

    for moment, stages in _MOMENT_STAGES.items():
        if moment == "backward" and not trace.phase_peaks.get("backward_end"):
            stages = ("backward",)  # the backward reached no block (nothing below the head trains)
        if moment in pb:
            add(f"peak, {moment} moment", max(trace.phase_peaks.get(s, 0) for s in stages), live(pb[moment]))
    add("peak of live tensors", trace.peak_bytes, max(live(b) for b in pb.values()))
    add("runtime_overhead", None, est.breakdown.get("runtime_overhead", 0))
    add("allocator_slack", None, est.breakdown.get("allocator_slack", 0))
    return rows


def comparison_table(trace: TraceResult, est):
    """A rich ``Table`` of :func:`compare` (MiB), captioned with the trace's settings and time."""
    from rich.table import Table

    s = trace.settings
    t = Table(title="memguard estimate --trace: traced (fake tensors) vs analytic", caption=(
        f"{s.get('model_class')} ({s.get('layers')} blocks), weights {s.get('weights_dtype')}"
        f"{', autocast ' + s['autocast'] if s.get('autocast') else ''}, attn {s.get('attn_implementation')}"
        f"{', experts ' + s['experts_implementation'] if s.get('experts_implementation') else ''}, "
        f"{s.get('optimizer')}; traced peak in the {trace.peak_phase} stage; "
        f"{trace.seconds:.1f} s ({trace.build_seconds:.1f} s build). The trace counts live tensors: "
        f"it cannot see the runtime overhead nor the allocator's slack."))
    t.add_column("term")
    t.add_column("traced MiB", justify="right")
    t.add_column("analytic MiB", justify="right")
    t.add_column("traced/analytic", justify="right")
    for r in compare(trace, est):
        if r["term"].startswith("peak of"):
            t.add_section()
        tr = "-" if r["traced"] is None else f"{r['traced'] / 2**20:,.1f}"
        an = "-" if r["analytic"] is None else f"{r['analytic'] / 2**20:,.1f}"
        ra = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        t.add_row(r["term"], tr, an, ra)
    return t


# ---------------------------------------------------------------------------------------------
# ``memguard estimate --trace``


def trace_for_cli(config: Any, train_spec: TrainSpec) -> TraceResult:
    """:func:`trace_step` for ``memguard estimate --trace``, every module's row kept.

    Raises:
        ConfigError: no ``--config`` (the trace builds the model from a config.json), and what
            :func:`trace_step` raises.
    """
    if not config:
        raise ConfigError("config", "a config.json (--trace builds the model from it)", None)
    return trace_step(config, train_spec, top_modules=100_000)  # every module: the table sums blocks


def trace_json(trace: TraceResult, est) -> dict:
    """The ``"trace"`` object of ``memguard estimate --trace --json``: :meth:`TraceResult.to_dict`
    plus ``"comparison"``, the rows of :func:`compare` (bytes)."""
    d = trace.to_dict()
    d["comparison"] = compare(trace, est)
    return d


def print_trace(trace: TraceResult, est, modules: int = 8) -> None:
    """Print :func:`comparison_table` and the ``modules`` largest activation rows, the blocks'
    modules summed over the blocks (``layers.*.self_attn``: the rows whose names differ only by a
    block index)."""
    import re

    from rich.table import Table

    from memguard_core.report import console

    console().print(comparison_table(trace, est))
    if not trace.modules or modules <= 0:
        return
    groups: Dict[str, List[int]] = {}
    for r in trace.modules:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", r.name)
        groups.setdefault(key, []).append(r.activation_bytes)
    t = Table(title=f"traced activations at the end of the forward, by creating module "
                    f"(top {len(trace.modules)} modules)")
    t.add_column("module")
    t.add_column("blocks", justify="right")
    t.add_column("MiB", justify="right")
    t.add_column("share", justify="right")
    total = max(trace.terms.get("activations", 0), 1)
    for key, vals in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:modules]:
        t.add_row(key, str(len(vals)), f"{sum(vals) / 2**20:,.2f}", f"{sum(vals) / total:.0%}")
    console().print(t)
