"""Depth curve of a checkpointed CPU run's heap: the same model cut to several block counts, each run
by ``heap_probe.py`` in a fresh process, tabulated by depth.

    python bench/ckpt_depth_curve.py --arch smollm2-135m-30l --layers 2,4,8,16,30 --out /tmp/dc \\
        -- --method lora --lora-rank 32 --lora-targets all-linear --batch-size 1 --seq-length 2048 \\
           --dtype fp32 --grad-checkpoint --steps 3

Arguments after ``--`` go to ``heap_probe.py`` (HF ``Trainer``, glibc's heap trimmed at every step's
end as the guard does, VmHWM reset through ``/proc/self/clear_refs`` at every step's start,
``mallinfo2`` sampled at the hooks). A depth whose ``<out>/L<layers>.json`` exists is read, not re-run.
Per depth, MiB: the arena after the first step's trim (what the first step's checkpointed forward
and backward grew it to, below the highest chunk still in use), the last step's arena free at its
start and at the loss (the model's output), the last step's VmHWM, memguard's estimate with its
``allocator_slack`` (the modelled slack), and the slack the run needed: VmHWM - (estimate -
allocator_slack), the estimate's live set at its peak moment. Linux / glibc only (as heap_probe).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def marks(samples, step):
    """name -> the first hook sample of ``step`` at step_begin / post:model / step_end (lists of
    heap_probe's SAMPLE_FIELDS)."""
    out = {}
    for s in samples:
        if s[0] == step and s[1] in ("step_begin", "post:model", "step_end") and s[1] not in out:
            out[s[1]] = s
    return out


def row(d):
    """One depth's table row from heap_probe's JSON ``d``."""
    steps = [r["step"] for r in d["steps"]]
    first, last = min(steps), max(steps)
    m1, ml = marks(d["samples"], first), marks(d["samples"], last)
    arena, free = d["sample_fields"].index("heap_arena"), d["sample_fields"].index("heap_free")
    hwm = max(r["vm_hwm"] for r in d["steps"] if r["step"] == last)
    est = d["estimate"]
    slack = est["breakdown"].get("allocator_slack", 0)
    need = hwm - (est["peak_bytes"] - slack)
    return [d["layers"], m1["step_end"][arena] / MiB, ml["step_begin"][free] / MiB, ml["post:model"][free] / MiB,
            hwm / MiB, est["peak_bytes"] / MiB, slack / MiB, need / MiB]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True)
    ap.add_argument("--layers", required=True, help="comma list of block counts")
    ap.add_argument("--out", required=True, help="folder for each depth's heap_probe JSON and log")
    a = ap.parse_args(own)
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for layers in (int(x) for x in a.layers.split(",")):
        path = os.path.join(a.out, f"L{layers}.json")
        if not os.path.exists(path):
            with open(os.path.join(a.out, f"L{layers}.log"), "w") as log:
                rc = subprocess.call([sys.executable, os.path.join(HERE, "heap_probe.py"), "--arch", a.arch,
                                      "--layers", str(layers), *rest, "--json", path], stdout=log, stderr=log)
            if rc != 0:
                print(f"{layers} blocks: heap_probe.py exited {rc} (see {a.out}/L{layers}.log)", file=sys.stderr)
                continue
        with open(path) as f:
            rows.append(row(json.load(f)))
    print("| blocks | arena after step 1 | last step: free at start | free at the loss | VmHWM | estimate "
          "| modelled slack | slack needed |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | " + " | ".join(f"{x:,.0f}" for x in r[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
