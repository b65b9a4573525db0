"""Preflight latency: how long estimating (and planning) takes, from 135M to 70B parameters.

    python bench/preflight_latency.py          # ~1-2 min on 2 cores

Each config (``tests/configs/*.json`` and ``bench/configs/*.json``: real published config numbers,
GPT-2 / SmolLM2-135M / Qwen2.5-0.5B / TinyLlama-1.1B / Phi-3-mini / Mistral-7B / Llama-3-8B /
Gemma-2-9B / Qwen2.5-14B / Qwen1.5-MoE-A2.7B / Mixtral-8x7B / Llama-2-70B) is timed in a FRESH
subprocess, after ``import torch, transformers, memguard_core`` and the model type's own
``configuration_*`` / ``modeling_*`` modules (reported apart: a training process has imported them
to build its model; transformers' lazy imports take seconds on this machine):

* **first**: ``model_spec_from_hf_config(path)`` (the model built on the meta device with
  accelerate's ``init_empty_weights``, no weights; parameters counted by kind) + ``estimate`` +
  ``plan`` against a 24 GiB budget (LoRA r=16 on all linears, bf16, micro-batch 8 x 2048);
* **cached**: the same three calls again in the same process (the spec is cached per config);
* **re-plan**: a different ``TrainSpec`` (full fine-tune, micro-batch 4) on the cached spec.

Target: first <= 100 ms each, flat in model size. Writes bench/results/preflight_latency.md.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def child(path: str) -> dict:
    t0 = time.perf_counter()
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import accelerate  # noqa: F401
    from memguard_core.errors import DoesNotFitError
    from memguard_core.estimator.estimate import estimate
    from memguard_core.plan import plan
    from memguard_core.estimator.specs import TrainSpec
    from memguard_hf.model_spec import model_spec_from_hf_config
    # the model's own transformers modules (configuration + modeling): every training process has
    # imported them already to build the model it trains, so they are timed apart, not in "first"
    import importlib
    mt = json.load(open(path))["model_type"]
    importlib.import_module(f"transformers.models.{mt}.configuration_{mt}")
    importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    transformers.AutoModelForCausalLM  # noqa: B018 (resolves the lazy auto classes)
    t_import = time.perf_counter() - t0
    ts = TrainSpec(batch_size=8, seq_length=2048, method="lora", lora_rank=16, lora_targets=("all-linear",),
                   dtype="bf16", optimizer="adamw")
    ts2 = TrainSpec(batch_size=4, seq_length=2048, method="full", dtype="bf16", optimizer="adamw")
    budget = 24 << 30

    def once(train_spec):
        t = time.perf_counter()
        spec = model_spec_from_hf_config(path)
        est = estimate(spec, train_spec)
        try:
            p = plan(spec, train_spec, budget)
            fits = f"fits after {len(p.changes)} change(s)" if p.changes else "fits"
        except DoesNotFitError:
            fits = "does not fit"
        return time.perf_counter() - t, spec, est, fits

    first, spec, est, fits = once(ts)
    cached, *_ = once(ts)
    replan, *_ = once(ts2)
    return {"params": spec.total_params, "first_ms": first * 1e3, "cached_ms": cached * 1e3,
            "replan_ms": replan * 1e3, "import_s": t_import, "peak_gib": est.peak_bytes / 2**30, "plan": fits}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print("RESULT " + json.dumps(child(argv[1])), flush=True)
        return 0
    paths = sorted(glob.glob(os.path.join(ROOT, "tests", "configs", "*.json"))
                   + glob.glob(os.path.join(ROOT, "bench", "configs", "*.json")))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows = []
    for p in paths:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", p], capture_output=True,
                             text=True, env=env, timeout=300)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        name = os.path.basename(p)[:-5]
        if line is None:
            print(f"{name}: failed\n{out.stderr[-1500:]}", flush=True)
            rows.append((0, [name, "failed", "", "", "", "", ""]))
            continue
        r = json.loads(line[7:])
        print(f"{name}: {r}", flush=True)
        rows.append((r["params"], [name, f"{r['params'] / 1e9:.2f} B", f"{r['first_ms']:.0f}", f"{r['cached_ms']:.1f}",
                                   f"{r['replan_ms']:.1f}", f"{r['peak_gib']:.1f} GiB ({r['plan']})",
                                   f"{r['import_s']:.1f}"]))
    rows.sort(key=lambda x: x[0])
    header = ["config", "parameters", "first call ms (target <= 100)", "cached ms", "re-plan ms",
              "estimate, LoRA r16 bf16 8x2048 (24 GiB plan)", "imports s (apart: torch, transformers, the model's modules)"]
    lines = ["# Preflight latency", "",
             f"`python bench/preflight_latency.py` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, shared "
             "machine). First call = `model_spec_from_hf_config` (meta device, no weights) + `estimate` + `plan` "
             "in a fresh process after the imports; cached = the same again; re-plan = another TrainSpec on the "
             "cached spec.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for _, r in rows]
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "preflight_latency.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    from rich.console import Console
    from rich.table import Table
    t = Table(title="memguard preflight latency")
    for h in header:
        t.add_column(h, justify="right")
    for _, r in rows:
        t.add_row(*r)
    Console().print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
