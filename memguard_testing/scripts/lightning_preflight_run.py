"""One guarded Lightning fit in a fresh process, for the Lightning preflight test: the model and data
of ``preflight_run.py`` (Llama, vocab 16384, hidden 256, 4 blocks, full fine-tune fp32 AdamW,
micro-batch 16 x seq 256) inside a ``LightningModule``. Prints one JSON line.

usage: python lightning_preflight_run.py BUDGET_BYTES OUT_DIR
"""

import json
import logging
import sys

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memguard_core.stats import process_file_resident_bytes
from memguard_lightning import MemGuardCallback
from memguard_testing.scripts.preflight_run import BATCH, STEPS, Rows

for _name in ("lightning", "lightning.pytorch", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=688,
                                                  num_hidden_layers=4, num_attention_heads=8,
                                                  num_key_value_heads=4, max_position_embeddings=512,
                                                  tie_word_embeddings=False))

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    budget, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(2)
    module = LM()
    guard = MemGuardCallback(budget_bytes=budget, monitor_interval_s=0.1)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, callbacks=[guard], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=out)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=BATCH, shuffle=False)
    trainer.fit(module, loader)
    pf = guard.preflight
    print("RESULT " + json.dumps({
        "micro_batches": pf.micro_batches, "grad_checkpoint": pf.plan.train_spec.grad_checkpoint,
        "requested_peak": pf.estimate.peak_bytes, "planned_peak": pf.best_peak_bytes,
        "measured_peak": guard.summary["measured_peak_bytes"], "final_micro_batches": guard.monitor.micro_batches,
        "global_step": trainer.global_step, "samples_per_step": guard.samples_per_step,
        "forward_rows": sorted(set(guard.micro_batch_rows)), "events": guard.events,
        "file_at_preflight": pf.plan.train_spec.resident_file_bytes, "file_at_end": process_file_resident_bytes(),
    }))


if __name__ == "__main__":
    main()
