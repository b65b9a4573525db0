"""Refit the checkpointed CPU heap-slack constants on the small matrix's saved measurements, then
score any other saved set with them (never fitting on it).

    python bench/fit_checkpointed_slack.py bench/results/bench_cpu.json \\
        --score bench/results/full_depth_cpu.json

The procedure of docs/estimator.md, "CPU heap slack": the matrix's fitted HF cases (``held_out``
false) less its bf16 mixture-of-experts cases (``memguard_bench.score.cpu_bf16_moe``), each
re-estimated from its saved measurement (``memguard_bench.score.specs_of``) with candidate values of
``cpu_heap.CPU_HEAP_SLACK_CHECKPOINTED`` (full / LoRA, 0.05 grid),
``CPU_HEAP_SLACK_CHECKPOINTED_FIRST_BLOCKS`` (full / LoRA, 0.25 grid) and
``CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS`` (0.25 grid), each method's knobs searched jointly over
the grid (the intercept and the slope trade against each other, which coordinate descent cannot
follow), minimising median |error| + 0.5 x p90 + 5 x (how far the worst case is under beyond -3 %);
ties keep the current value. Prints the fitted values, then every checkpointed case of each set
(and any other case whose estimate moved) with the code's constants and with the fitted ones. The
candidate intercept ``CANDIDATES`` (one block's traffic x a factor, added to the checkpointed slack
at every moment) is searched too; the slack is linear in all these constants, so a candidate's
estimate is arithmetic on each case's live set (``parts``, ``modelled``). It changes no file.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Tuple

from memguard_core.estimator import cpu_heap
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.gradients import grad_layers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path, not from bench/
from fit_cpu_heap_slack import load, objective, summary  # noqa: E402  (the shared loading and scoring)

MiB = 1 << 20
KNOBS = (("CPU_HEAP_SLACK_CHECKPOINTED", "lora", 0.05), ("CPU_HEAP_SLACK_CHECKPOINTED", "full", 0.05),
         ("CPU_HEAP_SLACK_CHECKPOINTED_FIRST_BLOCKS", "lora", 0.25),
         ("CPU_HEAP_SLACK_CHECKPOINTED_FIRST_BLOCKS", "full", 0.25),
         ("CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS", None, 0.25))


#: The candidate intercept (in one block's traffic, by method) tried beside the code's constants; not in
#: ``cpu_heap``: docs/estimator.md, "The checkpointed heap at depth", says why it was left out.
CANDIDATES = {"CPU_HEAP_SLACK_CHECKPOINTED_FIRST_BLOCKS": {"full": 0.0, "lora": 0.0}}


def get(name, key):
    v = getattr(cpu_heap, name, None)
    if v is None:
        v = CANDIDATES[name]
    return v[key] if key else v


def errors(cases) -> Dict[str, float]:
    """case -> (estimate - measured) / measured with the constants now in ``cpu_heap``."""
    return {n: (estimate(ms, ts).peak_bytes - peak) / peak for n, ms, ts, peak in cases}


def parts(case):
    """(kind, live bytes per moment without the slack, one block's traffic, all blocks' traffic +
    small logits, small logits, measured): what the checkpointed slack of ``cpu_heap.heap_slack``
    multiplies, so that a candidate's estimate is arithmetic (the slack is linear in the constants;
    every bench case trims the heap, so the last step's gradient holes do not enter)."""
    n, ms, ts, peak = case
    est = estimate(ms, ts)
    live = {m: est.phases[m] - est.phase_breakdowns[m].get("allocator_slack", 0) for m in est.phases}
    traffic = cpu_heap.activation_traffic(ms, ts)
    one = traffic / max(1, grad_layers(ms, ts))
    sl = est.phase_breakdowns["loss"].get("logits", 0) if cpu_heap.logits_heap_served(ms, ts) else 0
    return ("full" if ts.method == "full" else "lora", live, one, traffic + sl, sl, peak, ts.heap_trim)


def modelled(p, c) -> float:
    """Estimate of a checkpointed case from its ``parts`` with constants ``c`` (knob -> value)."""
    kind, live, one, tr, sl, peak, trim = p
    every = c[("CPU_HEAP_SLACK_CHECKPOINTED_FIRST_BLOCKS", kind)] * one + c[("CPU_HEAP_SLACK_CHECKPOINTED", kind)] * tr
    loss = every
    if kind == "full" and trim:
        loss = c[("CPU_HEAP_SLACK_CHECKPOINTED_LOSS_BLOCKS", None)] * one + c[("CPU_HEAP_SLACK_CHECKPOINTED", kind)] * sl
    return max(live.get("loss", 0) + loss, *(live[m] + every for m in live if m != "loss"))


def fit(cases) -> Dict[Tuple[str, str], float]:
    """Grid search by method (the LoRA knobs, then the full fine-tune's, twice over), each grid
    exhaustive over its knobs; ties keep the value nearest the code's."""
    fixed = errors([c for c in cases if not c[2].grad_checkpoint])
    gc = {c[0]: parts(c) for c in cases if c[2].grad_checkpoint}
    cur = {(n, k): get(n, k) for n, k, _ in KNOBS}
    start = dict(cur)

    def obj(c):
        return objective({**fixed, **{n: (modelled(p, c) - p[5]) / p[5] for n, p in gc.items()}})

    grids = {0.05: [round(0.05 * i, 2) for i in range(0, 25)], 0.25: [0.25 * i for i in range(0, 25)]}
    for _ in range(2):
        for kind in ("lora", "full"):
            knobs = [(n, k, st) for n, k, st in KNOBS if k == kind or (k is None and kind == "full")]
            best = (obj(cur), 0.0, dict(cur))
            def walk(i, c):
                nonlocal best
                if i == len(knobs):
                    o = obj(c)
                    dist = sum(abs(c[key] - start[key]) for key in c)
                    if (o, dist) < best[:2]:
                        best = (o, dist, dict(c))
                    return
                n, k, st = knobs[i]
                for v in grids[st]:
                    walk(i + 1, {**c, (n, k): v})
            best = (best[0], sum(abs(cur[key] - start[key]) for key in cur), best[2])
            walk(0, dict(cur))
            cur = best[2]
    return cur


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("matrix", help="the small matrix's saved --json (fitted on)")
    ap.add_argument("--score", action="append", default=[], help="another saved --json, scored only")
    a = ap.parse_args(argv)
    sets = [("matrix (fitted on)", load(a.matrix, True))] + [(p + " (not fitted on)", load(p, False)) for p in a.score]
    before_consts = {(n, k): get(n, k) for n, k, _ in KNOBS}
    before = [errors(c) for _, c in sets]
    after_consts = fit(sets[0][1])
    after = []
    for (_, cases), b in zip(sets, before):
        moved = {c[0]: (modelled(parts(c), after_consts) - c[3]) / c[3] for c in cases if c[2].grad_checkpoint}
        after.append({**b, **moved})
    print("constants: " + ", ".join(f"{n}{'[' + k + ']' if k else ''} {before_consts[(n, k)]} -> {v}"
                                    for (n, k), v in after_consts.items()))
    for (label, cases), b, f in zip(sets, before, after):
        print(f"\n## {label}\nbefore: {summary(b)}\nafter:  {summary(f)}\n")
        print("| case | blocks | before | after |\n|---|---|---|---|")
        for n, ms, ts, _ in cases:
            if ts.grad_checkpoint or abs(b[n] - f[n]) > 5e-4:
                print(f"| {n} | {ms.num_layers} | {100 * b[n]:+.1f} % | {100 * f[n]:+.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
