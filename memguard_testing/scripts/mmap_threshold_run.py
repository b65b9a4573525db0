"""Real HF ``Trainer`` fine-tunes on CPU under ``MemGuardCallback`` in one fresh process, and after
each, whether glibc's mmap threshold is fixed: a freed 16 MiB tensor raises glibc's dynamic
threshold to 16 MiB, so a 6 MiB tensor allocated next comes from the heap, unless the threshold
was fixed at 4 MiB (then it is mmapped: ``mallinfo2().hblkhd`` grows by its size).

usage: python mmap_threshold_run.py ORDER...   (ORDER: dense-bf16 | moe-fp32 | moe-bf16 | moe-bf16-off)

Runs are done in the order given (a fixed threshold cannot be undone in a process: give the run
that fixes it a process of its own). Prints one JSON line: per run, the bytes the 6 MiB
allocation added to glibc's mmapped total and the log lines that name the mmap threshold.
"""

import json
import logging
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Trainer, TrainingArguments

from memguard_core.probes.linux import heap
from memguard_hf import MemGuardCallback
from memguard_testing.hf_tiny import RowsDataset, pad_collate


def mmapped_bytes() -> int:
    fn = heap.libc().mallinfo2
    fn.restype, fn.argtypes = heap.Mallinfo2, []
    return int(fn().hblkhd)


def six_mib_mmapped() -> int:
    """Bytes a 6 MiB tensor adds to the mmapped total right after a 16 MiB tensor was freed."""
    big = torch.ones(16 << 20, dtype=torch.uint8)
    del big
    before = mmapped_bytes()
    small = torch.ones(6 << 20, dtype=torch.uint8)
    added = mmapped_bytes() - before
    del small
    return added


def model(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    if kind.startswith("moe"):
        cfg = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
        m = MixtralForCausalLM(cfg)
    else:
        m = LlamaForCausalLM(LlamaConfig(**common))
    return m.to(torch.bfloat16) if "bf16" in kind else m


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        if "mmap threshold" in record.getMessage():
            self.lines.append(record.getMessage())


def run(kind: str) -> dict:
    handler = Lines()
    logging.getLogger("memguard").addHandler(handler)
    logging.getLogger("memguard").setLevel(logging.INFO)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="mg-mmap-"), per_device_train_batch_size=4,
                             max_steps=2, learning_rate=1e-3, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, logging_strategy="no")
    guard = MemGuardCallback(budget_gib=16, monitor_interval_s=0, leak_detector=False,
                             trim_heap=not kind.endswith("-off"))
    trainer = Trainer(model=model(kind), args=args, train_dataset=RowsDataset(8), data_collator=pad_collate,
                      callbacks=[guard])
    trainer.train()
    logging.getLogger("memguard").removeHandler(handler)
    return {"kind": kind, "added": six_mib_mmapped(), "lines": handler.lines,
            "steps": trainer.state.global_step}


def main() -> None:
    print("RESULT " + json.dumps([run(kind) for kind in sys.argv[1:]]))


if __name__ == "__main__":
    main()
