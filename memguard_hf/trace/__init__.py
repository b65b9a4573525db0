"""``memguard estimate --trace``: one training step of the model's own code on fake tensors, its
live tensor bytes counted by category, beside the analytic estimate. The modules: ``build`` (the
model and the step on fake tensors), ``tracker`` (MemTracker's subclass), ``step``
(:func:`trace_step`), ``result`` (:class:`TraceResult`), ``report`` (the comparison and the CLI's
output).

    from memguard_core.estimator.specs import TrainSpec
    from memguard_hf.trace import trace_step
    tr = trace_step("config.json", TrainSpec(batch_size=4, seq_length=256, method="full", dtype="fp32"))
    tr.peak_bytes, tr.peak_phase, tr.terms["activations"], tr.modules[:5]

How the step runs on fake tensors, what MemTracker counts, and what a live-tensor trace cannot see:
docs/estimator.md, "The trace".
"""

from .report import compare, comparison_table, print_trace, trace_for_cli, trace_json
from .result import STAGES, ModuleRow, TraceResult
from .step import trace_step

__all__ = ["TraceResult", "ModuleRow", "trace_step", "compare", "comparison_table", "STAGES", "trace_for_cli",
           "trace_json", "print_trace"]
