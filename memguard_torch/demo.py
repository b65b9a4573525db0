"""What the torch demos (``memguard demo`` with HF ``Trainer`` and with Lightning) share: the model
(SmolLM2-135M's architecture, random weights, LoRA r=16 on q/k/v/o), the byte-token data shipped
with memguard, the opening (header, probe, model and data described), the estimate against the chosen
budget, and the result rows. The demos themselves: ``memguard_hf.demo``, ``memguard_lightning.demo``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, List, Sequence, Tuple

import torch

from memguard_core.estimator.estimate import estimate
from memguard_core.probes import probe
from memguard_core.report import console, demo_budget, demo_rows, estimate_table, probe_table, yes_no

__all__ = ["SMOLLM2_135M", "ByteRows", "build_model", "start", "requested_and_budget", "outcome"]

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


def build_model(seed: int = 0):
    """SmolLM2-135M's architecture (transformers ``LlamaForCausalLM``) with random weights and PEFT
    LoRA r=16 on q/k/v/o; ``seed`` seeds the weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

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
            ("final micro-batches per batch", str((guard.summary or {}).get("micro_batches"))),
            ("runtime decisions", str(len(guard.events)))]
    return kept, rows
