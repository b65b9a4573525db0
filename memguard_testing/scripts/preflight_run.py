"""One guarded HF ``Trainer`` run in a fresh process, for the preflight test.

A Llama-architecture model whose activations and logits dominate memory (vocab 16384, hidden 256,
4 blocks, full fine-tune in fp32 with AdamW), micro-batch 16 x seq 256 requested. The budget is
given in bytes on the command line. Prints one JSON line with what the guard planned and measured.

usage: python preflight_run.py BUDGET_BYTES OUT_DIR [--estimate-only]
"""

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from memguard_core.stats import process_file_resident_bytes
from memguard_hf import MemGuardCallback

ROWS, SEQ, BATCH, STEPS = 96, 256, 16, 3


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 16384, (ROWS, SEQ), generator=g)

    def __len__(self):
        return ROWS

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def main() -> None:
    budget, out = int(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                             max_steps=STEPS, learning_rate=1e-4, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    guard = MemGuardCallback(budget_bytes=budget, monitor_interval_s=0.1)
    trainer.add_callback(guard)
    trainer.train()
    pf = guard.preflight
    print("RESULT " + json.dumps({
        "micro_batches": pf.micro_batches, "grad_checkpoint": pf.plan.train_spec.grad_checkpoint,
        "requested_peak": pf.estimate.peak_bytes, "planned_peak": pf.best_peak_bytes,
        "changes": [c.field for c in pf.plan.changes],
        "measured_peak": guard.summary["measured_peak_bytes"], "final_micro_batches": guard.monitor.micro_batches,
        "global_step": trainer.state.global_step, "samples_per_step": guard.samples_per_step,
        "forward_rows": sorted(set(guard.micro_batch_rows)), "events": guard.events,
        "file_at_preflight": pf.plan.train_spec.resident_file_bytes, "file_at_end": process_file_resident_bytes(),
    }))


if __name__ == "__main__":
    main()
