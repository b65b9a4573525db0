"""``memguard demo --framework lightning``: the main job of ``memguard demo`` with Lightning.

The same guarded LoRA fine-tune as :mod:`memguard_hf.demo` (SmolLM2-135M's architecture with random
weights, LoRA r=16 on q/k/v/o, the text shipped with memguard tokenised byte-wise; model and data
come from there), run by a ``lightning.pytorch.Trainer`` on CPU with ``MemGuardCallback`` under a
budget the requested micro-batch does not fit (half of it fits below the guard's warning level:
``memguard_core.report.demo_budget``). The preflight plans and the callback applies the plan in place (the
dataloader and ``accumulate_grad_batches`` are untouched); at ``--squeeze-at`` the demo takes 15 %
of the budget away, as a co-tenant would, and the runtime guard reacts. At the end: the estimate
vs the measured peak (VmHWM), the memguard figures Lightning's logger received, and the proof that
the effective batch and the step count were kept.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import lightning.pytorch as pl
import torch

from memguard_torch.train_reading import method_and_lora
from memguard_core.report import demo_result_table, demo_squeeze, print_applied_plan
from memguard_core.estimator.specs import TrainSpec
from memguard_torch.module_spec import model_spec_from_module
from memguard_torch.demo import outcome, requested_and_budget, start

from .callback import MemGuardCallback

logger = logging.getLogger("memguard.demo")


class LoRALM(pl.LightningModule):
    """A PEFT causal LM; loss = HF's causal-LM loss; AdamW 2e-4 with HF's linear schedule (1 warmup step)."""

    def __init__(self, model, steps: int, lr: float = 2e-4, warmup: int = 1):
        super().__init__()
        self.model = model
        self.steps, self.lr, self.warmup = steps, lr, warmup

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True, on_step=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)
        steps, warmup = self.steps, self.warmup

        def linear(step: int) -> float:  # transformers.get_linear_schedule_with_warmup
            if step < warmup:
                return step / max(1, warmup)
            return max(0.0, (steps - step) / max(1, steps - warmup))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Squeeze(pl.Callback):
    """Takes ``fraction`` of the guard's budget away at optimizer step ``at`` (simulated co-tenant)."""

    def __init__(self, guard: MemGuardCallback, at: int, fraction: float = 0.15):
        self.guard, self.at, self.fraction, self.done = guard, at, fraction, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mon = self.guard.monitor
        if self.at and not self.done and trainer.global_step == self.at and mon is not None:
            self.done = True
            demo_squeeze(mon, self.fraction, f"step {trainer.global_step}")


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def run_demo(args) -> int:
    """Run the Lightning demo; returns 0 when the run completed with the effective batch kept."""
    pl.seed_everything(0, verbose=False)
    con, model, data = start(args, "Lightning Trainer",
                             quiet=("transformers", "peft", "lightning", "lightning.pytorch", "lightning.fabric"))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=_collate,
                                         generator=torch.Generator().manual_seed(0), num_workers=0)
    ms = model_spec_from_module(model)
    method, lora = method_and_lora(model, ms)
    ts = TrainSpec(batch_size=args.batch_size, seq_length=args.seq_length, grad_accum=args.grad_accum,
                   method=method, optimizer="adamw", dtype="fp32", framework="lightning", device="cpu", **lora)
    requested, budget = requested_and_budget(args, ms, ts)

    out = args.output_dir or tempfile.mkdtemp(prefix="memguard_demo_lightning_")
    guard = MemGuardCallback(budget_bytes=budget, seq_length=args.seq_length, monitor_interval_s=0.2)
    csv = pl.loggers.CSVLogger(out, name="memguard_demo")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps,
                         accumulate_grad_batches=args.grad_accum, logger=csv, log_every_n_steps=1,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[guard, Squeeze(guard, args.squeeze_at)])
    module = LoRALM(model, args.steps)
    t1 = time.time()
    trainer.fit(module, loader)
    wall = time.time() - t1

    print_applied_plan(guard.preflight)
    kept, rows = outcome(guard, args, trainer.global_step)
    logged = sorted(k for k in trainer.logged_metrics if k.startswith("memguard/"))
    con.print(demo_result_table(
        "memguard demo (Lightning): result", rows, requested_peak_bytes=requested.peak_bytes,
        summary=guard.summary, measured="VmHWM, training steps", budget_bytes=budget,
        end_budget_bytes=guard.monitor.budget_bytes, wall_s=wall,
        extra_rows=[("memguard figures in Lightning's logger", ", ".join(logged) or "none"),
                    ("metrics file", os.path.join(csv.log_dir, "metrics.csv"))]))
    return 0 if kept else 1
