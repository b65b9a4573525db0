"""A real HF ``Trainer`` fine-tune for the container scenarios (run as a subprocess, inside a cgroup).

The model is a Llama-architecture decoder built from config numbers with random weights (no hub):
vocab ``--vocab`` (default 16384), hidden ``--hidden`` (256), ``--layers`` (4) blocks, 4 query /
2 KV heads, MLP 512, untied head. Its weights, gradients and AdamW states are ~11 M parameters
(~170 MiB together); with micro-batch 16 x 256 tokens the fp32 logits (16 x 256 x 16384 x 4 B =
256 MiB) and their cross-entropy temporaries dominate the peak, as they do in real fine-tunes.

    python memguard_testing/scripts/container_train.py --output-dir OUT [--guard] [--batch-size 16]
        [--grad-accum 1] [--steps 6] [--seq-len 256] [--save-steps 0] [--resume]
        [--pause-at-step N --go-file PATH] [--long-seq-len S --long-from-step N]
        [--guard-seq-length S] [--no-preflight]

Files written into ``--output-dir`` (what the tests read):

* ``steps.log``: one line per finished optimizer step, ``<pid> <global_step> <rows>``, appended
  (several attempts of one run under ``memguard run`` share it);
* ``step-<N>.done``: a marker per finished optimizer step (the test starts a co-tenant on it);
* ``result.json``: written only when ``trainer.train()`` returned: global step, max steps,
  effective batch, rows per optimizer step, the guard's summary and events, the process's peak
  RSS (VmHWM), the log history's steps;
* ``checkpoint-<N>/`` with ``--save-steps``.

``--pause-at-step N --go-file F``: after step N the trainer waits (up to 120 s) until ``F``
exists. The tests use it to let a co-tenant take its memory *between* two optimizer steps, so the
outcome does not depend on where inside a step the co-tenant happened to arrive.

``--resume``: ``trainer.train(resume_from_checkpoint=memguard_hf.resume_checkpoint())``, the
checkpoint the ``memguard run`` supervisor names in ``MEMGUARD_RESUME_FROM`` (None on a first run).

``--long-seq-len S --long-from-step N``: rows of optimizer steps >= N are S tokens long instead
of ``--seq-len`` (sequential sampling, so the same rows come at the same steps on a resume): a
long batch arriving mid-run, which no per-step guard can see coming.
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
    p = script_parser(__doc__.split("\n\n")[0], steps=6, layers=4)
    p.add_argument("--guard", action="store_true", help="add MemGuardCallback (default budget)")
    p.add_argument("--no-preflight", action="store_true", help="guard without the preflight")
    p.add_argument("--guard-seq-length", type=int, default=None,
                   help="seq_length given to MemGuardCallback (default: scanned from the data)")
    p.add_argument("--monitor-interval", type=float, default=0.5)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--long-seq-len", type=int, default=0)
    p.add_argument("--long-from-step", type=int, default=0)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="resume from MEMGUARD_RESUME_FROM if set")
    p.add_argument("--pause-at-step", type=int, default=0)
    p.add_argument("--go-file", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    from transformers import Trainer, TrainerCallback

    torch.set_num_threads(a.threads)
    os.makedirs(a.output_dir, exist_ok=True)
    rows_per_step = a.batch_size * a.grad_accum

    class Rows(torch.utils.data.Dataset):
        def __init__(self, n: int):
            g = torch.Generator().manual_seed(1)
            self.rows = []
            for i in range(n):
                long = a.long_seq_len and a.long_from_step and i // rows_per_step + 1 >= a.long_from_step
                length = a.long_seq_len if long else a.seq_len
                ids = torch.randint(1, a.vocab, (length,), generator=g).tolist()
                self.rows.append({"input_ids": ids, "labels": ids, "attention_mask": [1] * length})

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    def collate(rows):
        return {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}

    out = a.output_dir
    steps_log = os.path.join(out, "steps.log")

    class StepMarks(TrainerCallback):
        """Per finished optimizer step: a line in steps.log and a marker file; optional pause."""

        def on_step_end(self, args, state, control, **kw):
            s = state.global_step
            with open(steps_log, "a") as f:
                f.write(f"{os.getpid()} {s} {rows_per_step}\n")
            open(os.path.join(out, f"step-{s}.done"), "w").close()
            if a.pause_at_step and s == a.pause_at_step and a.go_file:
                wait_for_go(a.go_file, timeout_s=120, poll_s=0.05)

    model = model_of(a, max_positions=max(a.seq_len, a.long_seq_len))
    targs = training_args(a, gradient_accumulation_steps=a.grad_accum,
                          save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500)
    guard = None
    callbacks = [StepMarks()]
    if a.guard:
        from memguard_hf import MemGuardCallback
        guard = MemGuardCallback(seq_length=a.guard_seq_length, preflight=not a.no_preflight,
                                 monitor_interval_s=a.monitor_interval)
        callbacks.insert(0, guard)
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(rows_per_step * a.steps),
                      data_collator=collate, callbacks=callbacks)
    resume = None
    if a.resume:
        from memguard_hf import resume_checkpoint
        resume = resume_checkpoint()
    print(f"container_train: pid {os.getpid()} guard={a.guard} split_env={os.environ.get('MEMGUARD_MICRO_BATCHES')} "
          f"resume={resume}", flush=True)
    t0 = time.monotonic()
    trainer.train(resume_from_checkpoint=resume)
    result = {
        "completed": True,
        "global_step": trainer.state.global_step,
        "max_steps": a.steps,
        "effective_batch": rows_per_step,
        "resumed_from": resume,
        "log_steps": [h["step"] for h in trainer.state.log_history if "loss" in h],
        "vm_hwm_bytes": vm_hwm_bytes(),
        "wall_s": round(time.monotonic() - t0, 2),
    }
    if guard is not None:
        result["guard"] = {
            "summary": getattr(guard, "summary", None),
            "events": guard.events,
            "micro_batches": guard.monitor.micro_batches if guard.monitor else None,
            "samples_per_step": guard.samples_per_step,
            "max_forward_rows": max(guard.micro_batch_rows) if guard.micro_batch_rows else None,
            "min_forward_rows": min(guard.micro_batch_rows) if guard.micro_batch_rows else None,
            "budget_bytes": guard.monitor.budget_bytes if guard.monitor else None,
            "preflight_micro_batches": guard.preflight.micro_batches if guard.preflight else None,
            "preflight_changes": [c.reason for c in guard.preflight.applied] if guard.preflight else [],
        }
    write_result(out, result)
    print("container_train: done " + json.dumps({k: result[k] for k in ("global_step", "vm_hwm_bytes", "wall_s")}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
