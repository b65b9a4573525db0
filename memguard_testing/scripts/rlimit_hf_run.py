"""One HF ``Trainer`` full fine-tune of the SmolLM2-135M shape cut to 12 blocks (random fp32
weights, AdamW), batch 8 x 256 tokens, under a real address-space limit (``RLIMIT_AS``, what
``prlimit --as`` / ``ulimit -v`` set) that the child sets on itself once the model is built, so
torch's CPU allocator really fails ("DefaultCPUAllocator: can't allocate memory").

usage: python rlimit_hf_run.py LIMIT_BYTES MODE OUT_JSON [STEPS] [GRAD_ACCUM] [BATCH]

LIMIT_BYTES 0: no limit. MODE: ``none`` (unguarded), ``oom`` (guarded, only the OOM path acting:
budget 1 TiB, no preflight, no background thread, the monitor's step sample switched off so its
reading of the limit cannot split first), ``probe`` (guarded with the defaults, preflight included, no background
thread: the probe reads the limit as the budget before the first forward). Writes OUT_JSON: the phase of the failure (``forward`` / ``backward`` /
``optimizer``) and its message, or the steps done, a fingerprint of the final parameters (every
997th value of each), the guard's retries and micro-batch rows, and VmPeak after each phase of
each step (bytes, for finding limits).
"""

import os
import sys

from transformers import Trainer, TrainerCallback, TrainingArguments

from memguard_testing.rlimit import PHASE, TokenRows, act_only_on_oom, mark, run_limited, sampled_params, smollm2

ROWS, SEQ, BATCH, LAYERS = 32, 256, 8, 12


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


def main() -> None:
    limit, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    accum = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else BATCH
    model = smollm2(LAYERS)
    args = TrainingArguments(output_dir=os.path.dirname(out) or ".", per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accum, max_steps=steps, learning_rate=1e-4,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch", seed=0)
    trainer = PhaseTrainer(model=model, args=args, train_dataset=TokenRows(model.config.vocab_size, ROWS, SEQ),
                           callbacks=[Phases()])
    guard = None
    if mode == "oom":
        from memguard_hf import MemGuardCallback

        act_only_on_oom()
        guard = MemGuardCallback(budget_bytes=2**40, preflight=False, monitor_interval_s=0)
    elif mode == "probe":
        from memguard_hf import MemGuardCallback

        guard = MemGuardCallback(monitor_interval_s=0)
    if guard is not None:
        trainer.add_callback(guard)

    def train(r):
        trainer.train()
        r["steps"] = trainer.state.global_step
        r["params"] = sampled_params(trainer.model)

    def finish(r):
        if guard is not None:
            r.update(oom_retries=guard.oom_retries, rows=[int(x) for x in guard.micro_batch_rows],
                     samples_per_step=guard.samples_per_step,
                     micro_batches=guard.monitor.micro_batches if guard.monitor is not None else None)

    run_limited(limit, mode, out, train, finish)


if __name__ == "__main__":
    main()
