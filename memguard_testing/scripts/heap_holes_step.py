"""One plain-PyTorch optimizer step under ``TorchGuard`` on CPU after the heap was left with holes
(2,000 touched 64 KiB tensors, every other one freed: below glibc's mmap threshold, so they live in
the heap, and the kept ones stop the freed ones from merging or reaching the top). Prints one JSON
line: RSS before and after ``step_end`` and the per-step figures recorded.

usage: python heap_holes_step.py on|off|unsampled

``unsampled``: the core ``Guard`` started without a batch boundary (as Lightning's non-splitting
paths run it: memory sampled outside ``micro_batches_for_step``); ``end_step(1)`` must still trim.
"""

import json
import sys

import torch

from memguard_testing.train_scripts import proc_status_bytes
from memguard_torch import TorchGuard


def unsampled() -> None:
    from memguard_core.guard import Guard
    from memguard_core.options import GuardOptions

    guard = Guard(GuardOptions.from_kwargs(budget_bytes=64 * 2**30, monitor_interval_s=0, preflight=False,
                                           leak_detector=False, device="cpu"))
    guard.start(rows=1)
    blocks = [torch.ones(16384) for _ in range(2000)]
    kept = blocks[::2]
    del blocks
    before = proc_status_bytes("VmRSS")
    guard.end_step(1)
    after = proc_status_bytes("VmRSS")
    guard.stop()
    print("RESULT " + json.dumps({"before": before, "after": after, "kept": len(kept), "steps": 1}))


def main() -> None:
    if sys.argv[1] == "unsampled":
        return unsampled()
    trim = sys.argv[1] == "on"
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = TorchGuard(model, opt, budget_gib=64, monitor_interval_s=0, preflight=False, leak_detector=False,
                       trim_heap=trim)
    blocks = [torch.ones(16384) for _ in range(2000)]   # 64 KiB each, every page touched
    kept = blocks[::2]
    del blocks
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for (cx, cy), w in guard.chunks((x, y)):
        with guard.micro_step():
            (torch.nn.functional.mse_loss(model(cx), cy) * w).backward()
    opt.step()
    opt.zero_grad()
    before = proc_status_bytes("VmRSS")
    guard.step_end()
    after = proc_status_bytes("VmRSS")
    summary = guard.finish()
    print("RESULT " + json.dumps({"before": before, "after": after, "kept": len(kept),
                                  "steps": summary.get("optimizer_steps") if summary else None}))


if __name__ == "__main__":
    main()
