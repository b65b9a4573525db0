"""Worker of ``test_ddp_gloo_two_ranks_agree``: one rank of a 2-process gloo DDP HF run.

usage: python -m torch.distributed.run --nproc_per_node=2 ddp_worker.py base|split|oom OUT_DIR

Every mode runs DDP with ``ddp_bucket_cap_mb=10``. ``base`` runs the preflight as well (a 64 GiB
budget: it changes nothing) and records the layout it read from the ``Trainer``.

``oom``: on rank 1 alone, the 4th backward (step 2's last, the one DDP would all-reduce in) asks
the CPU allocator for a petabyte from a backward hook of the first block: a real allocator failure
at a chosen point, the other rank healthy.
"""

import os
import sys

import torch

from memguard_hf import MemGuardCallback
from memguard_testing.hf_tiny import SwitchSplit, lr_sequence, make_trainer, params
from memguard_testing.train_scripts import preflight_layout


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    guard = MemGuardCallback(preflight=mode == "base", budget_bytes=64 * 2**30, monitor_interval_s=0)
    extra = []
    if mode == "split":
        extra = [SwitchSplit(guard, at_step={1: 2}, at_substep={2: 4}, ranks=[0])]
    trainer = make_trainer(out, guard=guard, extra_callbacks=extra, batch_size=4, max_steps=4, ddp_bucket_cap_mb=10)
    if mode == "oom" and int(os.environ.get("RANK", "0")) == 1:
        calls = [0]

        def fail_once(module, grad_input, grad_output):
            calls[0] += 1
            if calls[0] == 4:
                torch.empty(2**50, dtype=torch.uint8)   # DefaultCPUAllocator: can't allocate memory

        trainer.model.model.layers[0].register_full_backward_hook(fail_once)
    trainer.train()
    rank = torch.distributed.get_rank()
    os.makedirs(out, exist_ok=True)
    torch.save({"global_step": trainer.state.global_step, "lr": lr_sequence(trainer),
                "params": params(trainer), "forward_rows": guard.micro_batch_rows,
                "samples_per_step": guard.samples_per_step, "oom_retries": guard.oom_retries,
                "layout": preflight_layout(guard.preflight, "bucket_cap_mb", "gradient_as_bucket_view")},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
