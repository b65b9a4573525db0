"""A guarded HF ``Trainer`` run of a small ViT within the estimate's bounds (the image-classification
rules of memguard_core/estimator/image_blocks.py, docs/estimator.md "Image classification (ViT)").

In CI this file runs in the serial part (Makefile ``SERIAL``). The run's peak RSS moves from run to
run with glibc's heap: on one idle host, seven runs of the same script read -2.2 ... +2.7 % (one and
two torch threads), and fresh-clone CI runs read -5.0, -5.3 % (beside another worker) and -5.3 %
(serial, 2026-11-28). So the under bound here is 8 %, the spread beyond the issue's 5 %: a broken
image rule (the pixels, the patch tokens, the head) moves the estimate by more than that.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")


_GUARDED_RUN = r'''
import json, sys
import torch, transformers
from transformers import Trainer, TrainingArguments
from memguard_hf import MemGuardCallback
from memguard_bench.readings import peak_rss_bytes

method = sys.argv[1]
torch.manual_seed(0)
cfg = transformers.ViTConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_hidden_layers=4,
                             image_size=96, patch_size=16, num_labels=10, architectures=["ViTForImageClassification"])
model = transformers.AutoModelForImageClassification.from_config(cfg)
if method == "lora":
    import peft
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"],
                                                       modules_to_save=["classifier"]))
# the rows hold 160 px images: the guard reads the image side from pixel_values, not the config's 96
# (ViT interpolates its position embeddings when asked)
g = torch.Generator().manual_seed(1)
pixels, labels = torch.randn(96, 3, 160, 160, generator=g), torch.randint(0, 10, (96,), generator=g)

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        return {"pixel_values": pixels[i], "labels": labels[i], "interpolate_pos_encoding": True}

def collate(rows):
    return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]),
            "labels": torch.stack([r["labels"] for r in rows]), "interpolate_pos_encoding": True}

args = TrainingArguments(output_dir=sys.argv[2], per_device_train_batch_size=32, max_steps=3, use_cpu=True,
                         report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                         remove_unused_columns=False, dataloader_num_workers=0)
cb = MemGuardCallback(preflight_probe=False)
trainer = Trainer(model=model, args=args, train_dataset=Rows(), data_collator=collate, callbacks=[cb])
trainer.train()
pf = cb.guard.preflight
print(json.dumps(dict(estimate=pf.requested_peak_bytes, peak=peak_rss_bytes(), micro_batches=pf.micro_batches,
                      seq=pf.estimate.train_spec.seq_length, image=pf.model_spec.image_size)))
'''


def test_guarded_trainer_run_of_a_vit_within_bounds(tmp_path):
    """A guarded HF ``Trainer`` run (3 optimizer steps, CPU, full fine-tune in fp32, 32 images of
    160 px per micro-batch, the in-process measurement off so the rules are what is checked) of a
    small ViT on random pixels: the guard reads the image side from the rows (100 patches + CLS),
    keeps the requested micro-batch, and the process's peak RSS lies within the estimate's bounds
    (under by no more than 8 % here: the heap's run-to-run spread, module docstring; over by no more
    than 12 %). A fresh interpreter: the peak is the run's own. (LoRA is left out: its CPU heap slack is under-counted for every encoder,
    docs/benchmarks.md "Image classification (ViT)".)"""
    import json
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_GUARDED_RUN)
    r = subprocess.run([sys.executable, str(script), "full", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got["image"], got["seq"], got["micro_batches"]) == (160, 101, 1)
    err = got["estimate"] / got["peak"] - 1
    assert -0.08 <= err <= 0.12, got
