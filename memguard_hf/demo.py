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
from typing import Any, List, Sequence, Tuple

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from memguard_core.estimator.estimate import estimate
from memguard_core.probes import probe
from memguard_core.report import (console, demo_budget, demo_result_table, demo_rows, demo_squeeze, estimate_table,
                                  print_applied_plan, probe_table, yes_no)
from memguard_torch.module_spec import model_spec_from_module

from .callback import MemGuardCallback
from .preflight import trainspec_from_trainer

logger = logging.getLogger("memguard.demo")

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                    bos_token_id=1, eos_token_id=2, pad_token_id=2)


class ByteRows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_length`` byte tokens over the shipped text
    (``memguard_core.report.demo_rows``)."""

    def __init__(self, seq_length: int):
        self.rows = demo_rows(seq_length)

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
            demo_squeeze(mon, self.fraction, f"step {state.global_step}")


def build_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    return get_peft_model(model, lora)


def start(args, framework: str, quiet: Sequence[str] = ()) -> Tuple[Any, Any, ByteRows]:
    """What the torch demos (HF ``Trainer`` and Lightning) do first: quiet the ``quiet`` loggers, use
    every core, print the header and the CPU probe, build the model (:func:`build_model`) and the
    data (``args.seq_length`` byte tokens per row) and describe both. Returns (console, model, data)."""
    for name in quiet:
        logging.getLogger(name).setLevel(logging.WARNING)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    con = console()
    con.rule(f"[bold]memguard demo: a guarded LoRA fine-tune ({framework}, CPU)")
    con.print(probe_table(probe("cpu")))
    t0 = time.time()
    model = build_model()
    n_total = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    con.print(f"model: SmolLM2-135M architecture, random weights, LoRA r=16 on q/k/v/o: "
              f"{n_total / 1e6:.1f}M params, {n_train / 1e6:.2f}M trainable (built in {time.time() - t0:.1f}s)")
    data = ByteRows(args.seq_length)
    con.print(f"data: {len(data)} rows of {args.seq_length} byte tokens from the shipped text; requested "
              f"micro-batch {args.batch_size} x accumulation {args.grad_accum} = effective batch "
              f"{args.batch_size * args.grad_accum}, {args.steps} optimizer steps")
    return con, model, data


def requested_and_budget(args, model_spec, train_spec) -> Tuple[Any, int]:
    """Estimate the requested settings, choose the budget (``memguard_core.report.demo_budget``, with
    what this process holds counted) and print the estimate against it. Returns (the requested
    settings' ``MemoryEstimate``, the budget in bytes)."""
    requested = estimate(model_spec, train_spec)
    budget = demo_budget(model_spec, train_spec, args.budget_gib,
                         resident_bytes=probe("cpu", cheap=True).process_bytes)
    console().print(estimate_table(requested, budget, title="preflight: requested settings"))
    return requested, budget


def outcome(guard, args, steps_done: int) -> Tuple[bool, List[Tuple[str, str]]]:
    """Whether a torch demo kept the requested run (``args.steps`` optimizer steps, each of
    ``batch_size x grad_accum`` samples), and the result rows that show it."""
    eff = args.batch_size * args.grad_accum
    kept = bool(guard.samples_per_step) and all(n == eff for n in guard.samples_per_step) \
        and steps_done == args.steps
    rows = [("optimizer steps (requested / done)", f"{args.steps} / {steps_done}"),
            ("samples per optimizer step", ", ".join(str(n) for n in guard.samples_per_step)),
            ("effective batch kept", yes_no(kept)),
            ("rows per forward seen", ", ".join(str(r) for r in sorted(set(guard.micro_batch_rows)))),
            ("final split k", str((guard.summary or {}).get("split"))),
            ("runtime decisions", str(len(guard.events)))]
    return kept, rows


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
    ts = trainspec_from_trainer(trainer, ms, seq_length=args.seq_length, device="cpu")
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
