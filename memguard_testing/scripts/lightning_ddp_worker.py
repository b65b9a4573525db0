"""One rank of a 2-process gloo DDP Lightning fit (launched by ``torch.distributed.run``; Lightning
picks the torchelastic environment up), for ``test_lightning_ddp_gloo_two_ranks_agree``
(integration_tests/test_lightning_microbatch.py) and integration_tests/test_lightning_ddp_redo.py.

usage: python -m torch.distributed.run --nproc_per_node=2 lightning_ddp_worker.py OUT_DIR [MODE ...]

Runs each MODE's fit in turn in the same processes (one interpreter start-up for all) and saves
``OUT_DIR/{MODE}_rank{r}.pt`` (``:`` and ``,`` in a MODE become ``_``). Default modes: ``base split``.

Tiny model (``memguard_testing.lightning_tiny``: batch 4 per rank, accumulation 2, 4 optimizer steps,
``DDPStrategy(bucket_cap_mb=10)``):

* ``plain``: unguarded (Lightning's own DDP all-reduce).
* ``base``: unsplit, guarded (a 64 GiB budget: the guard never splits by itself; its preflight
  records the layout it read from the strategy, ``layout`` in the saved results).
* ``split``: rank 0 alone asks for the switches k=2 (batch 1, mid window) and k=4 (batch 4).
* ``hook:K0:CALLS``: ``K0`` micro-batches from the start; on rank 1 alone the backward calls
  ``CALLS`` (1-based, comma-separated) through the first decoder block raise the CPU allocator's
  error from a backward hook (a chosen backward; the other rank healthy).

SmolLM2-135M shape cut to 2 blocks (``memguard_testing.rlimit``: vocabulary 32768, fp32, AdamW,
8 x 256-token rows per rank, accumulation 1, 2 optimizer steps), VmPeak after each phase recorded:

* ``rlimit-ref``: unguarded, no limit (the reference the test places its limit from).
* ``rlimit-none:LIMIT`` / ``rlimit-oom:LIMIT``: rank 1 alone sets ``RLIMIT_AS`` to ``LIMIT`` bytes
  once its model is built; unguarded / guarded with only the OOM path acting (1 TiB budget, no
  preflight, the monitor's step sample off). A rank whose fit raised records the phase and the
  error and leaves with status 1.

``MEMGUARD_TEST_DUMP_AFTER_S`` in the environment: each rank dumps its stacks and exits after that
many seconds (a hang shows where each rank waits).
"""

import os
import resource
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from memguard_lightning import MemGuardCallback
from memguard_testing.train_scripts import alloc_fails_at, preflight_layout
from memguard_testing.lightning_tiny import Recorder, SwitchSplit, TinyLM, make_loader, make_trainer, params


def _guard_stats(guard) -> dict:
    return {"oom_retries": guard.oom_retries, "forward_rows": [int(r) for r in guard.micro_batch_rows],
            "samples_per_step": list(guard.samples_per_step),
            "micro_batches": guard.monitor.micro_batches if guard.monitor is not None else None,
            "ddp_averages": guard.step.ddp_averages,
            "messages": [str(e.get("message", "")) for e in guard.events],
            "layout": preflight_layout(guard.preflight, "bucket_cap_mb")}




def run_tiny(mode: str, out: str) -> None:
    pl.seed_everything(0, verbose=False)
    parts = mode.split(":")
    k0 = int(parts[1]) if parts[0] == "hook" else 1
    guard = None
    if mode != "plain":
        guard = MemGuardCallback(preflight=mode == "base", budget_bytes=64 * 2**30, monitor_interval_s=0,
                                 micro_batches=k0)
    rec = Recorder()
    cbs = [c for c in (guard, rec) if c is not None]
    if mode == "split":
        # rank 0 alone: k=2 from batch 1 (mid window), k=4 from batch 4 (window start)
        cbs.append(SwitchSplit(guard, {1: 2, 4: 4}, ranks=[0]))
    module = TinyLM(total_steps=4)
    trainer = make_trainer(callbacks=cbs, max_steps=4, accumulate=2, devices=2,
                           strategy=DDPStrategy(process_group_backend="gloo", bucket_cap_mb=10))
    if parts[0] == "hook" and int(os.environ.get("RANK", "0")) == 1:
        module.model.model.layers[0].register_full_backward_hook(
            alloc_fails_at({int(c) for c in parts[2].split(",")}))
    trainer.fit(module, make_loader(batch_size=4))
    rank = trainer.global_rank
    torch.save({"global_step": trainer.global_step, "lr": rec.lrs, "params": params(module),
                "batches": rec.batches, "rows_per_step": rec.rows_per_step(2),
                "returned_losses": rec.returned_losses, "logged_losses": rec.logged_losses,
                **(_guard_stats(guard) if guard is not None else {})},
               os.path.join(out, f"{_name(mode)}_rank{rank}.pt"))


def run_rlimit(mode: str, out: str) -> None:
    from memguard_testing.rlimit import PEAKS, PHASE, TokenRows, act_only_on_oom, sampled_params, smollm2
    from memguard_testing.scripts.rlimit_lightning_run import LM, ROWS, SEQ

    kind, _, limit = mode.partition(":")
    vocab = 32768
    model = smollm2(2, vocab_size=vocab)
    torch.set_num_threads(1)
    module = LM(model)
    loader = torch.utils.data.DataLoader(TokenRows(vocab, ROWS // 2, SEQ), batch_size=8, shuffle=False)
    guard = None
    if kind == "rlimit-oom":
        act_only_on_oom()
        guard = MemGuardCallback(budget_bytes=2**40, preflight=False, monitor_interval_s=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"),
                         max_steps=2, accumulate_grad_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[guard] if guard is not None else [])
    rank = int(os.environ.get("RANK", "0"))
    if limit and rank == 1:
        # the soft limit only: the process could raise it back to the hard one
        resource.setrlimit(resource.RLIMIT_AS, (int(limit), resource.getrlimit(resource.RLIMIT_AS)[1]))
    r = {"mode": mode, "rank": rank}
    failed = False
    try:
        trainer.fit(module, loader)
        r.update(steps=trainer.global_step, params=sampled_params(module))
    except Exception as exc:
        failed = True
        r.update(failed=PHASE["now"], error=f"{type(exc).__name__}: {exc}"[:2000])
    r["peaks"] = list(PEAKS)
    if guard is not None:
        r.update(_guard_stats(guard))
    torch.save(r, os.path.join(out, f"{_name(mode)}_rank{rank}.pt"))
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _name(mode: str) -> str:
    return mode.replace(":", "_").replace(",", "_")


def main() -> None:
    out = sys.argv[1]
    modes = sys.argv[2:] or ["base", "split"]
    if os.environ.get("MEMGUARD_TEST_DUMP_AFTER_S"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["MEMGUARD_TEST_DUMP_AFTER_S"]), exit=True)
    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    for mode in modes:
        (run_rlimit if mode.startswith("rlimit") else run_tiny)(mode, out)


if __name__ == "__main__":
    main()
