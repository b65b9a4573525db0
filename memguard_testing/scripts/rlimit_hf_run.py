"""HF ``Trainer`` full fine-tunes of the SmolLM2-135M shape cut to 12 blocks (random fp32 weights,
AdamW), batch 8 x 256 tokens, under a real address-space limit (``RLIMIT_AS``, what
``prlimit --as`` / ``ulimit -v`` set) that the child sets on itself once the model is built, so
torch's CPU allocator really fails ("DefaultCPUAllocator: can't allocate memory").

usage: python rlimit_hf_run.py OUT_JSON RUN [RUN ...]

RUN: ``NAME=LIMIT_BYTES,MODE,STEPS,BATCH``. The runs go in that order in this one process, each on
a freshly built model and ``Trainer``, the soft limit lifted after each (so a test pays one
interpreter start instead of one per run; an earlier run's leftovers show in the next one's
``vm_start``). LIMIT_BYTES 0: no limit. MODE: ``none`` (unguarded), ``oom`` (guarded, only the
OOM path acting: budget 1 TiB, no preflight, no background thread, the monitor's step sample
switched off so its reading of the limit cannot split first), ``probe`` (guarded with the defaults,
preflight included, no background thread: the probe reads the limit as the budget before the first
forward). Writes OUT_JSON: per NAME, the phase of the failure (``forward`` / ``backward`` /
``optimizer``) and its message, or the steps done, a fingerprint of the final parameters (every
997th value of each; an unlimited run also after each optimizer step, ``step_params``), the
guard's retries and micro-batch rows, VmSize when the limit was set (``vm_start``, bytes) and
VmPeak after each phase of each step (bytes, for finding limits; VmPeak is the process's, so only
the first run's readings are its own).
"""

import gc
import importlib
import json
import os
import sys

from transformers import Trainer, TrainerCallback, TrainingArguments

from memguard_testing.rlimit import (PEAKS, PHASE, TokenRows, act_only_on_oom, mark, run_limited_once, sampled_params,
                                     smollm2)

ROWS, SEQ, LAYERS = 32, 256, 12


class PhaseTrainer(Trainer):
    """Names the phase each allocation failure happens in."""

    def compute_loss(self, *args, **kwargs):
        PHASE["now"] = "forward"
        out = super().compute_loss(*args, **kwargs)
        mark("forward", "backward")
        return out


class Phases(TrainerCallback):
    def on_substep_end(self, args, state, control, **kw):
        mark("backward")

    def on_pre_optimizer_step(self, args, state, control, **kw):
        mark("backward", "optimizer")

    def on_optimizer_step(self, args, state, control, **kw):
        mark("optimizer", "other")


class StepParams(TrainerCallback):
    """Samples the parameters after each optimizer step (a reference for runs of fewer steps: the
    linear schedule's first step has the full learning rate whatever ``max_steps``)."""

    def __init__(self):
        self.taken = []

    def on_step_end(self, args, state, control, model=None, **kw):
        self.taken.append(sampled_params(model))


def run_one(limit: int, mode: str, steps: int, batch: int, out_dir: str) -> dict:
    """One run (module docstring) on a fresh model and ``Trainer``; returns its result."""
    PHASE["now"] = "setup"
    PEAKS.clear()
    model = smollm2(LAYERS)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-4,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch", seed=0)
    trainer = PhaseTrainer(model=model, args=args, train_dataset=TokenRows(model.config.vocab_size, ROWS, SEQ),
                           callbacks=[Phases()])
    step_params = StepParams() if not limit else None   # only where no limit can meet its allocations
    if step_params is not None:
        trainer.add_callback(step_params)
    guard = None
    if mode in ("oom", "probe"):
        from memguard_hf import MemGuardCallback
    if mode == "oom":
        act_only_on_oom()
        guard = MemGuardCallback(budget_bytes=2**40, preflight=False, monitor_interval_s=0)
    elif mode == "probe":
        guard = MemGuardCallback(monitor_interval_s=0)
    if guard is not None:
        trainer.add_callback(guard)

    def train(r):
        trainer.train()
        r["steps"] = trainer.state.global_step
        r["params"] = sampled_params(trainer.model)

    def finish(r):
        if step_params is not None:
            r["step_params"] = step_params.taken
        if guard is not None:
            r.update(oom_retries=guard.oom_retries, rows=[int(x) for x in guard.micro_batch_rows],
                     samples_per_step=guard.samples_per_step,
                     micro_batches=guard.monitor.micro_batches if guard.monitor is not None else None)

    return run_limited_once(limit, mode, train, finish)


def main() -> None:
    out, results = sys.argv[1], {}
    if len(sys.argv) > 3:
        # imported before the first of several runs, guarded or not: its modules then sit in every
        # run's base address space alike, and what a run starts with beyond the first one's
        # (``vm_start``) is what the earlier runs left
        importlib.import_module("memguard_hf")
    for spec in sys.argv[2:]:
        name, fields = spec.split("=")
        limit, mode, steps, batch = fields.split(",")
        results[name] = run_one(int(limit), mode, int(steps), int(batch), os.path.dirname(out) or ".")
        gc.collect()   # the run's model, optimizer states and frames, before the next run builds its own
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
