"""One HF ``Trainer`` full fine-tune of a narrow Llama with SmolLM2-135M's vocabulary (49152 tokens;
2 blocks, hidden 64, random fp32 weights, AdamW) that evaluates after every optimizer step with a
large evaluation batch, under a real address-space limit (``RLIMIT_AS``, what ``prlimit --as`` /
``ulimit -v`` set) that the child sets on itself once the model is built, so torch's CPU allocator
really fails in the evaluation ("DefaultCPUAllocator: can't allocate memory") while training steps
fit.

Training: 2 optimizer steps of 2 rows x 128 tokens. Evaluation: 16 rows x 256 tokens in one batch;
its forward holds the logits (16 x 256 x 49152 fp32, 0.8 GB) and the loss's log-softmax of the same
size, while a training step of 2 x 128 tokens holds a sixteenth of that. The narrow hidden size
keeps the head's matmul (and the run) fast; the logits' size does not depend on it.

usage: python rlimit_hf_eval_run.py LIMIT_BYTES MODES OUT_JSON [LOG_DIR]

LIMIT_BYTES 0: no limit. MODES: one or more of these, comma-separated, run in that order in this
one process (each on a freshly built model and ``Trainer``, the soft limit lifted after each, so a
test pays one interpreter start instead of one per run): ``none`` (unguarded), ``oom`` (guarded,
only the OOM path acting: budget 1 TiB, no preflight, no background thread, the monitor's step
sample switched off so its reading of the limit cannot split the training first), ``ref``
(unguarded, no limit: the reference). LOG_DIR: the guard's event log folder. Writes OUT_JSON: one
result per mode, keyed by the mode: the phase of the failure (``train`` / ``evaluation``), the
optimizer steps done and the error, or the steps done, the ``eval_loss`` of every evaluation, a
fingerprint of the final parameters (every 997th value of each), the guard's training and
evaluation micro-batch rows and retries; VmSize when the run's limit was set (``vm_start``, bytes:
what an earlier run in this process left mapped shows there) and VmPeak after each phase (bytes,
for finding limits; VmPeak is the process's, so only the first run's readings are its own).
"""

import gc
import json
import os
import sys

from transformers import Trainer, TrainerCallback, TrainingArguments

from memguard_testing.rlimit import PEAKS, PHASE, TokenRows, act_only_on_oom, mark, run_limited_once, sampled_params, smollm2

LAYERS, HIDDEN, TRAIN_ROWS, TRAIN_SEQ, TRAIN_BATCH = 2, 64, 4, 128, 2
EVAL_ROWS, EVAL_SEQ = 16, 256


class PhaseTrainer(Trainer):
    """Names the phase an allocation failure happens in."""

    def evaluate(self, *args, **kwargs):
        PHASE["now"] = "evaluation"
        out = super().evaluate(*args, **kwargs)
        mark("evaluation", "train")
        return out


class Phases(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        PHASE["now"] = "train"

    def on_step_end(self, args, state, control, **kw):
        mark("train")


def build_trainer(out_dir: str, ranks: int = 1, trainer_cls=None, **args) -> Trainer:
    """The run's ``Trainer`` (``PhaseTrainer`` unless ``trainer_cls``): the model above, 2 optimizer
    steps of ``TRAIN_BATCH`` rows per rank, an evaluation after each over one ``EVAL_ROWS`` x
    ``EVAL_SEQ`` batch per rank; ``ranks`` sizes the datasets so that each of that many DDP ranks gets
    its own rows; ``args`` override the ``TrainingArguments``."""
    model = smollm2(LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=HIDDEN // 4)
    vocab = model.config.vocab_size
    args = TrainingArguments(**{**dict(output_dir=out_dir, per_device_train_batch_size=TRAIN_BATCH,
                                       per_device_eval_batch_size=EVAL_ROWS, gradient_accumulation_steps=1,
                                       max_steps=2, learning_rate=1e-4, logging_steps=1, eval_strategy="steps",
                                       eval_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                       disable_tqdm=True, dataloader_num_workers=0, optim="adamw_torch", seed=0),
                                **args})
    return (trainer_cls or PhaseTrainer)(
        model=model, args=args, train_dataset=TokenRows(vocab, TRAIN_ROWS * ranks, TRAIN_SEQ, 0, ragged=True),
        eval_dataset=TokenRows(vocab, EVAL_ROWS * ranks, EVAL_SEQ, 1, ragged=True), callbacks=[Phases()])


def run_one(limit: int, mode: str, out_dir: str, log_dir=None) -> dict:
    """One run (module docstring) on a fresh model and ``Trainer``; returns its result."""
    PHASE["now"] = "setup"
    PEAKS.clear()
    trainer = build_trainer(out_dir)
    guard = None
    if mode == "oom":
        from memguard_hf import MemGuardCallback

        act_only_on_oom()
        guard = MemGuardCallback(budget_bytes=2**40, preflight=False, monitor_interval_s=0, log_dir=log_dir)
        trainer.add_callback(guard)

    def train(r):
        trainer.train()
        r["params"] = sampled_params(trainer.model)

    def finish(r):
        r["steps"] = trainer.state.global_step
        r["eval_losses"] = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        if guard is not None:
            r.update(oom_retries=guard.oom_retries, rows=[int(x) for x in guard.micro_batch_rows],
                     eval_oom_retries=guard.eval_oom_retries, eval_rows=list(guard.eval_micro_batch_rows),
                     eval_micro_batches=guard.eval_micro_batches,
                     micro_batches=guard.monitor.micro_batches if guard.monitor is not None else None,
                     event_log=(guard.summary or {}).get("event_log"))

    return run_limited_once(limit, mode, train, finish)


def main() -> None:
    limit, modes, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    log_dir = sys.argv[4] if len(sys.argv) > 4 else None
    results = {}
    for mode in modes:
        results[mode] = run_one(0 if mode == "ref" else limit, "none" if mode == "ref" else mode,
                                os.path.dirname(out) or ".", log_dir)
        gc.collect()   # the run's model, optimizer states and frames, before the next run builds its own
    with open(out, "w") as f:
        json.dump(results, f)

if __name__ == "__main__":
    main()
