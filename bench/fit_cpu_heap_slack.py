"""Fit every CPU heap-slack factor of one glibc range on a small matrix's saved measurements, then
score any other saved set with them (never fitting on it).

    python bench/fit_cpu_heap_slack.py bench/results/bench_cpu_glibc241.json --set newer \\
        --score bench/results/full_depth_cpu_glibc241.json

``--set older``: the module constants ``cpu_heap.CPU_HEAP_SLACK_*`` and ``LORA_TEMP_SLACK`` (glibc
before ``cpu_heap.NEWER_HEAP_GLIBC`` or unknown); ``--set newer``: ``cpu_heap.NEWER_GLIBC_SLACK``.
The cases are the matrix's fitted HF CPU cases (``held_out`` false) less its bf16 mixture-of-experts
cases (``memguard_bench.score.cpu_bf16_moe``), each re-estimated from its saved measurement
(``memguard_bench.score.specs_of``; a record's ``glibc`` picks the set its estimate uses, so the
file should be measured on that range: ``memguard bench --libc DIR``). The procedure of
docs/estimator.md, "CPU heap slack": coordinate descent over a 0.05 grid (0.25 for the two
one-block factors), minimising median |error| + 0.5 x p90 + 5 x (how far the worst
case is under beyond -3 %); ties keep the current value. The slack of ``cpu_heap.heap_slack`` is
linear in each factor, so a candidate's estimate is arithmetic on each case's live set
(:func:`parts`). Every bench case trims the heap, so the last step's gradient holes do not enter.
``--offset-mib X`` takes X MiB off every measured peak first: what a child started through another
loader (``memguard bench --libc``) holds beyond a natively started one (docs/benchmarks.md, "The CPU
heap by C library version": 34-47 MiB, the same glibc 2.36 through the loader). It changes no file:
the fitted values are printed, with every case whose estimate moved. ``--knob NAME`` fits only that
factor (``forward[lora_encoder]``), the others held at the module's values. (A fit of every factor
on today's matrix need not give the committed older set back: the encoder cases were added, and
``forward[lora_encoder]`` fitted, after it.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Dict, List, Tuple

from memguard_core.estimator import cpu_heap
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.gradients import grad_layers
from memguard_bench.score import cpu_bf16_moe, specs_of

#: (factor, method or None, grid step): the knobs of one set, in the order they are walked.
KNOBS = (("forward", "lora", 0.05), ("forward", "lora_encoder", 0.05), ("forward", "full", 0.05),
         ("backward", "lora", 0.05), ("backward", "full", 0.05), ("checkpointed", "lora", 0.05),
         ("checkpointed", "full", 0.05), ("checkpointed_loss_blocks", None, 0.25), ("checkpointed_lora_blocks", None, 0.25),
         ("lora_temp", None, 0.05))
GRIDS = {0.05: [round(0.05 * i, 2) for i in range(0, 41)], 0.25: [0.25 * i for i in range(0, 25)]}


def load(path: str, fitted_only: bool, offset: int = 0) -> List[Tuple[str, object, object, int]]:
    """(name, ModelSpec, TrainSpec, measured peak bytes less ``offset``) of the saved HF CPU cases
    of ``path``."""
    with open(path) as f:
        saved = json.load(f)
    out = []
    for c in saved["cases"]:
        case, rec = c["case"], c.get("measured") or {}
        if case.get("backend") != "hf" or "error" in rec or "peak_bytes" not in rec:
            continue
        if case.get("device", "cpu") != "cpu" or (fitted_only and case.get("held_out")):
            continue
        ms, ts = specs_of(case, rec)
        if fitted_only and cpu_bf16_moe(ms, ts):
            continue
        out.append((c["name"], ms, ts, int(rec["peak_bytes"]) - int(offset)))
    return out


def current(which: str) -> Dict[Tuple[str, object], float]:
    """knob -> the value in ``cpu_heap`` now, of set ``which`` (older | newer)."""
    if which == "newer":
        f = cpu_heap.NEWER_GLIBC_SLACK
    else:
        f = {"forward": cpu_heap.CPU_HEAP_SLACK_FORWARD, "backward": cpu_heap.CPU_HEAP_SLACK_BACKWARD,
             "checkpointed": cpu_heap.CPU_HEAP_SLACK_CHECKPOINTED,
             "checkpointed_loss_blocks": cpu_heap.CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS,
             "checkpointed_lora_blocks": cpu_heap.CPU_HEAP_SLACK_CHECKPOINTED_LORA_BLOCKS,
             "lora_temp": cpu_heap.LORA_TEMP_SLACK}
    return {(n, k): (f[n][k] if k else f[n]) for n, k, _ in KNOBS}


def parts(case) -> dict:
    """What ``cpu_heap.heap_slack`` multiplies for one case, and its live bytes per moment (the
    estimate's phases less their ``allocator_slack``)."""
    n, ms, ts, peak = case
    est = estimate(ms, ts)
    live = {m: est.phases[m] - est.phase_breakdowns[m].get("allocator_slack", 0) for m in est.phases}
    traffic = cpu_heap.activation_traffic(ms, ts)
    sl = est.phase_breakdowns["loss"].get("logits", 0) if cpu_heap.logits_heap_served(ms, ts) else 0
    return dict(kind="full" if ts.method == "full" else "lora", split=cpu_heap.forward_split(ms, ts, traffic, sl),
                live=live, traffic=traffic, sl=sl,
                lora=cpu_heap.lora_forward_traffic(ms, ts), one=traffic / max(1, grad_layers(ms, ts)),
                gc=ts.grad_checkpoint, trim=ts.heap_trim, peak=peak)


def modelled(p: dict, c: Dict[Tuple[str, object], float]) -> float:
    """A case's estimate from its :func:`parts` with factors ``c``."""
    kind, live = p["kind"], p["live"]
    if p["gc"]:
        every = c[("checkpointed", kind)] * (p["traffic"] + p["sl"])
        if kind == "lora":
            every += c[("checkpointed_lora_blocks", None)] * p["one"]
        loss = every
        if kind == "full" and p["trim"]:
            loss = c[("checkpointed_loss_blocks", None)] * p["one"] + c[("checkpointed", kind)] * p["sl"]
        return max(live.get("loss", 0) + loss, *(live[m] + every for m in live if m != "loss"))
    loss = sum(c[("forward", k)] * b for k, b in p["split"].items()) + c[("lora_temp", None)] * p["lora"]
    later = c[("backward", kind)] * p["traffic"]
    return max(live.get("loss", 0) + loss, *(live[m] + later for m in live if m != "loss"))


def errors(ps: Dict[str, dict], c) -> Dict[str, float]:
    return {n: (modelled(p, c) - p["peak"]) / p["peak"] for n, p in ps.items()}


def objective(errs: Dict[str, float]) -> float:
    a = sorted(abs(e) for e in errs.values())
    p90 = a[min(len(a) - 1, int(round(0.9 * (len(a) - 1))))]
    return statistics.median(a) + 0.5 * p90 + 5 * max(0.0, -min(errs.values()) - 0.03)


def knob_name(n: str, k) -> str:
    """``forward[lora]``, ``checkpointed_loss_blocks``: how a knob is printed and named on the command line."""
    return f"{n}[{k}]" if k else n


def fit(ps: Dict[str, dict], start: Dict[Tuple[str, object], float], only=None) -> Dict[Tuple[str, object], float]:
    """Coordinate descent from ``start`` until a sweep changes nothing (at most 10 sweeps); ``only``:
    the knob names (:func:`knob_name`) to move, the others held at ``start`` (None: all)."""
    cur = dict(start)
    for _ in range(10):
        moved = False
        for n, k, st in KNOBS:
            if only and knob_name(n, k) not in only:
                continue
            best = (objective(errors(ps, cur)), cur[(n, k)])
            for v in GRIDS[st]:
                o = objective(errors(ps, {**cur, (n, k): v}))
                if o < best[0] - 1e-12:
                    best = (o, v)
            if best[1] != cur[(n, k)]:
                cur[(n, k)], moved = best[1], True
        if not moved:
            break
    return cur


def summary(errs: Dict[str, float]) -> str:
    a = sorted(abs(e) for e in errs.values())
    p90 = a[min(len(a) - 1, int(round(0.9 * (len(a) - 1))))]
    return (f"{len(a)} cases, median |error| {100 * statistics.median(a):.1f} %, p90 {100 * p90:.1f} %, "
            f"{100 * min(errs.values()):+.1f} .. {100 * max(errs.values()):+.1f} %")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("matrix", help="the small matrix's saved --json (fitted on)")
    ap.add_argument("--set", dest="which", choices=("older", "newer"), default="newer",
                    help="which glibc range's factors to fit [newer]")
    ap.add_argument("--score", action="append", default=[], help="another saved --json, scored only")
    ap.add_argument("--knob", action="append", default=[], choices=[knob_name(n, k) for n, k, _ in KNOBS],
                    help="fit only this factor, the others held at the module's values (repeatable) [all]")
    ap.add_argument("--offset-mib", type=float, default=0.0,
                    help="MiB taken off every measured peak (a child started through another loader) [0]")
    a = ap.parse_args(argv)
    off = int(a.offset_mib * 2 ** 20)
    start = current(a.which)
    sets = [("matrix (fitted on)", load(a.matrix, True, off))] + \
        [(p + " (not fitted on)", load(p, False, off)) for p in a.score]
    parted = [{c[0]: parts(c) for c in cases} for _, cases in sets]
    after = fit(parted[0], start, set(a.knob) or None)
    print("factors: " + ", ".join(f"{knob_name(n, k)} {start[(n, k)]} -> {after[(n, k)]}"
                                  for n, k, _ in KNOBS))
    for (label, cases), ps in zip(sets, parted):
        b, f = errors(ps, start), errors(ps, after)
        print(f"\n## {label}\nbefore: {summary(b)}\nafter:  {summary(f)}\n")
        print("| case | before | after |\n|---|---|---|")
        for n, _, _, _ in cases:
            if label != sets[0][0] or abs(b[n] - f[n]) > 5e-4:
                print(f"| {n} | {100 * b[n]:+.1f} % | {100 * f[n]:+.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
