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
from importlib import resources

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from memguard_core.estimate import estimate
from memguard_core.preflight import budget_that_fits
from memguard_core.probes import probe
from memguard_core.report import console, estimate_table, gib, plan_table, probe_table
from memguard_core.spec import model_spec_from_module

from .callback import MemGuardCallback
from .preflight import trainspec_from_trainer

logger = logging.getLogger("memguard.demo")

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)
BYTE_OFFSET = 3


def corpus_text() -> str:
    return resources.files("memguard_hf").joinpath("data/demo_corpus.txt").read_text(encoding="utf-8")


class ByteRows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_length`` byte tokens over the shipped text."""

    def __init__(self, text: str, seq_length: int):
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        self.rows = [ids[i:i + seq_length] for i in range(0, len(ids) - seq_length + 1, seq_length)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = torch.tensor(self.rows[i])
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


class Squeeze(TrainerCallback):
    """Takes ``fraction`` of the guard's budget away at optimizer step ``at`` (simulated co-tenant)."""

    def __init__(self, guard: MemGuardCallback, at: int, fraction: float = 0.15):
        self.guard, self.at, self.fraction = guard, at, fraction

    def on_step_begin(self, args, state, control, **kw):
        mon = self.guard.monitor
        if self.at and state.global_step == self.at and mon is not None:
            old = mon.budget_bytes
            mon.budget_bytes = int(old * (1 - self.fraction))
            console().print(f"[yellow]demo: a co-tenant arrives at step {state.global_step}: the budget drops "
                            f"{gib(old)} -> {gib(mon.budget_bytes)}[/yellow]")


def build_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, lora)


def run_demo(args) -> int:
    """Run the demo; returns 0 when the run completed with the effective batch kept."""
    for name in ("transformers", "accelerate", "peft"):
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    con = console()
    con.rule("[bold]memguard demo: a guarded LoRA fine-tune (HF Trainer, CPU)")
    con.print(probe_table(probe("cpu")))

    t0 = time.time()
    model = build_model()
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    con.print(f"model: SmolLM2-135M architecture, random weights, LoRA r=16 on q/k/v/o: "
              f"{n_total / 1e6:.1f}M params, {n_train / 1e6:.2f}M trainable (built in {time.time() - t0:.1f}s)")
    data = ByteRows(corpus_text(), args.seq_length)
    out = args.output_dir or tempfile.mkdtemp(prefix="memguard_demo_")
    targs = TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=2e-4, warmup_steps=1, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=False)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    con.print(f"data: {len(data)} rows of {args.seq_length} byte tokens from the shipped text; requested "
              f"micro-batch {args.batch_size} x accumulation {args.grad_accum} = effective batch "
              f"{args.batch_size * args.grad_accum}, {args.steps} optimizer steps")

    ms = model_spec_from_module(model)
    ts = trainspec_from_trainer(trainer, ms, seq_length=args.seq_length, device="cpu")
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

    guard = MemGuardCallback(budget_bytes=budget, seq_length=args.seq_length, monitor_interval_s=0.2)
    trainer.add_callback(guard)
    trainer.add_callback(Squeeze(guard, args.squeeze_at))
    t1 = time.time()
    trainer.train()
    wall = time.time() - t1

    pf = guard.preflight
    if pf is not None and pf.plan.changes:
        con.print(plan_table(pf.plan))
    s = guard.summary
    eff = args.batch_size * args.grad_accum
    kept = all(n == eff for n in guard.samples_per_step) and trainer.state.global_step == args.steps
    from rich.table import Table

    t = Table(title="memguard demo: result")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("optimizer steps (requested / done)", f"{args.steps} / {trainer.state.global_step}")
    t.add_row("samples per optimizer step", ", ".join(str(n) for n in guard.samples_per_step))
    t.add_row("effective batch kept", "[green]yes[/green]" if kept else "[red]NO[/red]")
    sizes = sorted(set(guard.forward_rows))
    t.add_row("rows per forward seen", ", ".join(str(r) for r in sizes))
    t.add_row("final split k", str(s["split"]))
    t.add_row("runtime decisions", str(len(guard.events)))
    t.add_row("estimated peak, requested settings", gib(requested.peak_bytes))
    t.add_row("estimated peak, planned settings", gib(s["estimated_peak_bytes"]))
    t.add_row("measured peak (VmHWM, training steps)", gib(s["measured_peak_bytes"]))
    if s["estimated_peak_bytes"] and s["measured_peak_bytes"]:
        err = (s["estimated_peak_bytes"] - s["measured_peak_bytes"]) / s["measured_peak_bytes"]
        t.add_row("estimate error (planned vs measured)", f"{err:+.1%}")
    t.add_row("budget (start / end)", f"{gib(budget)} / {gib(guard.monitor.budget_bytes)}")
    t.add_row("training wall time", f"{wall:.0f} s")
    con.print(t)
    return 0 if kept else 1
