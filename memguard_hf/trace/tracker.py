"""The tracker of ``memguard estimate --trace``: torch's ``MemTracker`` plus the stage of the step,
the module that created each forward tensor, autocast's weight casts and a peak per stage and per
category (``memguard_hf.trace``; docs/estimator.md). Imported only when a trace runs (it imports
torch's ``MemTracker``).

MemTracker (PyTorch ``torch/distributed/_tools/mem_tracker.py``) counts every tensor storage
created or registered in its context by category; :class:`StepTracker` works around where it
(torch 2.13) falls short:

* it hooks the gradient of every parameter, which raises on a frozen one ("cannot register a hook
  on a tensor that doesn't require gradient": LoRA's base) -- only trainable parameters are hooked;
* it updates every module's peak at every op (O(modules) per op, which dominates the trace time
  of a deep model) -- only the modules running are visited, with the same result;
* fake ``aten._grouped_mm`` (transformers' default MoE experts) accepts only bf16 inputs (its meta
  function follows the CUDA kernel) while the CPU kernel takes fp32 -- the output is shaped by the
  meta function on bf16 views, in the inputs' dtype.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.weak import WeakIdKeyDictionary

from memguard_core.errors import MemGuardError

from .result import STAGES

__all__ = ["StepTracker", "check_mem_tracker"]

_TO_COPY = torch.ops.aten._to_copy.default
_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def check_mem_tracker() -> None:
    """Check that the installed torch's ``MemTracker`` has what :class:`StepTracker` uses.

    Raises:
        MemGuardError: naming the missing attributes and the torch version.
    """
    needed = ("_track", "_update_peak_stats", "_curr_mem_snap", "_mod_tracker", "_pre_fw_hook",
              "_peak_mem", "_peak_mem_snap", "_track_module_params_and_buffers",
              "_param_to_grad_hook_handles", "_update_and_maybe_create_winfos", "_ref_class")
    probe = MemTracker()
    missing = [a for a in needed if not hasattr(probe, a)]
    if missing:
        raise MemGuardError(f"--trace needs torch's MemTracker with {', '.join(missing)} "
                            f"(torch {torch.__version__} lacks them; tested with torch 2.13)")


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


class StepTracker(MemTracker):
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
        self._casting = func is _TO_COPY and bool(args) and isinstance(args[0], torch.Tensor) \
            and any(st in self._params for st in get_untyped_storages(args[0]))
        if _GROUPED_MM is not None and func is _GROUPED_MM and args and args[0].dtype != torch.bfloat16:
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
