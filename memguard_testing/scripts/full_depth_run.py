"""One HF ``Trainer`` run of a full-depth published architecture (SmolLM2-135M: all 30 blocks,
random weights), LoRA r=16 on every linear, pure bf16 weights, micro-batch 4 x 512 tokens (2 x 128 on
a CPU without native bf16, where it is emulated), 1 step
(the preflight decides before it; one step holds the LoRA run's peak);
guarded by ``MemGuardCallback(budget_bytes=BUDGET)``, or by ``MemGuardCallback()`` with ``auto``
(the guard's own budget: what the process holds and what is still available, container-aware, so
inside a memory cgroup it comes from the cgroup's limit). Prints one JSON line: the process's peak
resident set over the run (the guard's own figure: its per-step VmHWM resets keep the largest
reading, ``memguard_core.process_peak``), what the preflight decided, the budget it planned against,
the estimate it compared with it and whether activation checkpointing was on.

usage: python full_depth_run.py BUDGET_BYTES|auto OUT_DIR
"""

import json
import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from memguard_core.process_peak import process_peak_rss_bytes
from memguard_hf import MemGuardCallback
from memguard_torch.train_reading import checkpointing_on
from memguard_testing import ROOT

ROWS, SEQ, BATCH, STEPS = 4, 512, 4, 1


def _native_bf16() -> bool:
    """The CPU computes bf16 matmuls natively (AVX512-BF16 or AMX); without, torch emulates them
    and one step of this 30-block model takes about 9 minutes instead of seconds."""
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))


DTYPE = torch.bfloat16
if not _native_bf16():
    # emulated bf16 costs ~9 minutes a step at 4 x 512: half the rows, a quarter of the tokens
    ROWS, SEQ, BATCH = 2, 128, 2


class Rows(torch.utils.data.Dataset):
    def __init__(self, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (ROWS, SEQ), generator=g)

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main() -> None:
    out = sys.argv[2]
    budget = None if sys.argv[1] == "auto" else int(sys.argv[1])
    if budget is not None and budget <= 0:
        raise SystemExit("full_depth_run.py: BUDGET_BYTES must be a positive number of bytes or 'auto'")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(os.path.join(ROOT, "tests", "configs", "smollm2-135m.json"))
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=STEPS,
                             learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(config.vocab_size))
    guard = MemGuardCallback() if budget is None else MemGuardCallback(budget_bytes=budget)
    trainer.add_callback(guard)
    trainer.train()
    pf = guard.preflight
    r = {"peak": process_peak_rss_bytes(), "global_step": trainer.state.global_step,
         "layers": config.num_hidden_layers, "rows": BATCH, "estimate": pf.estimate.peak_bytes,
         "requested_peak": pf.requested_peak_bytes, "plan_fraction": pf.plan_fraction,
         "budget": pf.budget_bytes, "checkpointing": checkpointing_on(model),
         "changes": [c.field for c in pf.plan.changes], "micro_batches": pf.micro_batches,
         "forward_rows": sorted(set(guard.micro_batch_rows)), "final_micro_batches": guard.monitor.micro_batches}
    print("RESULT " + json.dumps(r))


if __name__ == "__main__":
    main()
