"""``memguard demo``: a guarded real LoRA fine-tune with HF ``Trainer`` on this machine.

The model has SmolLM2-135M's architecture (Llama, 30 blocks, hidden 576, GQA 9/3 heads, vocab
49152, tied head) with random weights: memory does not depend on the weights' values, and there is
no model hub here. The text shipped with memguard is tokenised byte-wise (ids 3..258 of the 49152
vocabulary), so no tokenizer download is needed either.

The budget is chosen so that the requested micro-batch does not fit (half of it fits below the
guard's 85 % warning level, which the preflight plans against); the preflight plans (checkpointing
and/or a split, whichever fits with the shortest predicted step), and the callback applies the plan
in place. At ``--squeeze-at`` the demo takes 15 % of the budget away, as a co-tenant arriving in the
same container would, and the runtime guard reacts. At the end: the estimate vs the measured peak
(VmHWM) and the proof that the effective batch was kept.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

from transformers import Trainer, TrainerCallback, TrainingArguments

from memguard_core.report import console, demo_result_table, demo_squeeze, print_applied_plan
from memguard_torch.demo import outcome, requested_and_budget, start
from memguard_torch.module_spec import model_spec_from_module

from .callback import MemGuardCallback
from .specs import train_spec

logger = logging.getLogger("memguard.demo")

class Squeeze(TrainerCallback):
    """Takes ``fraction`` of the guard's budget away at optimizer step ``at`` (simulated co-tenant)."""

    def __init__(self, guard: MemGuardCallback, at: int, fraction: float = 0.15):
        self.guard, self.at, self.fraction = guard, at, fraction

    def on_step_begin(self, args, state, control, **kw):
        mon = self.guard.monitor
        if self.at and state.global_step == self.at and mon is not None:
            demo_squeeze(mon, self.fraction, f"step {state.global_step}")


def run_demo(args) -> int:
    """Run the demo; returns 0 when the run completed with the effective batch kept."""
    con, model, data = start(args, "HF Trainer", quiet=("transformers", "accelerate", "peft"))
    out = args.output_dir or tempfile.mkdtemp(prefix="memguard_demo_")
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=2e-4, warmup_steps=1, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=False)
    trainer = Trainer(model=model, args=targs, train_dataset=data)

    ms = model_spec_from_module(model)
    ts = train_spec(trainer, ms, seq_length=args.seq_length, device="cpu")
    requested, budget = requested_and_budget(args, ms, ts)

    guard = MemGuardCallback(budget_bytes=budget, seq_length=args.seq_length, monitor_interval_s=0.2,
                             log_dir=os.path.join(out, "memguard-log"))
    trainer.add_callback(guard)
    trainer.add_callback(Squeeze(guard, args.squeeze_at))
    t1 = time.time()
    trainer.train()
    wall = time.time() - t1

    print_applied_plan(guard.preflight)
    kept, rows = outcome(guard, args, trainer.state.global_step)
    con.print(demo_result_table(
        "memguard demo: result", rows, requested_peak_bytes=requested.peak_bytes, summary=guard.summary,
        measured="VmHWM, training steps", budget_bytes=budget, end_budget_bytes=guard.monitor.budget_bytes,
        wall_s=wall))
    timeline(guard.summary)
    return 0 if kept else 1


def timeline(summary) -> None:
    """Draw the run's event log (memory per step against the budget, the decisions) next to it and
    print both paths. A failure here is reported, not raised: the run itself is over."""
    path = (summary or {}).get("event_log")
    if not path:
        return
    try:
        from memguard_core.timeline import draw_timeline, load_runs

        png = draw_timeline(load_runs([path]), path[: -len(".jsonl")] + ".png",
                            title="memguard demo: memory per optimizer step against the budget")
        console().print(f"event log: {path}\ntimeline:  {png}   (again: memguard report {path})")
    except Exception as exc:
        console().print(f"timeline not drawn: {exc}")
