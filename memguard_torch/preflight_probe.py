"""The in-process measurement: before a guarded run's first step, one forward +
backward per size (one row, a few hundred tokens) on the live model and device, read on the
device's own counter -- the step's peak and what it added over the memory held before it -- with
the run's state put back exactly after (:class:`memguard_torch.run_state.RunState`). The optimizer
is never touched. :func:`memguard_core.estimator.probe_fit.fit_probe` turns the reading into a
correction of the estimate. docs/estimator.md, "In-process measurement".
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from memguard_core.estimator.probe_fit import PROBE_COUNTERS, ProbeResult, ProbeStep

from . import probes_cuda, probes_mps
from .run_state import RunState

__all__ = ["measure_steps", "measure_fn", "cut_batch", "default_loss"]

log = logging.getLogger("memguard.preflight")


class _Unmeasurable(Exception):
    """The counter cannot be read here: the result says why; nothing is logged as a failure."""


def measure_steps(model: Any, batch: Any, sizes: Sequence[Tuple[int, int]], *, device: str = "cpu",
                  loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                  step_context: Optional[Callable[[], Any]] = None, max_seconds: Optional[float] = None,
                  torch_cuda: Any = None, torch_mps: Any = None) -> ProbeResult:
    """One forward + backward of ``model`` per size in ``sizes``, each read on ``device``'s counter.

    Args:
        model: the live ``nn.Module`` as the run calls it (not wrapped for data parallelism).
        batch: a real batch of the run: a mapping of tensors (``input_ids``, ``attention_mask``,
            ``labels``, ...; rows on dimension 0, tokens on dimension 1) or a tensor; moved to the
            device of the model's first parameter.
        sizes: ``(rows, tokens)`` pairs; each is cut from ``batch`` (:func:`cut_batch`, at most what
            it holds), run in increasing size, duplicates once.
        device: the counter's device: ``cpu`` (the process's VmHWM after a ``clear_refs`` reset,
            Linux), ``cuda[:N]`` (``max_memory_allocated`` after ``reset_peak_memory_stats``), ``mps``
            (``driver_allocated_memory`` after ``empty_cache``; torch has no MPS peak counter).
        loss_fn: ``loss_fn(model, cut_batch) -> loss`` (a scalar tensor); default
            :func:`default_loss`, as the adapters compute it.
        step_context: returns the context each forward runs in (the run's ``torch.autocast``);
            default none.
        max_seconds: stop after the step that takes the measurement past this many seconds (the
            sizes left are not run; ``reason`` says so).
        torch_cuda / torch_mps: the ``torch.cuda`` / ``torch.mps`` module whose counters are read
            (tests pass a fake: no GPU here); default torch's.

    Returns:
        ProbeResult, ``measured`` False with the reason where it declines (a distributed or
        compiled model, lazy parameters, a parameter hook that could step an optimizer inside the
        backward, a counter that cannot be read) or anything fails, an out-of-memory error
        included. Gradients, buffers, RNG states and ``training`` flags are restored in every case;
        a failure is logged once at WARNING. Never raises (``KeyboardInterrupt`` aside).
    """
    t0 = time.monotonic()
    kind = str(device).split(":")[0]
    steps: List[ProbeStep] = []
    state: Optional[RunState] = None
    reason, failed = "", False
    try:
        why = _declined(model, kind)
        if why:
            raise _Unmeasurable(why)
        counter = _counter(str(device), kind, torch_cuda, torch_mps)
        where = next(iter(model.parameters())).device
        cuts = _cuts(batch, sizes)
        loss_fn = loss_fn or default_loss
        ctx = step_context or contextlib.nullcontext
        state = RunState.save(model)
        model.train()
        with torch.enable_grad():
            if kind == "cuda":
                _make_matmul_handles(where, next(iter(model.parameters())).dtype, ctx)
            for i, (rows, tokens, cut) in enumerate(cuts):
                steps.append(_one_step(model, _to(cut, where), rows, tokens, counter, loss_fn, ctx, state))
                if max_seconds is not None and i + 1 < len(cuts) and time.monotonic() - t0 > max_seconds:
                    reason = f"{len(cuts) - i - 1} size(s) not run: {time.monotonic() - t0:.1f} s > {max_seconds:g} s"
                    break
    except _Unmeasurable as exc:
        reason = str(exc)
    except Exception as exc:   # the user's run goes on whatever the probe met
        failed, steps = True, []
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        log.debug("memguard: in-process measurement failed", exc_info=True)
    finally:
        lost = state.restore() if state is not None else []
    if lost:
        log.warning("memguard: the in-process measurement could not restore %s", "; ".join(lost))
    if failed:
        log.warning("memguard: in-process measurement failed (%s); the estimate stays as the rules give it "
                    "(GuardOptions(preflight_probe=False) skips it)", reason)
    return ProbeResult(measured=bool(steps), device=str(device), counter=PROBE_COUNTERS.get(kind, "") if steps else "",
                       steps=tuple(steps), seconds=time.monotonic() - t0, reason=reason)


def default_loss(model: Any, batch: Any) -> Any:
    """The loss as the adapters take it: ``model(**batch)`` for a mapping, else ``model(batch)``;
    then the output's ``loss`` (attribute or key) where it has one, else the sum of the output
    (of its first tensor for a tuple / list)."""
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is not None:
        return loss
    if isinstance(out, (tuple, list)):
        out = next(o for o in out if torch.is_tensor(o))
    return out.sum()


def cut_batch(batch: Any, rows: int, tokens: int) -> Tuple[Any, int, int]:
    """The first ``rows`` rows and ``tokens`` tokens of ``batch``, and the sizes cut (at most what
    the batch holds).

    A mapping: its rows are dimension 0 of its tensors (their count read from ``input_ids``, else
    the first tensor), its tokens dimension 1 of those of at least two dimensions whose length
    is the sequence's (``input_ids``'), and both last dimensions of a 4-D square mask over it; other
    values are kept. An image batch (``pixel_values``, no ``input_ids``): rows only, and ``tokens``
    comes back as asked (an image's patches cannot be cut). A tensor: rows on dimension 0, tokens on dimension 1 for token ids (an
    integer tensor) or a float one of three or more dimensions (``batch x tokens x features``);
    a 2-D float tensor has no tokens (``tokens`` comes back 1).

    Raises:
        ValueError: a batch of another type, or a mapping without a tensor.
    """
    if torch.is_tensor(batch):
        seq = batch.ndim >= 2 and (not batch.is_floating_point() or batch.ndim >= 3)
        r = min(rows, batch.shape[0])
        t = min(tokens, batch.shape[1]) if seq else 1
        return (batch[:r, :t] if seq else batch[:r]), r, t
    if not isinstance(batch, Mapping):
        raise ValueError(f"batch: cannot cut a batch of type {type(batch).__name__}")
    tensors = [v for v in batch.values() if torch.is_tensor(v) and v.ndim >= 1]
    first = batch.get("input_ids") if torch.is_tensor(batch.get("input_ids")) else (tensors[0] if tensors else None)
    if first is None:
        raise ValueError("batch: a mapping without a tensor")
    if first is not batch.get("input_ids") and torch.is_tensor(batch.get("pixel_values")):
        # an image batch: its tokens are the image's patches, which cannot be cut; rows only, and
        # the tokens are the caller's (probe_policy.probe_sizes gives an image model's patch count)
        first = batch["pixel_values"]
        n = first.shape[0]
        r = min(rows, n)
        out = {k: (v[:r] if torch.is_tensor(v) and v.ndim >= 1 and v.shape[0] == n else v) for k, v in batch.items()}
        return (out if isinstance(batch, dict) else type(batch)(out)), r, int(tokens)
    n, seq = first.shape[0], (first.shape[1] if first.ndim >= 2 else None)
    r, t = min(rows, n), (min(tokens, seq) if seq else 1)
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v) and v.ndim >= 1:
            if v.shape[0] == n:
                v = v[:r]
            if seq and v.ndim == 4 and v.shape[-1] == v.shape[-2] == seq:
                v = v[..., :t, :t]
            elif seq and v.ndim >= 2 and v.shape[1] == seq:
                v = v[:, :t]
        out[k] = v
    return (out if isinstance(batch, dict) else type(batch)(out)), r, t


def _cuts(batch: Any, sizes: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, Any]]:
    """``(rows, tokens, cut)`` per distinct size, in increasing rows x tokens."""
    if not sizes:
        raise _Unmeasurable("no size to measure")
    seen = {}
    for rows, tokens in sizes:
        if isinstance(rows, bool) or isinstance(tokens, bool) or int(rows) < 1 or int(tokens) < 1:
            raise ValueError(f"sizes: expected (rows, tokens) positive integers, got {(rows, tokens)!r}")
        cut, r, t = cut_batch(batch, int(rows), int(tokens))
        seen.setdefault((r, t), cut)
    return [(r, t, c) for (r, t), c in sorted(seen.items(), key=lambda kv: kv[0][0] * kv[0][1])]


def _to(batch: Any, where: torch.device) -> Any:
    if torch.is_tensor(batch):
        return batch.to(where)
    return type(batch)({k: (v.to(where) if torch.is_tensor(v) else v) for k, v in batch.items()})


def _declined(model: Any, kind: str) -> str:
    """Why this model is not measured ("" when it is)."""
    if kind not in PROBE_COUNTERS:
        return f"no counter for device {kind!r}"
    if torch.is_inference_mode_enabled():
        return "inference mode is on (no backward)"
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return "a distributed run (every rank would have to run the same steps)"
    if hasattr(model, "_orig_mod"):   # torch.compile's OptimizedModule
        return "a compiled model (each size would compile a graph)"
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        return "no parameter trains"
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in params):
        return "lazy parameters not yet materialised"
    # a hook run after a gradient is accumulated can step an optimizer inside the backward
    if any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
        return "a parameter has a post-accumulate-grad hook (an optimizer inside the backward)"
    return ""


def _make_matmul_handles(where: torch.device, dtype: torch.dtype, ctx: Callable) -> None:
    """A tiny linear (with a bias) forward and backward on ``where``, in ``dtype`` under the run's
    step context, before the first measured step. torch creates a cuBLAS handle and its workspace
    per thread and stream on the thread's first matmul (``aten/src/ATen/cuda/CublasHandlePool.cpp``),
    and the backward's run on autograd's device thread (``torch/csrc/autograd/engine.cpp``). Made
    here, both are held before the first step; otherwise the backward's workspace (tens of MiB)
    appears inside that step after its peak, and subtracting it as kept memory
    (``ProbeStep.step_bytes``) makes the first step read low."""
    dt = dtype if dtype.is_floating_point else torch.float32
    w = torch.ones(8, 8, device=where, dtype=dt, requires_grad=True)
    b = torch.zeros(8, device=where, dtype=dt, requires_grad=True)
    with ctx():
        y = torch.nn.functional.linear(w, w, b)
    y.float().sum().backward()


class _Counter:
    """A device counter around one step: :meth:`start` (the memory held; starts the peak window),
    :meth:`peak`, :meth:`settle` (the memory held after the step's tensors went)."""

    def __init__(self, start: Callable[[], int], peak: Callable[[], int], settle: Callable[[], int]):
        self.start, self.peak, self.settle = start, peak, settle


def _counter(device: str, kind: str, torch_cuda: Any, torch_mps: Any) -> _Counter:
    if kind == "cuda":
        tc = torch_cuda if torch_cuda is not None else probes_cuda.torch_cuda_module()
        if tc is None:
            raise _Unmeasurable("CUDA is not available")
        index = int(device.split(":")[1]) if ":" in device else 0

        def start() -> int:
            probes_cuda.reset_peak(index, tc)
            return probes_cuda.read_counters(index, tc).allocated

        def top() -> int:
            sync = getattr(tc, "synchronize", None)
            if sync is not None:   # the step's cost in seconds is its kernels' time, not their launches'
                sync(index)
            return probes_cuda.read_counters(index, tc).peak_allocated

        return _Counter(start, top, lambda: probes_cuda.read_counters(index, tc).allocated)
    if kind == "mps":
        m = torch_mps if torch_mps is not None else probes_mps.torch_mps_module()
        if m is None or not hasattr(m, "driver_allocated_memory"):
            raise _Unmeasurable("torch.mps.driver_allocated_memory is not available")

        def settled() -> int:   # the allocator's cache handed back: the driver figure is what is held
            m.empty_cache()
            return int(m.driver_allocated_memory())

        return _Counter(settled, lambda: int(m.driver_allocated_memory()), settled)
    if not sys.platform.startswith("linux"):
        raise _Unmeasurable("the CPU peak can be reset only on Linux (/proc/self/clear_refs)")
    from memguard_core.probes import trim_heap
    from memguard_core.probes.linux import peak
    from memguard_core.probes.linux.proc import STATUS_KEYS, read_status

    def cpu_start() -> int:
        trim_heap()   # free heap pages would be reused unseen by VmHWM
        if not peak.reset_peak():
            raise _Unmeasurable("VmHWM cannot be reset here (/proc/self/clear_refs not writable)")
        return int(read_status(keys=STATUS_KEYS)["VmRSS"])

    def cpu_settle() -> int:
        trim_heap()
        return int(read_status(keys=STATUS_KEYS)["VmRSS"])

    return _Counter(cpu_start, lambda: int(read_status(keys=STATUS_KEYS)["VmHWM"]), cpu_settle)


def _one_step(model: Any, batch: Any, rows: int, tokens: int, counter: _Counter, loss_fn: Callable, ctx: Callable,
              state: RunState) -> ProbeStep:
    """One forward + backward between the counter's reads; its gradients dropped after."""
    t = time.monotonic()
    held = counter.start()
    with ctx():
        loss = loss_fn(model, batch)
    loss.backward()
    del loss
    top = counter.peak()
    state.drop_grads()
    after = counter.settle()
    return ProbeStep(rows=rows, tokens=tokens, held_bytes=held, peak_bytes=top, retained_bytes=after - held,
                     seconds=time.monotonic() - t)


def measure_fn(model: Any, batch: Any, *, loss_fn: Optional[Callable[[Any, Any], Any]] = None,
               step_context: Optional[Callable[[], Any]] = None) -> Callable[..., ProbeResult]:
    """The adapters' ``measure(sizes, max_seconds)`` for the guard's preflight
    (``memguard_core.probe_policy.Measure``): :func:`measure_steps` on ``model``'s own device.
    ``batch`` is a batch, or a zero-argument callable that makes one (called only when the
    measurement runs; None from it: "not measured"). Never raises."""
    def measure(sizes: Sequence[Tuple[int, int]], max_seconds: Optional[float] = None) -> ProbeResult:
        try:
            b = batch() if callable(batch) else batch
            p = next(iter(model.parameters()), None)
            device = str(p.device) if p is not None else "cpu"
        except Exception as exc:   # a dataset that cannot give a row, a model without parameters
            b, device, why = None, "cpu", f"{type(exc).__name__}: {exc}"
        else:
            why = "no batch to cut the probe's rows from"
        if b is None:
            return ProbeResult(measured=False, device=device, counter="", steps=(), seconds=0.0, reason=why)
        return measure_steps(model, b, sizes, device=device, loss_fn=loss_fn, step_context=step_context,
                             max_seconds=max_seconds)
    return measure
