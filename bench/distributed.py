"""Per-rank peak memory of real multi-process training on CPU (gloo), against memguard's estimate.

Each case launches ``world`` fresh Python processes (one thread each: ``OMP_NUM_THREADS=1``,
``torch.set_num_threads(1)``) that train a Llama-shaped model built from config numbers with random
weights (fp32, full fine-tune, ``torch.optim.AdamW(fused=True)`` -- the in-place kernel HF's
default ``adamw_torch_fused`` also runs --, a plain PyTorch loop, ``STEPS`` steps of
``BATCH x SEQ`` tokens per rank, ``zero_grad(set_to_none=True)``) under one layout:

* ``ddp``           ``DistributedDataParallel`` (defaults: ``bucket_cap_mb=25``);
* ``fsdp-full``     FSDP2 ``fully_shard`` per decoder block + the root, ``reshard_after_forward=True``;
* ``fsdp-grad-op``  the same with ``reshard_after_forward=False``;
* ``fsdp-no-shard`` FSDP2 on a 2-D mesh (replicate = world, shard = 1): HSDP with one-rank shards;
* ``fsdp-offload``  ``fsdp-full`` with ``CPUOffloadPolicy(pin_memory=False)`` (pinning needs CUDA);
* ``fsdp1-full|fsdp1-grad-op`` (``--modes``) FSDP1 ``FullyShardedDataParallel`` (``FULL_SHARD`` /
  ``SHARD_GRAD_OP``) wrapping every decoder block and the root (``transformer_auto_wrap_policy``),
  ``use_orig_params=True``, the model built whole on every rank first (its setup peak stays below
  the step's);
* ``zero1|zero2|zero3`` (``--modes``, when deepspeed is importable) DeepSpeed ZeRO with its CPU
  accelerator (``DS_ACCELERATOR=cpu``), the model built whole, the same AdamW passed as the client
  optimizer (``zero_allow_untested_optimizer``), DeepSpeed's default buckets.

FSDP models are built on the meta device, sharded, then materialised (``to_empty``) and
initialised, as FSDP2's docs recommend; DDP builds the model whole on every rank. Every rank reports
its ``VmHWM`` (/proc/self/status) at the end; the table scores memguard's per-rank estimate
(``device="cpu"``, ``framework="torch"``) against each rank. The ``tiny`` rows calibrate the fixed
cost of a rank and the 30M rows the FSDP heap factor (docs/distributed.md); the 135M rows are scored
held out by scale.
Each rank also records, after every forward / backward / optimizer step, glibc's ``mallinfo2()``
(arena, in use, mmapped) and, at the end of each backward, ``malloc_info()``'s heap per arena (the
main sbrk arena and the per-thread arenas of gloo's worker threads): what tells the live heap from
its holes (docs/distributed.md, "Per-rank spread"). ``MEMGUARD_BENCH_STEPS`` runs more steps for
the table's 135M DDP / FSDP2 rows (6: their ranks' peaks still rise through steps 4-6) and for
probes; the other rows run ``STEPS``. Every rank returns glibc's free heap at each step's end, as
memguard's guard does on a CPU device (``GuardOptions.trim_heap``); ``MEMGUARD_BENCH_TRIM=0`` measures
the plain loop (its rows are scored with ``heap_trim=False``). ``MEMGUARD_BENCH_SEQ`` sets the tokens
per row (issue 35's 135M case: 256); each row records its ``seq`` and is scored at it.

The ``tiny`` size is calibration (the fixed cost of a rank), left out of the scores.

Run: ``python bench/distributed.py [--quick] [--sizes 30m,135m] [--worlds 2,4] [--modes ...]``;
writes ``bench/results/distributed_cpu.{json,md}`` (``--no-write`` to only print, ``--merge`` to
add rows to the saved file, ``--rescore`` to re-estimate the saved rows without running).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

#: Llama shapes (``LlamaConfig`` fields). ``135m`` is SmolLM2-135M's config.json
#: (tests/configs/smollm2-135m.json); ``30m`` the same family cut to hidden 384 / 8 blocks
#: (31.5M parameters, tied embedding); ``tiny`` a negligible model for the fixed cost of a rank.
SIZES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "30m": dict(vocab_size=49152, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
    "135m": "tests/configs/smollm2-135m.json",
}
MODES = ("ddp", "fsdp-full", "fsdp-grad-op", "fsdp-no-shard", "fsdp-offload")
BATCH, SEQ, STEPS = 2, 128, 3
#: ``MEMGUARD_BENCH_SEQ``: tokens per row for a run (the default ``SEQ``); each row records its own
#: ``seq`` and is scored at it (issue 35's case: 135M full shard at 2 x 256 tokens).
RUN_SEQ = int(os.environ.get("MEMGUARD_BENCH_SEQ", SEQ))
#: The issue's target band for a per-rank estimate: -5 % / +15 % of the measured peak.
LOW, HIGH = -5.0, 15.0


def config_dict(size: str) -> dict:
    s = SIZES[size]
    if isinstance(s, str):
        with open(os.path.join(ROOT, s)) as f:
            d = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    else:
        d = dict(s, model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=2048, attention_dropout=0.0)
    d["torch_dtype"] = "float32"
    return d


# ---------------------------------------------------------------------------------------------
# the worker (one rank)


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_count(field: str) -> int:
    """A count field of /proc/self/status (``Threads``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _heap() -> tuple:
    """glibc's ``mallinfo2()`` (all arenas summed), bytes: (arena = heap the arenas hold,
    uordblks = in use in them, hblkhd = in use in mmapped chunks); zeros without glibc >= 2.33."""
    from memguard_core.probes.linux.heap import Mallinfo2, libc

    fn = getattr(libc(), "mallinfo2", None)
    if fn is None:
        return (0, 0, 0)
    fn.restype, fn.argtypes = Mallinfo2, []
    m = fn()
    return (int(m.arena), int(m.uordblks), int(m.hblkhd))


def _arenas() -> list:
    """Per-arena heap of glibc's ``malloc_info`` (``<heap nr=...>``: the bytes the arena holds from
    the system, ``system current``, and the free bytes in it), in arena order (0 = main, the sbrk
    heap; the others are the per-thread arenas of threads that malloc'ed, glibc ``arena_get2``);
    empty without glibc. The FILE it writes through costs a few KiB of heap."""
    import ctypes
    import re

    from memguard_core.probes.linux.heap import libc

    c = libc()
    if c is None or not hasattr(c, "malloc_info"):
        return []
    path = os.path.join(tempfile.gettempdir(), f"mg-malloc-info-{os.getpid()}.xml")
    c.fopen.restype, c.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    c.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    c.fclose.argtypes = [ctypes.c_void_p]
    fp = c.fopen(path.encode(), b"w")
    if not fp:
        return []
    c.malloc_info(0, fp)
    c.fclose(fp)
    try:
        with open(path) as f:
            xml = f.read()
    finally:
        os.unlink(path)
    out = []
    for nr, body in re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S):
        cur = re.search(r'<system type="current" size="(\d+)"', body)
        rest = re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', body)
        out.append((int(nr), int(cur.group(1)) if cur else 0, sum(int(x) for x in rest)))
    return out


def worker(mode: str, size: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(**config_dict(size))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    engine = None
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(LlamaForCausalLM(cfg))
    elif mode.startswith("zero"):
        import deepspeed

        model = LlamaForCausalLM(cfg)
        conf = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": int(mode[-1])}, "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), config=conf)
    elif mode.startswith("fsdp1"):
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        # built whole, then wrapped: FSDP1's per-module param_init_fn (to_empty(recurse=False)) would
        # materialise a tied embedding and LM head as two tensors and shard both
        model = LlamaForCausalLM(cfg)
        strategy = ShardingStrategy.SHARD_GRAD_OP if mode == "fsdp1-grad-op" else ShardingStrategy.FULL_SHARD
        model = FSDP(model, sharding_strategy=strategy, device_id=torch.device("cpu"), use_orig_params=True,
                     auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                        transformer_layer_cls={LlamaDecoderLayer}))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if mode == "fsdp-no-shard":
            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        kw = dict(mesh=mesh, reshard_after_forward=mode != "fsdp-grad-op")
        if mode == "fsdp-offload":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
            # to_empty left the rotary buffers uninitialised: take them from a module built on cpu
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            ref = dict(LlamaRotaryEmbedding(cfg).named_buffers())
            for name, b in model.model.rotary_emb.named_buffers():
                b.copy_(ref[name])
    model.train()
    opt = None if engine else torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, cfg.vocab_size, (BATCH, RUN_SEQ), generator=g)
    setup_hwm = _vm("VmHWM")
    rss_file_start = _vm("RssFile")  # the mapped libraries' pages, where a guard's preflight reads them
    t0 = time.time()
    stages = []  # VmHWM, VmRSS and glibc's heap after each part of each step: which moment raised the peak
    arenas_bw = []  # malloc_info's per-arena heap at the end of each backward
    # the table's 135M DDP / FSDP2 rows run 6: their ranks' peaks still rise through steps 4-6
    steps = int(os.environ.get("MEMGUARD_BENCH_STEPS", STEPS))
    trim = os.environ.get("MEMGUARD_BENCH_TRIM", "1") != "0"
    from memguard_core.probes import trim_heap
    for step in range(steps):
        loss = (engine or model)(input_ids=x, labels=x).loss
        stages.append((step, "forward", _vm("VmHWM"), _vm("VmRSS")) + _heap())
        engine.backward(loss) if engine else loss.backward()
        stages.append((step, "backward", _vm("VmHWM"), _vm("VmRSS")) + _heap())
        arenas_bw.append(_arenas())
        engine.step() if engine else opt.step()
        stages.append((step, "step", _vm("VmHWM"), _vm("VmRSS")) + _heap())
        if not engine:
            opt.zero_grad(set_to_none=True)
        if trim:  # what memguard's guard does at every optimizer step's end on a CPU device
            trim_heap()
    res = dict(rank=rank, world=world, mode=mode, size=size, vm_hwm=_vm("VmHWM"), setup_hwm=setup_hwm,
               rss_file=_vm("RssFile"), rss_file_start=rss_file_start, stages=stages, arenas=_arenas(), arenas_bw=arenas_bw, threads=_vm_count("Threads"),
               malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}, steps=steps, seq=RUN_SEQ, trim=trim, loss=float(loss), step_s=(time.time() - t0) / steps)
    with open(out, "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# the driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(mode: str, size: str, world: int, timeout: float = 900) -> list:
    """Launch ``world`` ranks of one case; returns their result dicts (rank order)."""
    tmp = tempfile.mkdtemp(prefix="mg-dist-")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TOKENIZERS_PARALLELISM="false")
    procs = []
    for r in range(world):
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        if mode.startswith("zero"):
            e.setdefault("DS_ACCELERATOR", "cpu")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", mode, size,
                                       os.path.join(tmp, f"{r}.json")], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + timeout
    logs = []
    for p in procs:
        try:
            o, _ = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{mode} {size} x{world}: timed out")
        logs.append(o)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode} {size} x{world} failed:\n" + "\n".join(x[-3000:] for x in logs))
    out = []
    for r in range(world):
        with open(os.path.join(tmp, f"{r}.json")) as f:
            out.append(json.load(f))
    return out


def estimate_case(mode: str, size: str, world: int, resident_file_bytes=None, seq: int = SEQ, trim: bool = True):
    """memguard's per-rank estimate of one case (a MemoryEstimate); ``resident_file_bytes``: the
    rank's file-backed resident pages before its first step (``RssFile``, as the guard reads them;
    a freshly written venv maps its libraries in large folios and reads higher), None = typical;
    ``seq``: tokens per row (the row's own, ``MEMGUARD_BENCH_SEQ``); ``trim``: whether the ranks
    returned glibc's free heap at every step's end (``MEMGUARD_BENCH_TRIM``, ``TrainSpec.heap_trim``)."""
    from memguard_core.estimator.estimate import estimate
    from memguard_core.estimator.specs import TrainSpec
    from memguard_hf.model_spec import model_spec_from_hf_config

    ms = model_spec_from_hf_config(config_dict(size), name=size)
    sharding = "fsdp-full" if mode == "fsdp-offload" else mode.replace("fsdp1-", "fsdp-")
    ts = TrainSpec(batch_size=BATCH, seq_length=seq, method="full", dtype="fp32", optimizer="adamw",
                   attn_impl="sdpa", framework="torch", device="cpu", world_size=world, sharding=sharding,
                   fsdp_version=1 if mode.startswith("fsdp1") else 2,
                   offload="params" if mode == "fsdp-offload" else "none",
                   resident_file_bytes=resident_file_bytes, heap_trim=bool(trim))
    return estimate(ms, ts)


def table(rows: list) -> str:
    MiB = 1 << 20
    lines = ["| size | mode | world | rank | steps | measured VmHWM (MiB) | estimate (MiB) | error | phase |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['mode']} | {r['world']} | {r['rank']} | {r.get('steps', STEPS)} | "
                     f"{r['vm_hwm'] / MiB:.0f} | {r['estimate'] / MiB:.0f} | {r['error_pct']:+.1f} % | {r['phase']} |")
    return "\n".join(lines)


def summary(rows: list) -> dict:
    """Error statistics over the scored rows (the ``tiny`` calibration rows left out): all of them,
    and per family (``torch``: DDP / FSDP1 / FSDP2; ``deepspeed``: ZeRO)."""
    out = _stats([r for r in rows if r["size"] != "tiny"])
    for fam, pred in (("torch", lambda m: not m.startswith("zero")), ("deepspeed", lambda m: m.startswith("zero"))):
        sub = [r for r in rows if r["size"] != "tiny" and pred(r["mode"])]
        if sub:
            out[fam] = _stats(sub)
    return out


def _stats(rows: list) -> dict:
    errs = [r["error_pct"] for r in rows]
    inside = [e for e in errs if LOW <= e <= HIGH]
    return dict(rows=len(rows), within=len(inside), min_error_pct=min(errs, default=0),
                max_error_pct=max(errs, default=0),
                mean_abs_error_pct=sum(abs(e) for e in errs) / max(1, len(errs)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", nargs=3, metavar=("MODE", "SIZE", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="30m only, 2 ranks, ddp and fsdp-full")
    ap.add_argument("--sizes", default="30m,135m")
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--merge", action="store_true",
                    help="add these rows to bench/results/distributed_cpu.json (same size/world/mode replaced)")
    ap.add_argument("--rescore", action="store_true",
                    help="re-score the measured rows of bench/results/distributed_cpu.json (no runs)")
    a = ap.parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return 0
    sizes, worlds, modes = a.sizes.split(","), [int(w) for w in a.worlds.split(",")], a.modes.split(",")
    if a.quick:
        sizes, worlds, modes = ["30m"], [2], ["ddp", "fsdp-full"]
    old = {}
    if a.rescore or a.merge:
        with open(os.path.join(RESULTS, "distributed_cpu.json")) as f:
            saved = json.load(f)
        for r in saved["rows"]:
            old.setdefault((r["size"], r["world"], r["mode"]), []).append(r)
    if a.rescore:
        sizes = list(dict.fromkeys(k[0] for k in old))
        worlds = sorted(set(k[1] for k in old))
        modes = list(dict.fromkeys(k[2] for k in old))
    rows = []
    for size in sizes:
        for world in worlds:
            for mode in modes:
                t = time.time()
                if a.rescore:
                    ranks = old.get((size, world, mode))
                    if not ranks:
                        continue
                else:
                    ranks = run_case(mode, size, world)
                for r in ranks:
                    # rows measured before rss_file_start was recorded: the typical figure, as calibrated
                    est = estimate_case(mode, size, world, r.get("rss_file_start"), r.get("seq", SEQ), r.get("trim", True))
                    r["estimate"] = int(est.peak_bytes)
                    r["phase"] = est.phase
                    r["breakdown"] = {k: int(v) for k, v in est.breakdown.items()}
                    r["error_pct"] = 100.0 * (est.peak_bytes - r["vm_hwm"]) / r["vm_hwm"]
                    rows.append(r)
                    print(f"{size:5s} {mode:14s} x{world} rank {r['rank']}: measured {r['vm_hwm'] / 2**20:7.0f} MiB"
                          f"  setup {r['setup_hwm'] / 2**20:6.0f}  estimate {est.peak_bytes / 2**20:7.0f} MiB"
                          f"  {r['error_pct']:+6.1f} %  ({time.time() - t:.0f} s)", flush=True)
    if a.merge:  # the saved rows this run did not replace, in their order
        done = set((r["size"], r["world"], r["mode"]) for r in rows)
        rows = [r for k, rs in old.items() if k not in done for r in rs] + rows
    s = summary(rows)
    print(table(rows))
    print(f"within {LOW:+.0f} % / {HIGH:+.0f} %: {s['within']} of {s['rows']} ranks; "
          f"error {s['min_error_pct']:+.1f} .. {s['max_error_pct']:+.1f} %")
    if (a.rescore or a.merge) and not a.no_write:  # keep the measurement's date and machine
        meta = {k: v for k, v in saved.items() if k not in ("rows", "summary")}
        _write(meta, rows, s)
    elif not a.no_write:
        import torch
        import transformers

        meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    machine=f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, Linux "
                            f"{platform.release()}".replace("  ", " "),
                    python=platform.python_version(), torch=torch.__version__,
                    transformers=transformers.__version__,
                    setup=dict(batch=BATCH, seq=SEQ, steps=STEPS, dtype="fp32", method="full",
                               optimizer="AdamW(fused=True)", backend="gloo", threads_per_rank=1))
        _write(meta, rows, s)
    return 0


def _write(meta: dict, rows: list, s: dict) -> None:
    if True:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, "distributed_cpu.json"), "w") as f:
            json.dump(dict(meta, summary=s, rows=rows), f, indent=1)
        with open(os.path.join(RESULTS, "distributed_cpu.md"), "w") as f:
            f.write(f"# Per-rank peak (VmHWM) of multi-process CPU training vs memguard's estimate\n\n"
                    f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, transformers "
                    f"{meta['transformers']}; gloo, {BATCH} x {SEQ} tokens per rank, fp32 full fine-tune, "
                    f"AdamW(fused=True), {STEPS} steps (more where the steps column says so: "
                    f"`MEMGUARD_BENCH_STEPS`), one thread per rank, glibc's free heap returned at every "
                    f"step's end as memguard's guard does (`python bench/distributed.py`). "
                    f"ZeRO rows: deepspeed 0.19.8, DS_ACCELERATOR=cpu (`--merge --modes zero1,zero2,zero3`). "
                    f"Size tiny = calibration rows.\n\n"
                    + table(rows) + "\n\n" + "\n".join(
                        f"{name}: within {LOW:+.0f} % / {HIGH:+.0f} %: {x['within']} of {x['rows']} ranks; error "
                        f"{x['min_error_pct']:+.1f} .. {x['max_error_pct']:+.1f} %, mean |error| "
                        f"{x['mean_abs_error_pct']:.1f} %." for name, x in
                        [("All scored rows (tiny = calibration, left out)", s)]
                        + [(f"  {k}", s[k]) for k in ("torch", "deepspeed") if k in s]) + "\n\n"
                    "Why single FSDP2 ranks miss (glibc heap holes that differ from rank to rank; probe runs "
                    "with per-arena heap counters in `distributed_cpu_heap.json`): docs/distributed.md, "
                    "\"Per-rank spread\".\n")


if __name__ == "__main__":
    sys.exit(main())
