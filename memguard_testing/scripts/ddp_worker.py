"""Worker of ``test_ddp_gloo_two_ranks_agree``: one rank of a 2-process gloo DDP HF run.

usage: python -m torch.distributed.run --nproc_per_node=2 ddp_worker.py base|split OUT_DIR
"""

import os
import sys

import torch

from memguard_hf import MemGuardCallback
from memguard_testing.hf_tiny import SwitchSplit, lr_sequence, make_trainer, params


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    guard = MemGuardCallback(preflight=False, budget_bytes=64 * 2**30, monitor_interval_s=0)
    extra = []
    if mode == "split":
        extra = [SwitchSplit(guard, at_step={1: 2}, at_substep={2: 4}, ranks=[0])]
    trainer = make_trainer(out, guard=guard, extra_callbacks=extra, batch_size=4, max_steps=4)
    trainer.train()
    rank = torch.distributed.get_rank()
    os.makedirs(out, exist_ok=True)
    torch.save({"global_step": trainer.state.global_step, "lr": lr_sequence(trainer),
                "params": params(trainer), "forward_rows": guard.micro_batch_rows,
                "samples_per_step": guard.samples_per_step}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
