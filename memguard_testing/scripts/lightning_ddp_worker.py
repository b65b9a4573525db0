"""Worker of ``test_lightning_ddp_gloo_two_ranks_agree``: one rank of a 2-process gloo DDP Lightning
fit (launched by ``torch.distributed.run``; Lightning picks the torchelastic environment up).

usage: python -m torch.distributed.run --nproc_per_node=2 lightning_ddp_worker.py OUT_DIR

Runs the unsplit fit, then the split one (rank 0 alone asks for the switches), in the same processes
(one interpreter start-up for both), and saves ``OUT_DIR/{base,split}_rank{r}.pt``.
"""

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from memguard_lightning import MemGuardCallback
from memguard_testing.lightning_tiny import Recorder, SwitchSplit, TinyLM, make_loader, make_trainer, params


def run(mode: str, out: str) -> None:
    pl.seed_everything(0, verbose=False)
    guard = MemGuardCallback(preflight=False, budget_bytes=64 * 2**30, monitor_interval_s=0)
    rec = Recorder()
    cbs = [guard, rec]
    if mode == "split":
        # rank 0 alone: k=2 from batch 1 (mid window), k=4 from batch 4 (window start)
        cbs.append(SwitchSplit(guard, {1: 2, 4: 4}, ranks=[0]))
    module = TinyLM(total_steps=4)
    trainer = make_trainer(callbacks=cbs, max_steps=4, accumulate=2, devices=2,
                           strategy=DDPStrategy(process_group_backend="gloo"))
    trainer.fit(module, make_loader(batch_size=4))
    rank = trainer.global_rank
    torch.save({"global_step": trainer.global_step, "lr": rec.lrs, "params": params(module),
                "batches": rec.batches, "rows_per_step": rec.rows_per_step(2),
                "returned_losses": rec.returned_losses}, os.path.join(out, f"{mode}_rank{rank}.pt"))


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    os.makedirs(out, exist_ok=True)
    run("base", out)
    run("split", out)


if __name__ == "__main__":
    main()
