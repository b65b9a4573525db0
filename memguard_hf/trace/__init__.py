"""``memguard estimate --trace``: one training step of the model's own code on fake tensors, its
live tensor bytes counted by category, beside the analytic estimate (docs/estimator.md). The
modules: ``build`` (the model and the step on fake tensors), ``tracker`` (MemTracker's subclass),
``step`` (:func:`trace_step`), ``result`` (:class:`TraceResult`), ``report`` (the comparison and
the CLI's output).

    from memguard_core.estimator.specs import TrainSpec
    from memguard_hf.trace import trace_step
    tr = trace_step("config.json", TrainSpec(batch_size=4, seq_length=256, method="full", dtype="fp32"))
    tr.peak_bytes, tr.peak_phase, tr.terms["activations"], tr.modules[:5]

How (nothing of model size is allocated):

1. the architecture is built from its config on the meta device
   (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``), in the dtype the
   :class:`~memguard_core.estimator.specs.TrainSpec` implies -- ``dtype`` when ``mixed_precision`` is False
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
sums are the live tensor bytes at every op. ``tracker.StepTracker`` adds to it: the stage of the
step (:data:`STAGES`), the module that created each forward tensor (per-module rows), autocast's
cached weight casts (weight copies), a peak per stage and per category; and it works around where
MemTracker (torch 2.13) falls short (see ``memguard_hf.trace.tracker``).

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

from .report import compare, comparison_table, print_trace, trace_for_cli, trace_json
from .result import STAGES, ModuleRow, TraceResult
from .step import trace_step

__all__ = ["TraceResult", "ModuleRow", "trace_step", "compare", "comparison_table", "STAGES", "trace_for_cli",
           "trace_json", "print_trace"]
