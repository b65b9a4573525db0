"""``memguard demo --framework lightning``: the main job of ``memguard demo`` with Lightning.

The same guarded LoRA fine-tune as :mod:`memguard_hf.demo` (SmolLM2-135M's architecture with random
weights, LoRA r=16 on q/k/v/o, the text shipped with memguard tokenised byte-wise; model and data
come from there), run by a ``lightning.pytorch.Trainer`` on CPU with ``MemGuardCallback`` under a
budget the requested micro-batch does not fit (the estimate of half the micro-batch, plus 5 %). The preflight plans and the callback applies the plan in place (the
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

from memguard_core.estimate import estimate
from memguard_core.preflight import budget_that_fits, method_and_lora
from memguard_core.probes import probe
from memguard_core.report import console, estimate_table, gib, plan_table, probe_table
from memguard_core.spec import TrainSpec, model_spec_from_module
from memguard_hf.demo import ByteRows, build_model, corpus_text

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
            old = mon.budget_bytes
            mon.budget_bytes = int(old * (1 - self.fraction))
            console().print(f"[yellow]demo: a co-tenant arrives at step {trainer.global_step}: the budget drops "
                            f"{gib(old)} -> {gib(mon.budget_bytes)}[/yellow]")


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def run_demo(args) -> int:
    """Run the Lightning demo; returns 0 when the run completed with the effective batch kept."""
    for name in ("transformers", "peft", "lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    con = console()
    con.rule("[bold]memguard demo: a guarded LoRA fine-tune (Lightning Trainer, CPU)")
    con.print(probe_table(probe("cpu")))

    t0 = time.time()
    pl.seed_everything(0, verbose=False)
    model = build_model()
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    con.print(f"model: SmolLM2-135M architecture, random weights, LoRA r=16 on q/k/v/o: "
              f"{n_total / 1e6:.1f}M params, {n_train / 1e6:.2f}M trainable (built in {time.time() - t0:.1f}s)")
    data = ByteRows(corpus_text(), args.seq_length)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True, collate_fn=_collate,
                                         generator=torch.Generator().manual_seed(0), num_workers=0)
    con.print(f"data: {len(data)} rows of {args.seq_length} byte tokens from the shipped text; requested "
              f"micro-batch {args.batch_size} x accumulation {args.grad_accum} = effective batch "
              f"{args.batch_size * args.grad_accum}, {args.steps} optimizer steps")

    ms = model_spec_from_module(model)
    method, lora = method_and_lora(model, ms)
    ts = TrainSpec(batch_size=args.batch_size, seq_length=args.seq_length, grad_accum=args.grad_accum,
                   method=method, optimizer="adamw", dtype="fp32", framework="lightning", device="cpu", **lora)
    requested = estimate(ms, ts)
    if args.budget_gib:
        budget = int(args.budget_gib * 2**30)
    else:
        half = ts.replace(batch_size=max(1, ts.batch_size // 2), grad_accum=ts.grad_accum * 2)
        budget = budget_that_fits(ms, half, resident_bytes=probe("cpu", cheap=True).process_bytes)
        con.print(f"budget: {gib(budget)} (chosen so the requested micro-batch does not fit: half of it, "
                  f"plus what this process already holds, fits below the guard's 85% warning "
                  f"level, which the preflight plans against)")
    con.print(estimate_table(requested, budget, title="preflight: requested settings"))

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

    pf = guard.preflight
    if pf is not None and pf.plan.changes:
        con.print(plan_table(pf.plan))
    s = guard.summary or {}
    eff = args.batch_size * args.grad_accum
    kept = bool(guard.samples_per_step) and all(n == eff for n in guard.samples_per_step) \
        and trainer.global_step == args.steps
    from rich.table import Table

    t = Table(title="memguard demo (Lightning): result")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("optimizer steps (requested / done)", f"{args.steps} / {trainer.global_step}")
    t.add_row("samples per optimizer step", ", ".join(str(n) for n in guard.samples_per_step))
    t.add_row("effective batch kept", "[green]yes[/green]" if kept else "[red]NO[/red]")
    t.add_row("rows per forward seen", ", ".join(str(r) for r in sorted(set(guard.forward_rows))))
    t.add_row("final split k", str(s.get("split")))
    t.add_row("runtime decisions", str(len(guard.events)))
    t.add_row("estimated peak, requested settings", gib(requested.peak_bytes))
    if s.get("estimated_peak_bytes"):
        t.add_row("estimated peak, planned settings", gib(s["estimated_peak_bytes"]))
    if s.get("measured_peak_bytes"):
        t.add_row("measured peak (VmHWM, training steps)", gib(s["measured_peak_bytes"]))
    if s.get("estimated_peak_bytes") and s.get("measured_peak_bytes"):
        err = (s["estimated_peak_bytes"] - s["measured_peak_bytes"]) / s["measured_peak_bytes"]
        t.add_row("estimate error (planned vs measured)", f"{err:+.1%}")
    t.add_row("budget (start / end)", f"{gib(budget)} / {gib(guard.monitor.budget_bytes)}")
    logged = sorted(k for k in trainer.logged_metrics if k.startswith("memguard/"))
    t.add_row("memguard figures in Lightning's logger", ", ".join(logged) or "none")
    t.add_row("metrics file", os.path.join(csv.log_dir, "metrics.csv"))
    t.add_row("training wall time", f"{wall:.0f} s")
    con.print(t)
    return 0 if kept else 1
