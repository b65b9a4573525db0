"""Heap replay: does the order and the sizes of a step's tensor allocations alone explain glibc's heap
slack on a CPU run? (issue #33: the CPU heap-slack factors are under on encoders, over on decoders.)

    python bench/heap_replay.py CASE [--steps 2]

CASE is a case name of ``bench/results/full_depth_cpu.json``. One training step of the case's model
runs on fake tensors (``memguard_hf.trace``, the bench child's head and LoRA settings) while every
new tensor storage and the moment it dies is recorded, in order. A fresh process then replays that
sequence through this machine's own allocator, as torch's CPU allocator calls it
(``posix_memalign(64, n)``, every byte written, ``free``): the parameters first, then the step
``--steps`` times, glibc's free heap handed back (``malloc_trim(0)``) between steps as a guarded run
does, VmHWM reset before each step. Printed per step: the replay's peak resident set above its
start, the largest live tensor bytes of the sequence, and the difference (the heap's slack), beside
the case's measured peak and its estimate's ``allocator_slack``.

Nothing but tensor storages is replayed: the interpreter's own heap, oneDNN's scratch inside one
kernel and the allocations of other threads are not in the sequence. Linux / glibc only; a
research script, not the estimator. Findings: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def record(case_name: str):
    """One fake-tensor step of the case: ``(sizes of the parameters, buffers and optimizer states,
    events, TraceResult, ModelSpec, TrainSpec, the measured record, the case)``; events are
    ``("a", key, nbytes, stage)`` / ``("f", key)`` in the order they happened.

    Raises:
        StopIteration: no case of that name in ``bench/results/full_depth_cpu.json``.
    """
    import weakref

    import torch

    from memguard_bench.score import specs_of
    from memguard_core.estimator.heads import AUTO_CLASSES, head_of
    from memguard_hf.trace import build as B
    from memguard_hf.trace import step as S
    from memguard_hf.trace import tracker as T
    from memguard_hf.trace.tracker import get_untyped_storages

    d = json.load(open(os.path.join(HERE, "results", "full_depth_cpu.json")))
    c = next(c for c in d["cases"] if c["name"] == case_name)
    case, rec = c["case"], c["measured"]
    ms, ts = specs_of(case, rec)
    head = head_of(ms)
    auto = AUTO_CLASSES[head.kind]
    cfg = rec["model_config"]

    events, params = [], []
    seen = weakref.WeakKeyDictionary()
    keys = iter(range(10 ** 9))
    orig_track = T.StepTracker._track

    def _track(self, reftype, t):
        orig_track(self, reftype, t)
        for st in get_untyped_storages(t):
            if st in self._params or st in seen:
                continue
            k = next(keys)
            seen[st] = k
            events.append(("a", k, int(st.nbytes()), self.stage))
            weakref.finalize(st, events.append, ("f", k))

    orig_build, orig_prepare = B.build_model, B.prepare_step

    task = {"sequence_classification": "SEQ_CLS", "token_classification": "TOKEN_CLS",
            "seq2seq_lm": "SEQ_2_SEQ_LM"}.get(head.kind, "CAUSAL_LM")
    orig_add_lora = B.add_lora

    def add_lora(model, cfg_, ts_):
        from peft import LoraConfig, get_peft_model

        tm = "all-linear" if any(t.lower() in ("all-linear", "all_linear") for t in ts_.lora_targets) \
            else list(ts_.lora_targets)
        return get_peft_model(model, LoraConfig(r=ts_.lora_rank, target_modules=tm, task_type=task,
                                                lora_dropout=ts_.lora_dropout))

    def build(cfg_, ts_, wdtype, auto_class="AutoModelForCausalLM"):
        B.add_lora = add_lora
        try:
            return orig_build(cfg_, ts_, wdtype, auto)
        finally:
            B.add_lora = orig_add_lora

    def prepare(model, inner, ts_, vocab, notes):
        opt, ids, batch = orig_prepare(model, inner, ts_, vocab, notes)
        if head.kind in ("sequence_classification",):
            batch = {"input_ids": ids, "labels": torch.zeros(ts_.batch_size, dtype=torch.long)}
        elif head.kind in ("token_classification",):
            batch = {"input_ids": ids, "labels": torch.zeros_like(ids)}
        for p in list(model.parameters()) + list(model.buffers()):
            params.append(int(p.untyped_storage().nbytes()))
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    params.append(int(v.untyped_storage().nbytes()))
        return opt, ids, batch

    T.StepTracker._track = _track
    S.build_model, S.prepare_step = build, prepare
    try:
        tr = S.trace_step(cfg, ts)
    finally:
        T.StepTracker._track = orig_track
        S.build_model, S.prepare_step = orig_build, orig_prepare
    return params, events, tr, ms, ts, rec, case


REPLAY = r"""
import ctypes, json, sys
libc = ctypes.CDLL("libc.so.6")
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.malloc_trim.argtypes = [ctypes.c_size_t]
def status(k):
    for ln in open("/proc/self/status"):
        if ln.startswith(k + ":"):
            return int(ln.split()[1]) * 1024
def reset():
    open("/proc/self/clear_refs", "w").write("5")
params, events, steps = json.load(open(sys.argv[1]))
def alloc(n):
    p = ctypes.c_void_p()
    assert libc.posix_memalign(ctypes.byref(p), 64, max(n, 1)) == 0
    ctypes.memset(p, 1, max(n, 1))
    return p.value
held = [alloc(n) for n in params]
out = []
for s in range(steps):
    libc.malloc_trim(0)
    start = status("VmRSS"); reset()
    live, ptr, size, top = 0, {}, {}, 0
    for e in events:
        if e[0] == "a":
            ptr[e[1]] = alloc(e[2]); size[e[1]] = e[2]; live += e[2]; top = max(top, live)
        elif e[1] in ptr:
            libc.free(ptr.pop(e[1])); live -= size.pop(e[1])
    for k in list(ptr):     # what outlives the step (the fake trace's leftovers): freed before the next
        libc.free(ptr.pop(k)); live -= size.pop(k)
    out.append({"start": start, "hwm": status("VmHWM"), "live_peak": top})
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default="/tmp/heap_replay.json")
    a = ap.parse_args(argv)
    params, events, tr, ms, ts, rec, case = record(a.case)
    with open(a.out, "w") as f:
        json.dump([params, [list(e[:3]) for e in events], a.steps], f)
    r = subprocess.run([sys.executable, "-c", REPLAY, a.out], capture_output=True, text=True, env=dict(os.environ))
    if r.returncode:
        print(r.stderr[-3000:])
        return 1
    steps = json.loads(r.stdout)
    from memguard_core.estimator.estimate import estimate

    est = estimate(ms, ts)
    slack = est.breakdown.get("allocator_slack", 0)
    print(f"{a.case}: {sum(1 for e in events if e[0] == 'a')} allocations, {sum(params) / MiB:.0f} MiB params+states")
    print(f"  measured peak {rec['peak_bytes'] / MiB:.0f} MiB; estimate {est.peak_bytes / MiB:.0f} MiB "
          f"(allocator_slack {slack / MiB:.0f} MiB); estimate without slack {(est.peak_bytes - slack) / MiB:.0f} MiB "
          f"-> measured slack {(rec['peak_bytes'] - est.peak_bytes + slack) / MiB:.0f} MiB")
    for i, s in enumerate(steps, 1):
        rise = s["hwm"] - s["start"]
        print(f"  replay step {i}: peak above start {rise / MiB:.0f} MiB, live peak {s['live_peak'] / MiB:.0f} MiB, "
              f"heap slack {(rise - s['live_peak']) / MiB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
