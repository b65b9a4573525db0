"""Reaction time: from a real pressure crossing to the first forward with a smaller micro-batch.

    python bench/reaction.py              # ~3-5 min on 2 cores; needs writable memory cgroups (root)

A guarded HF ``Trainer`` run (memguard_testing/scripts/grow_train.py: Llama architecture, 16 x 128-token
micro-batches, peak ~1.1-1.2 GiB unsplit) runs inside a real memory cgroup of 2000 MiB (no swap,
memguard_testing/cgroup_harness.py). A co-tenant process started in the SAME cgroup takes memory
(every page touched) and holds it; the moment it has touched its last page is the crossing (the
guard's effective budget, min(budget, (process + available) x 0.8), drops under the step's peak).
Each model forward is time-stamped by a forward pre-hook (``forwards.log``). Measured:

* **time**: crossing -> start of the first forward with fewer than 16 rows;
* **forwards at the old size**: forwards that *started* after the crossing with all 16 rows
  (target 0: the next forward is already split);
* which sample decided (``step``: the per-micro-batch check; ``background``: the 0.5 s thread).

Scenarios: *between steps* (the trainer waits after step 2 while the co-tenant takes 800 MiB) and
*mid-step* (the co-tenant takes 700 or 650 MiB while step 3 is running; the in-flight forward
cannot change). With 800 MiB the step's peak lands at the emergency level (>= 95 % of the
effective budget): split at once. With 650-700 MiB it lands in the critical band (90-95 %): the
monitor's ladder cleans caches first, reads the live bytes around the clean and, when what it
freed of them does not bring the peak under the critical line, splits in the same sample.
(600 MiB, used in earlier runs, puts the peak on the critical line itself, 89.5-90.5 %, where
noise decides between "warning: no action" and "critical".) The table shows the usage of the
step sample that decided. Skipped, with the reason, where memory cgroups are not writable.
Writes bench/results/reaction.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from _common import child_env, markdown_table, print_table, write_result
from memguard_testing import script

TRAIN = script("grow_train.py")
MiB = 1 << 20
LIMIT = 2000 * MiB
HOLD = """
import sys, time
n = int(sys.argv[1]) << 20
b = bytearray(n)
for i in range(0, n, 4096):
    b[i] = 1
print(f"held {time.time():.4f}", flush=True)
while True:
    time.sleep(60)
"""


def _wait(path, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"trainer ended early rc={proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timeout waiting for {path}")
        time.sleep(0.01)


def scenario(name: str, take_mib: int, mid_step: bool) -> dict:
    from memguard_testing.cgroup_harness import MemoryCgroup
    out = tempfile.mkdtemp(prefix=f"reaction-{name}-")
    steps, at = 6, 2
    env = child_env()
    with MemoryCgroup(LIMIT, name=f"reaction-{name}") as cg:
        oom0 = cg.oom_kill_count()
        if mid_step:
            open(os.path.join(out, f"go-{at}"), "w").close()   # no pause: the marker only tells the time
        log = open(os.path.join(out, "trainer.log"), "w")
        tr = cg.popen([sys.executable, TRAIN, "--output-dir", out, "--steps", str(steps), "--seq-len", "128",
                       "--pause-at", str(at), "--no-grow"], env=env, stdout=log, stderr=subprocess.STDOUT)
        with open(f"/proc/{tr.pid}/oom_score_adj", "w") as f:
            f.write("500")
        co = None
        try:
            _wait(os.path.join(out, f"step-{at}.done"), tr)
            if mid_step:
                time.sleep(0.4)   # step 3's forward is under way
            co = cg.popen([sys.executable, "-c", HOLD, str(take_mib)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
            t_cross = float(co.stdout.readline().split()[1])
            if not mid_step:
                open(os.path.join(out, f"go-{at}"), "w").close()
            rc = tr.wait(timeout=500)
        finally:
            log.close()
            for p in (tr, co):
                if p is not None and p.poll() is None:
                    p.kill()
        oom = cg.oom_kill_count() - oom0
    if rc != 0:
        return {"name": name, "error": f"trainer rc={rc} oom_kills={oom}"}
    fw = []
    with open(os.path.join(out, "forwards.log")) as f:
        for line in f:
            t, s, n = line.split()
            fw.append((float(t), int(s), int(n)))
    after = [x for x in fw if x[0] >= t_cross]
    first_small = next((x for x in after if x[2] < 16), None)
    old = [x for x in after if x[2] == 16 and (first_small is None or x[0] < first_small[0])]
    r = json.load(open(os.path.join(out, "result.json")))
    splits = [e for e in r["guard"]["events"] if e["action"] == "split"]
    seen = [e for e in r["guard"]["events"] if e.get("step") is not None and e["step"] > at]
    top = max(seen, key=lambda e: e["usage"], default=None)
    decided = splits[0] if splits else None   # the first split: the decision measured
    return {"name": name, "take_mib": take_mib, "oom": oom,
            "decided_usage": None if decided is None else decided["usage"],
            "decided_level": None if decided is None else decided["level"],
            "top_usage": None if top is None else top["usage"], "top_level": None if top is None else top["level"],
            "reaction_s": None if first_small is None else first_small[0] - t_cross,
            "old_forwards": len(old), "source": "-" if decided is None else decided["source"],
            "k": r["guard"]["micro_batches"], "steps": r["global_step"], "max_steps": steps,
            "step_s": r["wall_s"] / steps}


def main() -> int:
    from memguard_testing.cgroup_harness import cgroups_writable
    ok, why = cgroups_writable()
    lines = ["# Reaction time", ""]
    rows = []
    if not ok:
        lines.append(f"Skipped: {why}")
    else:
        for name, take, mid in (("between steps", 800, False), ("mid-step", 700, True),
                                ("mid-step", 650, True), ("between steps", 800, False), ("mid-step", 700, True),
                                ("mid-step", 650, True)):
            res = scenario(name.replace(" ", "-"), take, mid)
            print(res, flush=True)
            if "error" in res:
                rows.append([name, str(take), res["error"], "", "", "", "", ""])
                continue
            if res["reaction_s"] is None:
                # no split: the step peaks stayed under the split levels with the co-tenant there
                top = ("no event" if res["top_usage"] is None else
                       f"highest step sample {res['top_usage']:.0%} ({res['top_level']})")
                reaction, old = f"no split needed: {top}", "-"
            else:
                reaction, old = f"{res['reaction_s']:.2f}", str(res["old_forwards"])
            dec = ("-" if res["decided_usage"] is None else
                   f"{res['decided_usage']:.0%} ({res['decided_level']})")
            rows.append([name, str(take), reaction, old, res["source"], dec, f"1 -> {res['k']}",
                         f"{res['steps']}/{res['max_steps']}, {res['step_s']:.1f} s/step"])
        header = ["scenario", "co-tenant MiB", "crossing -> first smaller forward (s)",
                  "forwards at the old size after the crossing (target 0)", "decided by",
                  "usage at the split", "k",
                  "steps done, mean step"]
        lines += [f"`python bench/reaction.py` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, shared machine, "
                  f"cgroup limit {LIMIT // MiB} MiB, no swap). HF Trainer, 16 x 128-token micro-batches; the co-tenant "
                  "runs in the same cgroup; times from a forward pre-hook.", "", *markdown_table(header, rows)]
    write_result("reaction.md", lines)
    if rows:
        print_table("memguard reaction to a co-tenant", header, rows)
    else:
        print(lines[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
