"""Where the CUDA caching allocator's reserved-over-allocated gap comes from in HF ``Trainer`` LoRA
runs, with and without activation checkpointing (docs/estimator.md, "CUDA"; the checkpointed
reserved share of issue #33).

Each case is one fresh child process: an HF ``Trainer`` run of a public config (random weights, built
on the GPU), 3 optimizer steps. It reports, per optimizer step, ``max_memory_allocated`` and
``max_memory_reserved`` (reset at each step's start) and, where ``history`` is on, a census from
``torch.cuda.memory._record_memory_history`` replayed after the run: every ``segment_alloc`` (a new
``cudaMalloc``) with the request that caused it, the bytes allocated and reserved at that moment, the
largest free block of the large pool then (a new segment while the cached free bytes exceed the
request is fragmentation), the step it fell in and the Python frames of the request; and the largest
requests of the last step with their frames. The estimate (as ``memguard estimate --device cuda``
computes it) is scored per counter beside it.

On the GPU machine, after ``bench/gpu_check.sh``'s install (or with PYTHONPATH set the same way)::

    python3 bench/cuda_reserved.py --out $OUT [--cases a,b] [--budget-s 240]

``--dry-run``: the same flow on the CPU with a tiny model (no CUDA counters, no history), to test
the script. Writes ``cuda_reserved.json`` and ``cuda_reserved.md`` into ``--out`` after every case.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, ROOT) if p not in sys.path]

import gpu_check as gc_mod  # noqa: E402  (the GPU check's helpers: configs, datasets, NVML, scoring)

GiB = float(1 << 30)
MiB = 1 << 20
#: The large pool's requests and segments: above kSmallSize (1 MiB) / kSmallBuffer (2 MiB),
#: ``c10/cuda/CUDACachingAllocator.cpp``.
SMALL_SIZE = 1 * MiB
SMALL_BUFFER = 2 * MiB

_BASE = dict(kind="estimate", lora_rank=16, optimizer="adamw", steps=3, method="lora", dtype="bf16",
             mixed_precision=False, history=True, alloc_conf="")
QWEN, LLAMA = "bench/configs/qwen2.5-1.5b.json", "bench/configs/llama-3.2-1b.json"
CASES: List[dict] = [dict(_BASE, **c) for c in (
    dict(name="qwen-ckpt-4x2048", config=QWEN, batch_size=4, seq_length=2048, grad_checkpoint=True),
    dict(name="qwen-ckpt-4x2048-expandable", config=QWEN, batch_size=4, seq_length=2048, grad_checkpoint=True,
         history=False, alloc_conf="expandable_segments:True"),
    dict(name="qwen-ckpt-1x2048", config=QWEN, batch_size=1, seq_length=2048, grad_checkpoint=True),
    dict(name="qwen-ckpt-2x2048", config=QWEN, batch_size=2, seq_length=2048, grad_checkpoint=True, history=False),
    dict(name="llama-ckpt-2x2048", config=LLAMA, batch_size=2, seq_length=2048, grad_checkpoint=True),
    dict(name="qwen-lora-1x3072", config=QWEN, batch_size=1, seq_length=3072, grad_checkpoint=False),
    dict(name="llama-lora-2x2048", config=LLAMA, batch_size=2, seq_length=2048, grad_checkpoint=False,
         history=False),
    dict(name="llama-lora-2x2048-expandable", config=LLAMA, batch_size=2, seq_length=2048, grad_checkpoint=False,
         history=False, alloc_conf="expandable_segments:True"),
    dict(name="qwen-ckpt-1x2048-expandable", config=QWEN, batch_size=1, seq_length=2048, grad_checkpoint=True,
         history=False, alloc_conf="expandable_segments:True"),
)]
CASE_NAMES = [c["name"] for c in CASES]


# ---------------------------------------------------------------------------------------------
# the census: a replay of the allocator's recorded history


def _round_block(n: int) -> int:
    """The caching allocator's ``round_size``: at least 512 B, a multiple of 512 B."""
    return 512 if n < 512 else 512 * ((n + 511) // 512)


def short_frames(frames: List[dict], keep: int = 6) -> List[str]:
    """``file:line name`` of the innermost ``keep`` frames, without ``nn.Module``'s call wrappers."""
    out = []
    for f in frames or []:
        fn = str(f.get("filename", ""))
        if fn.endswith(("torch/nn/modules/module.py", "torch/_tensor.py")) or "_call_impl" in str(f.get("name")):
            continue
        out.append(f"{'/'.join(fn.split('/')[-2:])}:{f.get('line')} {f.get('name')}")
        if len(out) >= keep:
            break
    return out


def _largest_free_large(segs: Dict[int, int], blocks: Dict[int, int], addrs: List[int]) -> Dict[str, int]:
    """Free bytes of the large pool's segments (over ``SMALL_BUFFER``) and their largest free run,
    given the live blocks (``addrs`` sorted)."""
    total = largest = 0
    for s, size in segs.items():
        if size <= SMALL_BUFFER:
            continue
        end = s + size
        i = bisect.bisect_left(addrs, s)
        cur = s
        while i < len(addrs) and addrs[i] < end:
            a = addrs[i]
            gap = a - cur
            if gap > 0:
                total += gap
                largest = max(largest, gap)
            cur = max(cur, a + blocks[a])
            i += 1
        if end > cur:
            total += end - cur
            largest = max(largest, end - cur)
    return {"free_large": total, "largest_free_large": largest}


def census(snapshot: dict, mark_name: str = "_step_mark", big: int = 256 * MiB, big_step: int = 3) -> Dict[str, Any]:
    """Replay ``snapshot["device_traces"][0]`` (``torch.cuda.memory._snapshot()``).

    Returns ``segment_allocs`` (one dict per new segment: ``step`` (0 before the first step mark, k
    during step k), ``segment`` and ``request`` bytes, ``allocated`` / ``reserved`` bytes just before,
    ``free_large`` / ``largest_free_large`` bytes, ``fragmented`` (the large pool's free bytes would
    have held the request), ``frames``), ``big_requests`` (requests of at least ``big`` bytes in
    step ``big_step``, grouped by frames: count, bytes), ``peaks`` (per step: the allocated and reserved
    peaks of the replay) and ``entries`` (how many were replayed). Step marks are allocations whose
    innermost frame is a function named ``mark_name`` (begin and end of each step, in order). Block
    extents are the rounded request (the unsplit remainder of a block, under 1 MiB, is ignored)."""
    trace = (snapshot.get("device_traces") or [[]])[0]
    segs: Dict[int, int] = {}
    blocks: Dict[int, int] = {}
    addrs: List[int] = []
    allocated = reserved = 0
    marks = 0
    step = 0
    seg_allocs: List[dict] = []
    peaks: Dict[int, Dict[str, int]] = {}
    bigs: Dict[tuple, Dict[str, Any]] = {}
    pending: Optional[dict] = None
    for e in trace:
        a = e.get("action")
        if a == "segment_alloc":
            free = _largest_free_large(segs, blocks, addrs)
            pending = dict(step=step, segment=int(e["size"]), allocated=allocated, reserved=reserved, **free)
            segs[int(e["addr"])] = int(e["size"])
            reserved += int(e["size"])
        elif a == "segment_free":
            reserved -= segs.pop(int(e["addr"]), int(e["size"]))
        elif a == "alloc":
            frames = e.get("frames") or []
            if any(f.get("name") == mark_name for f in frames[:2]):
                marks += 1
                step = (marks + 1) // 2 if marks % 2 else -((marks + 1) // 2)  # -k: after step k's end
            n = _round_block(int(e["size"]))
            addr = int(e["addr"])
            blocks[addr] = n
            bisect.insort(addrs, addr)
            allocated += n
            if pending is not None:
                req = n
                pending.update(request=req, frames=short_frames(frames),
                               fragmented=bool(req > SMALL_SIZE and pending["free_large"] >= req))
                seg_allocs.append(pending)
                pending = None
            p = peaks.setdefault(step, {"allocated": 0, "reserved": 0, "reserved_at_allocated_peak": 0})
            if allocated > p["allocated"]:
                p["allocated"], p["reserved_at_allocated_peak"] = allocated, reserved
            p["reserved"] = max(p["reserved"], reserved)
            if n >= big and step == big_step:
                key = tuple(short_frames(frames, 4))
                g = bigs.setdefault(key, {"frames": list(key), "count": 0, "bytes": n})
                g["count"] += 1
        elif a == "free_completed":
            addr = int(e["addr"])
            n = blocks.pop(addr, None)
            if n is not None:
                allocated -= n
                i = bisect.bisect_left(addrs, addr)
                if i < len(addrs) and addrs[i] == addr:
                    addrs.pop(i)
    return {"entries": len(trace), "segment_allocs": seg_allocs,
            "big_requests": sorted(bigs.values(), key=lambda g: -g["bytes"]),
            "peaks": {str(k): v for k, v in sorted(peaks.items())}}


# ---------------------------------------------------------------------------------------------
# the child


def child(case: dict, dry: bool) -> dict:
    """One case in this process (fresh: ``PYTORCH_CUDA_ALLOC_CONF`` is read at torch's first CUDA
    allocation); its record."""
    t0 = time.time()
    baseline_used = None if dry else gc_mod.nvml_device_used()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback, TrainingArguments

    device = "cpu" if dry else "cuda"
    # expandable segments map and unmap pages (segment_map / segment_unmap) that the census does not replay
    history = bool(case.get("history")) and not dry and "expandable_segments" not in case.get("alloc_conf", "")
    if device == "cuda":
        torch.zeros(1, device="cuda")
        if history:
            torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=4_000_000)
    cfg = gc_mod._config_dict(case, dry, for_build=True)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=case["lora_rank"], lora_alpha=2 * case["lora_rank"], lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    from memguard_torch.module_spec import model_spec_from_module

    ms = model_spec_from_module(model, name=case["name"])
    b, s = (gc_mod.DRY_TRAIN["batch_size"], gc_mod.DRY_TRAIN["seq_length"]) if dry else (case["batch_size"], case["seq_length"])
    ds, _ = gc_mod._token_dataset(config.vocab_size, b * case["steps"], s, seed=1)
    steps: List[Dict[str, Any]] = []

    def _step_mark():
        if device == "cuda":
            torch.empty(8, dtype=torch.uint8, device="cuda")  # a recorded allocation whose frame names the mark

    class PerStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            _step_mark()

        def on_step_end(self, args, state, control, **kw):
            _step_mark()
            if device == "cuda":
                torch.cuda.synchronize()
                st = torch.cuda.memory_stats()
                steps.append({"max_allocated": int(torch.cuda.max_memory_allocated()),
                              "max_reserved": int(torch.cuda.max_memory_reserved()),
                              "allocated_end": int(torch.cuda.memory_allocated()),
                              "reserved_end": int(torch.cuda.memory_reserved()),
                              "segments": int(st.get("segment.all.current", 0)),
                              "inactive_split_bytes": int(st.get("inactive_split_bytes.all.current", 0)),
                              "num_alloc_retries": int(st.get("num_alloc_retries", 0))})

    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="cuda_reserved_"), per_device_train_batch_size=b,
        gradient_accumulation_steps=1, max_steps=case["steps"], learning_rate=1e-4,
        optim="adamw_torch" if dry else "adamw_torch_fused", bf16=False, use_cpu=dry,
        gradient_checkpointing=case["grad_checkpoint"], report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, dataloader_pin_memory=False)
    trainer = gc_mod._sequential_trainer_cls()(model=model, args=args, train_dataset=ds, callbacks=[PerStep()])
    nv = None
    if device == "cuda":
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        nv = gc_mod.NvmlPeak(baseline_used).start()
    t1 = time.time()
    trainer.train()
    rec: Dict[str, Any] = dict(steps=int(trainer.state.global_step), train_seconds=round(time.time() - t1, 2),
                               per_step=steps, model_spec=__import__("dataclasses").asdict(ms),
                               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if device == "cuda":
        torch.cuda.synchronize()
        rec["measured"] = {"max_memory_allocated": max(x["max_allocated"] for x in steps),
                           "max_memory_reserved": max(x["max_reserved"] for x in steps),
                           "nvidia-smi": nv.stop()}
        if history:
            t2 = time.time()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(None)
            rec["census"] = census(snap, big_step=case["steps"])
            rec["census_seconds"] = round(time.time() - t2, 2)
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def _run_child(case: dict, dry: bool, timeout: float) -> dict:
    env = dict(os.environ)
    if case.get("alloc_conf"):
        env["PYTORCH_CUDA_ALLOC_CONF"] = case["alloc_conf"]
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = f.name
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(case), "--child-out", out]
                           + (["--dry-run"] if dry else []), env=env, capture_output=True, text=True, timeout=timeout)
        try:
            with open(out) as f:
                return json.load(f)
        except Exception:
            return {"child_error": f"child exited {p.returncode}", "stderr": p.stderr[-3000:]}
    except subprocess.TimeoutExpired:
        return {"child_error": f"timed out after {timeout:.0f} s"}
    finally:
        os.unlink(out)


# ---------------------------------------------------------------------------------------------
# the parent


def score(case: dict, rec: dict, dry: bool) -> List[dict]:
    """The estimate per CUDA counter against the run (``gpu_check``'s scoring; empty on a dry run)."""
    if dry or not rec.get("measured"):
        return []
    rows, _ = gc_mod.Runner.estimate_rows(SimpleNamespace(dry=False), case, rec)
    return rows


def markdown(doc: dict) -> str:
    """The report of a ``cuda_reserved.json`` document."""
    m = doc["meta"]
    lines = ["# CUDA reserved-over-allocated census", "",
             f"{m.get('gpu', {}).get('gpu')} | torch {m.get('versions', {}).get('torch')} | "
             f"transformers {m.get('versions', {}).get('transformers')} | peft {m.get('versions', {}).get('peft')} | "
             f"commit {m.get('commit')} | {m.get('date')} | {m.get('elapsed_s')} s", "",
             "| case | alloc conf | step | max allocated GiB | max reserved GiB | gap GiB | gap / allocated |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["cases"]:
        for i, st in enumerate(r.get("per_step") or []):
            gap = st["max_reserved"] - st["max_allocated"]
            lines.append(f"| {r['name']} | {r.get('alloc_conf') or 'default'} | {i + 1} | {st['max_allocated'] / GiB:.2f} | "
                         f"{st['max_reserved'] / GiB:.2f} | {gap / GiB:.2f} | {gap / st['max_allocated']:.1%} |")
        if r.get("child_error"):
            lines.append(f"| {r['name']} | error: {r['child_error'][:200]} | | | | | |")
    lines += ["", "## Estimates", "", "| case | counter | estimate GiB | measured GiB | error |", "|---|---|---|---|---|"]
    for r in doc["cases"]:
        for s in r.get("scores") or []:
            if s.get("measured"):
                lines.append(f"| {r['name']} | {s['counter']} | {s['estimate'] / GiB:.2f} | {s['measured'] / GiB:.2f} | "
                             f"{s['error']:+.1%} |")
    for r in doc["cases"]:
        c = r.get("census")
        if not c:
            continue
        lines += ["", f"## {r['name']}: new segments ({c['entries']} trace entries)", "",
                  "| step | segment MiB | request MiB | allocated GiB | reserved GiB | large-pool free GiB | largest free MiB | fragmented | frames |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s in c["segment_allocs"]:
            if s["segment"] < 64 * MiB and not s.get("fragmented"):
                continue
            lines.append(f"| {s['step']} | {s['segment'] / MiB:.0f} | {s.get('request', 0) / MiB:.1f} | "
                         f"{s['allocated'] / GiB:.2f} | {s['reserved'] / GiB:.2f} | {s['free_large'] / GiB:.2f} | "
                         f"{s['largest_free_large'] / MiB:.0f} | {s.get('fragmented')} | "
                         f"{'<br>'.join((s.get('frames') or [])[:3])} |")
        small = [s for s in c["segment_allocs"] if s["segment"] < 64 * MiB and not s.get("fragmented")]
        lines.append(f"\n{len(small)} more segments under 64 MiB (not fragmented), {sum(s['segment'] for s in small) / GiB:.2f} GiB.")
        lines += ["", "Requests of 256 MiB or more in the last step:", "", "| count | MiB | frames |", "|---|---|---|"]
        for g in c["big_requests"]:
            lines.append(f"| {g['count']} | {g['bytes'] / MiB:.0f} | {'<br>'.join(g['frames'])} |")
        lines += ["", "Replay peaks per step (negative: between a step's end and the next's start):", "",
                  "| step | allocated GiB | reserved GiB | reserved at the allocated peak GiB |", "|---|---|---|---|"]
        for k, p in c["peaks"].items():
            lines.append(f"| {k} | {p['allocated'] / GiB:.2f} | {p['reserved'] / GiB:.2f} | {p['reserved_at_allocated_peak'] / GiB:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    """The command line (see the module doc); the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all): " + ", ".join(CASE_NAMES))
    ap.add_argument("--budget-s", type=float, default=300.0, help="no new case starts after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (tests the flow)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        try:
            rec = child(json.loads(a.child), a.dry_run)
        except Exception as exc:
            rec = {"child_error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        with open(a.child_out, "w") as f:
            json.dump(rec, f, default=str)
        return 0
    sel = [c for c in CASES if not a.cases or c["name"] in a.cases.split(",")]
    unknown = set(filter(None, a.cases.split(","))) - set(CASE_NAMES)
    if unknown:
        ap.error(f"--cases: unknown {sorted(unknown)}; expected some of {CASE_NAMES}")
    t0 = time.time()
    meta = {"gpu": gc_mod.gpu_info(), "versions": gc_mod._versions(), "commit": gc_mod._git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": a.dry_run}
    doc: Dict[str, Any] = {"meta": meta, "cases": []}
    os.makedirs(a.out, exist_ok=True)
    for case in sel:
        if time.time() - t0 > a.budget_s:
            doc["cases"].append({"name": case["name"], "child_error": "skipped: time budget"})
            continue
        print(f"[cuda_reserved {time.time() - t0:6.1f}s] {case['name']} ...", flush=True)
        rec = _run_child(case, a.dry_run, timeout=240)
        rec.update(name=case["name"], case={k: v for k, v in case.items() if k != "kind"})
        try:
            rec["scores"] = score(case, rec, a.dry_run)
        except Exception as exc:
            rec["score_error"] = repr(exc)[:500]
        rec.pop("model_spec", None)
        doc["cases"].append(rec)
        ps = rec.get("per_step") or []
        print(f"[cuda_reserved {time.time() - t0:6.1f}s] {case['name']}: "
              + ("; ".join(f"step {i + 1} alloc {x['max_allocated'] / GiB:.2f} reserved {x['max_reserved'] / GiB:.2f} GiB"
                           for i, x in enumerate(ps)) or rec.get("child_error", "done")), flush=True)
        meta["elapsed_s"] = round(time.time() - t0, 1)
        for name, text in (("cuda_reserved.json", json.dumps(doc, indent=1, default=str)),
                           ("cuda_reserved.md", markdown(doc))):
            with open(os.path.join(a.out, name), "w") as f:
                f.write(text)
    return 0 if all(not r.get("child_error") for r in doc["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
