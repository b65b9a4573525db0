"""A tiny real guarded run that is killed after a checkpoint and resumed from it in a new process,
for ``integration_tests/test_resume_state.py`` (the guard's state saved with the checkpoint and
taken back: docs/lifecycle.md, "What a resume restores").

    python memguard_testing/scripts/resume_state_run.py hf|lightning|mlx --out DIR --steps 6
        [--split-at 2 --split-to 4] [--kill-at 4] [--resume PATH|auto] [--budget-bytes B]

* ``--split-at S --split-to K``: before optimizer step S + 1 (HF, Lightning) / iteration S + 1
  (mlx_lm) the monitor is asked for K micro-batches per batch (``request_micro_batches``, what the
  monitor does under pressure);
* ``--kill-at S``: once the checkpoint of step / iteration S is written, the process SIGKILLs
  itself (no Python exception, no ``finally``: as the OOM killer ends a run);
* ``--resume``: HF ``train(resume_from_checkpoint=PATH)`` (``auto``: ``True``), Lightning
  ``fit(ckpt_path=PATH)``, mlx_lm ``memguard_mlx.train(resume_from=PATH)``.

Written into ``DIR`` (appended, one process after another): ``starts.jsonl`` (per start: pid, the
step it starts at, the guard's k and its planned k right after its start, whether the preflight
ran, where the state was restored from, activation checkpointing on the model), ``steps.jsonl``
(per optimizer step / iteration: pid, step, rows of each forward) and ``memguard.log`` (the
``memguard.*`` log lines).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("framework", choices=("hf", "lightning", "mlx"))
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--split-at", type=int, default=0)
    p.add_argument("--split-to", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--budget-bytes", type=int, default=64 * 2**30)
    return p.parse_args(argv)


class Out:
    """The files the test reads (see the module doc)."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, exist_ok=True)
        handler = logging.FileHandler(os.path.join(root, "memguard.log"))
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        log = logging.getLogger("memguard")
        log.addHandler(handler)
        log.setLevel(logging.INFO)

    def line(self, name: str, record: dict) -> None:
        with open(os.path.join(self.root, name), "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **record}) + "\n")

    def start(self, guard, step: int, checkpointing: bool) -> None:
        self.line("starts.jsonl", {"step": int(step), "k": guard.monitor.micro_batches,
                                   "planned_k": guard.monitor.planned_micro_batches,
                                   "preflight_ran": guard.preflight is not None, "restored_from": guard.restored_from,
                                   "checkpointing": bool(checkpointing)})


def die() -> None:
    logging.shutdown()   # the log lines so far reach the file; nothing else runs
    os.kill(os.getpid(), signal.SIGKILL)


def run_hf(a, out: Out) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from memguard_hf import MemGuardCallback
    from memguard_testing.hf_tiny import RowsDataset, pad_collate, tiny_llama

    class Record(TrainerCallback):
        def __init__(self):
            self.forwards = []

        def on_train_begin(self, args, state, control, model=None, **kw):
            model.register_forward_pre_hook(lambda m, args_, kw_: self.forwards.append(int(kw_["input_ids"].shape[0])),
                                            with_kwargs=True)
            out.start(guard.guard, state.global_step, getattr(model, "is_gradient_checkpointing", False))

        def on_step_begin(self, args, state, control, **kw):
            self.forwards = []
            if a.split_at and state.global_step == a.split_at:
                guard.monitor.request_micro_batches(a.split_to, "test: memory pressure", state.global_step)

        def on_step_end(self, args, state, control, **kw):
            out.line("steps.jsonl", {"step": state.global_step, "forwards": self.forwards})

        def on_save(self, args, state, control, **kw):
            if a.kill_at and state.global_step == a.kill_at:
                die()

    args = TrainingArguments(output_dir=os.path.join(a.out, "ckpt"), per_device_train_batch_size=8,
                             gradient_accumulation_steps=1, max_steps=a.steps, learning_rate=5e-3,
                             save_strategy="steps", save_steps=1, report_to=[], use_cpu=True, seed=0,
                             data_seed=0, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1)
    trainer = Trainer(model=tiny_llama(0), args=args, train_dataset=RowsDataset(64), data_collator=pad_collate,
                      callbacks=[Record()])
    guard = MemGuardCallback.attach(trainer, budget_bytes=a.budget_bytes, monitor_interval_s=0, grow=None)
    resume = None if a.resume is None else (True if a.resume == "auto" else a.resume)
    trainer.train(resume_from_checkpoint=resume)


def run_lightning(a, out: Out) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from memguard_lightning import MemGuardCallback
    from memguard_testing.lightning_tiny import TinyLM, make_loader, make_trainer

    class Record(pl.Callback):
        def __init__(self):
            self.forwards, self.told = [], False

        def on_train_start(self, trainer, pl_module):
            pl_module.model.register_forward_pre_hook(
                lambda m, args_, kw_: self.forwards.append(int(kw_["input_ids"].shape[0])), with_kwargs=True)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if a.kill_at and trainer.global_step == a.kill_at:
                die()   # the checkpoint of step kill_at was written at the end of the batch before
            self.forwards = []
            if not self.told:   # the guard (first in the list) has started at this batch
                self.told = True
                out.start(guard.guard, trainer.global_step, False)
            if a.split_at and trainer.global_step == a.split_at:
                guard.monitor.request_micro_batches(a.split_to, "test: memory pressure", trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            out.line("steps.jsonl", {"step": trainer.global_step, "forwards": self.forwards})

    pl.seed_everything(0, verbose=False)
    guard = MemGuardCallback(budget_bytes=a.budget_bytes, monitor_interval_s=0, grow=None)
    ckpt = ModelCheckpoint(dirpath=os.path.join(a.out, "ckpt"), every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(callbacks=[guard, Record(), ckpt], max_steps=a.steps, accumulate=1,
                           enable_checkpointing=True)
    trainer.fit(TinyLM(total_steps=a.steps), make_loader(8), ckpt_path=a.resume)


def run_mlx(a, out: Out) -> None:
    import numpy as np
    from mlx_lm.tuner.trainer import iterate_batches

    import memguard_mlx
    from memguard_testing.mlx_tiny import TokenRows, build_model, schedule_optimizer, training_args

    from memguard_core.resume import checkpoint_step

    guard = memguard_mlx.MlxGuard(budget_bytes=a.budget_bytes, monitor_interval_s=0, grow=None)
    state = {"it": 0, "told": False, "seen": 0}
    first_done = checkpoint_step(a.resume) if a.resume else 0   # iterations a resume skips

    def batches(**kw):
        gen = iterate_batches(**kw)
        if not kw.get("loop"):
            yield from gen
            return
        for batch in gen:
            it = state["it"] = state["it"] + 1   # the iteration this batch is for (skipped ones included)
            if a.kill_at and it == a.kill_at + 1:
                die()   # the save of iteration kill_at is written
            if it > first_done:
                if not state["told"]:
                    state["told"] = True
                    out.start(guard.guard, it - 1, False)
                if a.split_at and it == a.split_at + 1:
                    guard.monitor.request_micro_batches(a.split_to, "test: memory pressure", it)
            yield batch

    class Record:
        def on_train_loss_report(self, info):   # every iteration (steps_per_report 1)
            rows = list(guard.micro_batch_rows)
            out.line("steps.jsonl", {"step": info["iteration"], "forwards": rows[state["seen"]:]})
            state["seen"] = len(rows)

        def on_val_loss_report(self, info):
            pass

    np.random.seed(0)
    args = training_args(a.out, "adapters", iters=a.steps, steps_per_save=1, grad_accumulation_steps=1,
                         steps_per_eval=10**6, val_batches=0)
    resume = False if a.resume is None else a.resume
    memguard_mlx.train(build_model(), schedule_optimizer(), TokenRows(), None, args=args, iterate_batches=batches,
                       training_callback=Record(), guard=guard, resume_from=resume)


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Out(a.out)
    if a.framework != "mlx":
        import torch

        torch.set_num_threads(1)
    {"hf": run_hf, "lightning": run_lightning, "mlx": run_mlx}[a.framework](a, out)
    out.line("done.jsonl", {"framework": a.framework})
    return 0


if __name__ == "__main__":
    sys.exit(main())
