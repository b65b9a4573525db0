"""A guarded real HF ``Trainer`` fine-tune for the grow-back test and the reaction benchmark
(run as a subprocess, usually inside a memory cgroup with a co-tenant coming and going).

Same model and data as ``container_train.py`` (Llama architecture from config numbers, random
weights, vocab 16384, hidden 256, ``--layers`` blocks; rows of ``--seq-len`` tokens; micro-batch
``--batch-size``): the fp32 logits of the micro-batch dominate the peak, so halving the rows of a
forward roughly halves the per-step part of the peak.

    python memguard_testing/scripts/grow_train.py --output-dir OUT [--steps 12] [--pause-at 2,5]
        [--grow-steps 2] [--grow-seconds 0] [--no-guard] [--interval 0.5]

``--pause-at 2,5``: after optimizer step N the trainer waits (up to 300 s) until ``OUT/go-N``
exists, and writes ``OUT/step-N.done`` first; the caller changes the memory around it meanwhile.

Files written into ``--output-dir``:

* ``forwards.log``: one line per model forward, ``<time.time()> <global_step> <rows>`` (a forward
  pre-hook, so the time is when the forward *starts*);
* ``result.json`` (when ``train()`` returned): global step, rows per optimizer step, the guard's
  events (with their wall times), final k, VmHWM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from memguard_testing.train_scripts import (model_of, script_parser, training_args, vm_hwm_bytes, wait_for_go,
                                            write_result)


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__.split("\n\n")[0], steps=12, layers=2)
    p.add_argument("--no-guard", action="store_true")
    p.add_argument("--pause-at", default="", help="comma list of optimizer steps to pause after")
    p.add_argument("--grow-steps", type=int, default=2)
    p.add_argument("--grow-seconds", type=float, default=0.0)
    p.add_argument("--no-grow", action="store_true")
    p.add_argument("--interval", type=float, default=0.5, help="monitor background interval (s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    from transformers import Trainer, TrainerCallback

    torch.set_num_threads(a.threads)
    out = a.output_dir
    os.makedirs(out, exist_ok=True)
    pauses = {int(x) for x in a.pause_at.split(",") if x.strip()}

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n: int):
            g = torch.Generator().manual_seed(1)
            self.ids = [torch.randint(1, a.vocab, (a.seq_len,), generator=g) for _ in range(n)]

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def collate(rows):
        ids = torch.stack([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}

    state_ref = {}

    class Pause(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            state_ref["state"] = state

        def on_step_end(self, args, state, control, **kw):
            s = state.global_step
            if s in pauses:
                open(os.path.join(out, f"step-{s}.done"), "w").close()
                wait_for_go(os.path.join(out, f"go-{s}"), timeout_s=300, poll_s=0.02)

    model = model_of(a, max_positions=a.seq_len)
    flog = open(os.path.join(out, "forwards.log"), "w", buffering=1)

    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        st = state_ref.get("state")
        flog.write(f"{time.time():.4f} {st.global_step if st else -1} {int(ids.shape[0])}\n")

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    targs = training_args(a, gradient_accumulation_steps=1, save_strategy="no")
    guard = None
    callbacks = [Pause()]
    if not a.no_guard:
        from memguard_core.monitor import GrowPolicy
        from memguard_hf import MemGuardCallback
        guard = MemGuardCallback(monitor_interval_s=a.interval)
        guard.grow = None if a.no_grow else GrowPolicy(steps=a.grow_steps, seconds=a.grow_seconds)
        callbacks.insert(0, guard)
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(a.batch_size * a.steps),
                      data_collator=collate, callbacks=callbacks)
    print(f"grow_train: pid {os.getpid()} guard={guard is not None}", flush=True)
    t0 = time.monotonic()
    trainer.train()
    flog.close()
    result = {"global_step": trainer.state.global_step, "max_steps": a.steps, "vm_hwm_bytes": vm_hwm_bytes(),
              "wall_s": round(time.monotonic() - t0, 2)}
    if guard is not None:
        mon = guard.monitor
        result["guard"] = {
            "events": [dict(e.to_dict(), time=e.timestamp) for e in mon.events],
            "micro_batches": mon.micro_batches, "samples_per_step": guard.samples_per_step,
            "budget_bytes": mon.budget_bytes, "planned_micro_batches": mon.planned_micro_batches,
            "peak_at_micro_batches": {str(k): v for k, v in mon.peak_at_micro_batches.items()},
            "preflight_micro_batches": guard.preflight.micro_batches if guard.preflight else None,
        }
    write_result(out, result)
    print("grow_train: done " + json.dumps({k: result[k] for k in ("global_step", "wall_s")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
