"""One rank of a 2-rank (or more) plain-loop training run on CPU with gloo, for
integration_tests/test_torch_loop.py: a tiny Llama (hidden 64) under DDP, FSDP2 (``fully_shard``
per decoder block and the root) or FSDP1 (``FullyShardedDataParallel``, ``use_orig_params``, every
decoder block and the root wrapped), AdamW, a few steps of each rank's own rows,
either unguarded and unsplit (``--plain``: the reference) or through ``memguard_torch.TorchGuard``
(``--k``: micro-batches from the start). Rank 0 writes the final full parameters, every rank a JSON
of its figures (rows of each forward, OOM retries, VmSize before training, VmPeak after, the
growth of VmHWM over the training).

``--plain --chunks K [--fsdp-no-sync]``: an unguarded FSDP2 loop that cuts each batch into K chunks
itself, reduce-scattering every chunk (FSDP's default) or, with ``--fsdp-no-sync``,
``set_requires_gradient_sync(False)`` for all but the last (docs/torch_loop.md, FSDP2).

``--rlimit-rank R --rlimit-headroom BYTES``: rank R sets ``RLIMIT_AS`` to its VmSize just before
training plus BYTES, so torch's CPU allocator really fails there when a step needs more;
``--oom-path-only`` switches the monitor's step sample off (it would read the limit and split
before the failure), so the OOM path is what acts.

Several runs in one launch: argument groups separated by ``--then`` (each with its own ``--out``)
run in sequence in the same ranks and gloo group, each building its own seeded model and optimizer.

Launched by path with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment (the test
launches it with ``memguard_testing.torchrun``, which runs this module's top level, its imports,
once and forks the ranks from it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys

import torch
import torch.distributed as dist

import memguard_torch._compat as compat
from memguard_core.monitor import Action, MemoryMonitor
from memguard_testing.hf_tiny import RowsDataset, VOCAB, llama, pad_collate
from memguard_torch import TorchGuard


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("ddp", "fsdp", "fsdp1"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=24)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--rlimit-rank", type=int, default=-1)
    ap.add_argument("--rlimit-headroom", type=int, default=0)
    ap.add_argument("--oom-path-only", action="store_true",
                    help="switch the monitor's step sample off: it would read the limit and split before the failure")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=1,
                    help="--plain: cut each batch into this many row chunks (equal weights by valid labels)")
    ap.add_argument("--fsdp-no-sync", action="store_true",
                    help="--plain --chunks: set_requires_gradient_sync(False) for every chunk but the last")
    ap.add_argument("--no-oom-sync", action="store_true", help="TorchGuard(oom_sync=False)")
    ap.add_argument("--module-hooks", action="store_true",
                    help="FSDP sync points by module hooks (the fallback for modules whose comms cannot be replaced)")
    ap.add_argument("--k-at-step", default="", help="rank:step:k[,...] raise k on one rank at a step")
    return ap


def main(argv=None) -> int:
    """Run the scenarios of ``argv`` (argument groups separated by ``--then``) one after another in
    this process and its one gloo group: one process start and one import of torch/transformers for
    several runs. VmPeak never falls, so a scenario that places a limit from its VmPeak (an
    ``--plain`` out-of-memory reference) must be the first of its launch."""
    argv = sys.argv[1:] if argv is None else list(argv)
    groups, cur = [], []
    for item in argv:
        if item == "--then":
            groups.append(cur)
            cur = []
        else:
            cur.append(item)
    groups.append(cur)
    ap = _parser()
    scenarios = [ap.parse_args(g) for g in groups]
    if os.environ.get("MEMGUARD_TEST_DUMP_AFTER_S"):
        import faulthandler

        # a hang shows where each rank waits (the test kills the ranks after its timeout)
        faulthandler.dump_traceback_later(float(os.environ["MEMGUARD_TEST_DUMP_AFTER_S"]), exit=True)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for a in scenarios:
        _run_scenario(a, dist)
        gc.collect()   # the last scenario's model and optimizer gone before the next one's baseline
        dist.barrier()
    # leave without tearing the gloo group down: its teardown can abort the process
    # ("terminate called without an active exception") after every result is written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_scenario(a, dist) -> None:
    """One training run as ``a`` says; writes its results under ``a.out``."""
    # the patches below are this scenario's only: the next one in this process starts unpatched
    saved = (MemoryMonitor.step_sample, compat.sync_fsdp_comms)
    try:
        _train(a, dist, torch, RowsDataset, VOCAB, llama, pad_collate)
    finally:
        MemoryMonitor.step_sample, compat.sync_fsdp_comms = saved


def _train(a, dist, torch, RowsDataset, VOCAB, llama, pad_collate) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama(VOCAB, hidden=a.hidden, layers=4, max_positions=max(128, a.seq), seed=0)
    model.config._attn_implementation = a.attn
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model)
    elif a.mode == "fsdp1":
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        train_model = FullyShardedDataParallel(
            model, device_id=torch.device("cpu"), use_orig_params=True,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        train_model = model
    model.train()
    opt = torch.optim.AdamW(train_model.parameters(), lr=1e-3)
    ds = RowsDataset(n=a.batch * world * a.steps, max_len=a.seq, seed=1)
    rows = [ds[i] for i in range(len(ds))]
    batches = [pad_collate(rows[(s * world + rank) * a.batch:(s * world + rank + 1) * a.batch])
               for s in range(a.steps)]
    k_at = {}
    for item in filter(None, a.k_at_step.split(",")):
        r, s, k = (int(x) for x in item.split(":"))
        if r == rank:
            k_at[s] = k

    guard = None
    if not a.plain:

        if a.oom_path_only:

            MemoryMonitor.step_sample = lambda self, step=None: Action.NONE

        if a.module_hooks:
        
            compat.sync_fsdp_comms = lambda module, before: None
        guard = TorchGuard(train_model, opt, micro_batches=a.k, budget_gib=16, monitor_interval_s=0,
                           leak_detector=False, oom_sync=False if a.no_oom_sync else None)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # VmHWM := VmRSS: the peak of the training alone
    rss0 = _vm("VmRSS")
    base = _vm("VmSize")
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if rank == a.rlimit_rank:
        # the soft limit only: an unprivileged process can lower it and raise it back to the hard one
        resource.setrlimit(resource.RLIMIT_AS, (base + a.rlimit_headroom, hard))
    for step, batch in enumerate(batches):
        if guard is None and a.chunks > 1:
            from memguard_torch.microbatch import split_batch

            parts = split_batch(batch, a.chunks, shift_labels=True)
            for i, c in enumerate(parts):
                last = i == len(parts) - 1
                if a.fsdp_no_sync:
                    train_model.set_requires_gradient_sync(last)
                (train_model(**c.inputs).loss * c.weight).backward()
        elif guard is None:
            (train_model(**batch).loss).backward()
        else:
            if step in k_at and guard.monitor is not None:
                guard.monitor.request_micro_batches(k_at[step], "test: this rank asks for it", step)

            def fb(chunk, weight):
                (train_model(**chunk).loss * weight).backward()

            guard.run(batch, fb)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if guard is not None:
            guard.step_end()
    peak = _vm("VmPeak")
    hwm_growth = _vm("VmHWM") - rss0
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    summary = guard.finish() if guard is not None else None
    full = {}
    if a.mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(train_model):   # an all-gather on every rank
            full = {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for name, p in train_model.named_parameters()}
    for name, p in ([] if a.mode == "fsdp1" else model.named_parameters()):
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        full[name] = t.clone()
    os.makedirs(a.out, exist_ok=True)
    if rank == 0:
        torch.save(full, os.path.join(a.out, "params.pt"))
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "base_vmsize": base, "vmpeak": peak, "hwm_growth": hwm_growth,
                   "param_bytes": sum(t.numel() * t.element_size() for t in full.values()),
                   "micro_batch_rows": [int(r) for r in guard.micro_batch_rows] if guard else [],
                   "oom_retries": guard.oom_retries if guard else 0,
                   "oom_errors": guard.oom_errors if guard else [],
                   "sync_points": guard.sync.points if guard else 0,
                   "preflight_sharding": (guard.preflight.plan.train_spec.sharding if guard and guard.preflight else None),
                   "events": guard.events if guard else [],
                   "optimizer_steps": guard.optimizer_steps if guard else a.steps,
                   "summary_micro_batches": summary.get("micro_batches") if summary else None}, f)


if __name__ == "__main__":
    sys.exit(main())
