"""Tiny real HF fine-tunes for the integration tests: a Llama-architecture model (GQA) built from
config numbers with random weights, a dataset of variable-length rows with masked prompts (so rows
hold different numbers of valid labels and equal chunk weights would be wrong), and a callback
that switches the micro-batches per batch k at chosen points of the run, as the monitor would.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments)

VOCAB = 96


def llama(vocab: int, hidden: int, layers: int, max_positions: int, seed: int = 0) -> LlamaForCausalLM:
    """A Llama-architecture decoder from config numbers with random weights (``torch.manual_seed(seed)``
    first, so they are deterministic): ``vocab`` tokens, ``hidden`` wide, ``layers`` blocks, GQA with
    4 query / 2 KV heads, MLP 2 x hidden, untied head, pad id 0, SDPA attention, no dropout.
    Also the model of the container scenarios and of ``bench/`` (through ``bench/_common.py``)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """4-layer Llama with GQA (4 query heads, 2 KV heads), hidden 32; deterministic weights."""
    return llama(VOCAB, hidden=32, layers=4, max_positions=128, seed=seed)


class RowsDataset(torch.utils.data.Dataset):
    """``n`` rows of length 8..max_len; the first 1..3 tokens are a prompt with labels -100."""

    def __init__(self, n: int = 64, max_len: int = 24, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(8, max_len + 1, (1,), generator=g))
            ids = torch.randint(1, VOCAB, (length,), generator=g)
            prompt = int(torch.randint(1, 4, (1,), generator=g))
            labels = ids.clone()
            labels[:prompt] = -100
            self.rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        return self.rows[i]


def pad_collate(rows: Sequence[Dict[str, List[int]]]) -> Dict[str, torch.Tensor]:
    """Right-pad to the longest row: pad id 0, label -100, attention_mask 0."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    labels = torch.full((len(rows), n), -100, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        m = len(r["input_ids"])
        ids[i, :m] = torch.tensor(r["input_ids"])
        labels[i, :m] = torch.tensor(r["labels"])
        mask[i, :m] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def packed_collate(rows: Sequence[Dict[str, List[int]]]) -> Dict[str, torch.Tensor]:
    """Padding-free batch (as ``DataCollatorWithFlattening``): one row of all sequences, with
    ``position_ids`` restarting at 0 and the first label of each sequence masked."""
    ids, labels, pos = [], [], []
    for r in rows:
        ids += r["input_ids"]
        lab = list(r["labels"])
        lab[0] = -100
        labels += lab
        pos += list(range(len(r["input_ids"])))
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([pos])}


class SwitchSplit(TrainerCallback):
    """Requests micro-batches per batch at given points, through the guard's monitor (as pressure would).

    ``at_step``: {global_step: k} applied at ``on_step_begin``; ``at_substep``: {global_step: k}
    applied after the first micro-batch of that step's accumulation window (mid-window).
    ``ranks``: only these ranks request (others must follow through the all-reduce).
    """

    def __init__(self, guard, at_step: Optional[Dict[int, int]] = None,
                 at_substep: Optional[Dict[int, int]] = None, ranks: Optional[Sequence[int]] = None):
        self.guard = guard
        self.at_step = at_step or {}
        self.at_substep = at_substep or {}
        self.ranks = ranks
        self._done_sub = set()

    def _mine(self) -> bool:
        if self.ranks is None:
            return True
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return rank in self.ranks

    def _set(self, k: int) -> None:
        mon = self.guard.monitor
        mon._micro_batches = k  # a direct set: tests also need to go back down, which requests never do

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step in self.at_step and self._mine():
            self._set(self.at_step[state.global_step])

    def on_substep_end(self, args, state, control, **kw):
        s = state.global_step
        if s in self.at_substep and s not in self._done_sub and self._mine():
            self._done_sub.add(s)
            self._set(self.at_substep[s])


def make_trainer(out_dir: str, *, guard=None, extra_callbacks=(), mean_loss: bool = False,
                 grad_checkpoint: bool = False, batch_size: int = 8, grad_accum: int = 2,
                 max_steps: int = 6, collate=pad_collate, n_rows: int = 96, optim: str = "adamw_torch",
                 seed: int = 0, **args_kw) -> Trainer:
    """A real ``Trainer`` on CPU over ``RowsDataset``; linear LR schedule with warmup so the LR
    sequence is informative. ``mean_loss=True`` makes the model compute a per-forward mean loss
    (the path where chunk weights matter) by telling the Trainer it accepts no loss kwargs.
    ``args_kw``: further ``TrainingArguments`` fields (e.g. ``ddp_bucket_cap_mb``)."""
    args = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=batch_size, gradient_accumulation_steps=grad_accum,
        max_steps=max_steps, learning_rate=5e-3, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=seed, data_seed=seed,
        dataloader_num_workers=0, gradient_checkpointing=grad_checkpoint, optim=optim,
        max_grad_norm=1.0, disable_tqdm=True, ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        **args_kw,
    )
    model = tiny_llama(seed)
    callbacks = list(extra_callbacks)
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(n_rows), data_collator=collate,
                      callbacks=callbacks)
    if mean_loss:
        trainer.model_accepts_loss_kwargs = False
    if guard is not None:
        trainer.add_callback(guard)
    return trainer


def lr_sequence(trainer: Trainer) -> List[float]:
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


def loss_sequence(trainer: Trainer) -> List[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def params(trainer: Trainer) -> Dict[str, torch.Tensor]:
    m = trainer.model
    m = getattr(m, "module", m)
    return {n: p.detach().clone() for n, p in m.named_parameters()}
