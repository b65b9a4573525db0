"""The trace against the analytic estimate, and what ``memguard estimate --trace`` prints and writes
(``memguard_hf.trace``; docs/estimator.md).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from memguard_core.errors import ConfigError
from memguard_core.estimator.specs import TrainSpec

from .result import MOMENT_STAGES, TraceResult
from .step import trace_step

__all__ = ["compare", "comparison_table", "module_table", "trace_for_cli", "trace_json", "print_trace"]


def compare(trace: TraceResult, est) -> List[Dict[str, Any]]:
    """Traced vs analytic, term by term.

    Args:
        trace: a :class:`TraceResult`.
        est: a ``memguard_core.estimator.result.MemoryEstimate`` of the same model and settings.

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

    for moment, stages in MOMENT_STAGES.items():
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


def module_groups(trace: TraceResult) -> Dict[str, List[int]]:
    """The traced modules' activation bytes grouped over the blocks (``layers.*.self_attn``: the rows
    whose names differ only by a block index)."""
    import re

    groups: Dict[str, List[int]] = {}
    for r in trace.modules:
        groups.setdefault(re.sub(r"\.\d+(?=\.|$)", ".*", r.name), []).append(r.activation_bytes)
    return groups


def common_prefix(names: List[str]) -> str:
    """The dotted prefix every name shares (``base_model.model.model.layers.*.``), ending at a dot;
    empty for fewer than two names or none shared."""
    if len(names) < 2:
        return ""
    parts = [n.split(".") for n in names]
    shared = []
    for column in zip(*parts):
        if len(set(column)) != 1:
            break
        shared.append(column[0])
    shared = shared[:min(len(p) for p in parts) - 1]   # every name keeps a tail
    return ".".join(shared) + "." if shared else ""


def module_table(trace: TraceResult, modules: int = 8):
    """A rich ``Table`` of the ``modules`` largest activation rows by creating module, their common
    prefix moved to the caption so the names' distinguishing tails show at any width."""
    from rich.table import Table

    groups = module_groups(trace)
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:modules]
    prefix = common_prefix([k for k, _ in top])
    t = Table(title=f"traced activations at the end of the forward, by creating module "
                    f"(top {len(trace.modules)} modules)",
              caption=f"module names below start with {prefix}" if prefix else None)
    t.add_column("module", overflow="fold")
    t.add_column("blocks", justify="right")
    t.add_column("MiB", justify="right")
    t.add_column("share", justify="right")
    total = max(trace.terms.get("activations", 0), 1)
    for key, vals in top:
        t.add_row(key[len(prefix):], str(len(vals)), f"{sum(vals) / 2**20:,.2f}", f"{sum(vals) / total:.0%}")
    return t


def print_trace(trace: TraceResult, est, modules: int = 8) -> None:
    """Print :func:`comparison_table` and :func:`module_table`."""
    from memguard_core.report import console

    console().print(comparison_table(trace, est))
    if not trace.modules or modules <= 0:
        return
    console().print(module_table(trace, modules))
