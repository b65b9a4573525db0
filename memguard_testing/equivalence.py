"""The split-equals-unsplit matrix: tiny real models of each kind people fine-tune, built from
config numbers with random weights and no dropout, a batch layout of each kind (rows of different
lengths, so equal chunk weights would be wrong), and the same training run three ways: the HF
``Trainer``, Lightning and a plain loop under ``TorchGuard``.

Every run: 16 rows, batch 8, 2 optimizer steps, SGD without clipping, the same initial weights and
order. ``integration_tests/test_split_equivalence.py`` compares a run cut into k micro-batches with
the unsplit one (final parameters and the logged loss).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import torch

VOCAB = 96
ROWS = 16
BATCH = 8
STEPS = 2
LR = 1e-2

KINDS = ("bert-seq-cls", "bert-token-cls", "t5", "bart", "whisper", "vit", "llama-padded", "llama-unpadded",
         "llama-packed")


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def build_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model of ``kind`` (one of :data:`KINDS`), weights from ``torch.manual_seed(seed)``."""
    import transformers as tf

    torch.manual_seed(seed)
    no_drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if kind in ("bert-seq-cls", "bert-token-cls"):
        cfg = tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64, num_labels=3 if kind == "bert-seq-cls"
                            else 5, classifier_dropout=0.0, **no_drop)
        cls = tf.BertForSequenceClassification if kind == "bert-seq-cls" else tf.BertForTokenClassification
        model = cls(cfg)
    elif kind == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
                          num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = tf.T5ForConditionalGeneration(cfg)
    elif kind == "bart":
        cfg = tf.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                            decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                            decoder_start_token_id=2, forced_eos_token_id=None)
        model = tf.BartForConditionalGeneration(cfg)
    elif kind == "whisper":
        cfg = tf.WhisperConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16, max_target_positions=32,
                               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2, decoder_start_token_id=0,
                               suppress_tokens=None, begin_suppress_tokens=None)
        model = tf.WhisperForConditionalGeneration(cfg)
    elif kind == "vit":
        cfg = tf.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=64, num_labels=3, **no_drop)
        model = tf.ViTForImageClassification(cfg)
    elif kind.startswith("llama"):
        from .hf_tiny import tiny_llama

        model = tiny_llama(seed)
        # no KV cache in training: with one, transformers skips its packed-sequence mask (masking_utils:
        # only "if position_ids is not None and attention_mask is None and cache is None"), and packed
        # rows attend across their boundaries; the Trainer and TRL turn the cache off alike
        model.config.use_cache = False
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    if hasattr(model.config, "_attn_implementation") and kind != "llama-packed":
        model.config._attn_implementation = "eager"
    return model


def rows(kind: str, n: int = ROWS, seed: int = 1) -> List[Dict[str, torch.Tensor]]:
    """``n`` training rows of ``kind``: token rows of 5..14 tokens, label rows of 2..9 tokens,
    ``-100`` on each decoder row's tail and on 1..3 leading positions of the token-level rows."""
    g = _seeded(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(5, 15, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g)
        row: Dict[str, torch.Tensor] = {}
        if kind == "vit":
            row = {"pixel_values": torch.randn(3, 16, 16, generator=g), "labels": torch.randint(0, 3, (), generator=g)}
        elif kind == "whisper":
            tgt = int(torch.randint(2, 10, (1,), generator=g))
            row = {"input_features": torch.randn(8, 32, generator=g),
                   "labels": torch.randint(3, VOCAB, (tgt,), generator=g)}
        elif kind in ("t5", "bart"):
            tgt = int(torch.randint(2, 10, (1,), generator=g))
            row = {"input_ids": ids, "labels": torch.randint(3, VOCAB, (tgt,), generator=g)}
        elif kind == "bert-seq-cls":
            row = {"input_ids": ids, "labels": torch.randint(0, 3, (), generator=g)}
        elif kind == "bert-token-cls":
            lab = torch.randint(0, 5, (length,), generator=g)
            lab[: int(torch.randint(1, 4, (1,), generator=g))] = -100
            row = {"input_ids": ids, "labels": lab}
        elif kind.startswith("llama"):
            if kind == "llama-unpadded":
                ids = ids[:5]
            lab = ids.clone()
            lab[: int(torch.randint(1, 4, (1,), generator=g))] = -100
            row = {"input_ids": ids, "labels": lab}
        else:
            raise ValueError(f"unknown kind {kind!r}")
        out.append(row)
    return out


_DECODER_START = {"t5": 0, "bart": 2, "whisper": 0}


def collate_for(kind: str) -> Callable[[Sequence[Dict[str, torch.Tensor]]], Dict[str, torch.Tensor]]:
    """The collator of ``kind``: right padding (pad id of the model, label -100, mask 0); Llama
    packed: every row after the other in one ``(1, T)`` row with ``position_ids`` restarting."""
    pad_id = {"bart": 1, "whisper": 1}.get(kind, 0)

    def pad(seqs, value):
        n = max(len(s) for s in seqs)
        out = torch.full((len(seqs), n), value, dtype=seqs[0].dtype)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = s
        return out

    def collate(batch):
        if kind == "llama-packed":
            ids = torch.cat([r["input_ids"] for r in batch])[None]
            labels = torch.cat([torch.cat([torch.tensor([-100]), r["labels"][1:]]) for r in batch])[None]
            pos = torch.cat([torch.arange(len(r["input_ids"])) for r in batch])[None]
            return {"input_ids": ids, "labels": labels, "position_ids": pos}
        out: Dict[str, torch.Tensor] = {}
        for key in batch[0]:
            vals = [r[key] for r in batch]
            if key == "input_ids":
                out[key] = pad(vals, pad_id)
                out["attention_mask"] = pad([torch.ones_like(v) for v in vals], 0)
            elif key == "labels" and vals[0].dim() == 1:
                out[key] = pad(vals, -100)
            else:
                out[key] = torch.stack(vals)
        if kind in _DECODER_START:
            # what DataCollatorForSeq2Seq adds from the model: the labels shifted right after the
            # decoder start token, -100 as the pad id (needed when the Trainer pops the labels,
            # as under label smoothing)
            lab = out["labels"]
            dec = torch.cat([torch.full((lab.shape[0], 1), _DECODER_START[kind]), lab[:, :-1]], 1)
            out["decoder_input_ids"] = dec.masked_fill(dec == -100, pad_id)
        return out

    return collate


class RowList(torch.utils.data.Dataset):
    """A list of row dicts as a map-style dataset."""

    def __init__(self, items: List[Dict[str, Any]]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return self.items[i]


def batches(kind: str) -> List[Dict[str, torch.Tensor]]:
    """The run's batches in order (no shuffle): ``ROWS / BATCH`` collated batches."""
    data, collate = rows(kind), collate_for(kind)
    return [collate(data[i: i + BATCH]) for i in range(0, ROWS, BATCH)]


def params(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The trainable parameters, detached copies."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def update_ratio(init: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], run: Dict[str, torch.Tensor]) -> float:
    """Size of ``run``'s update over the reference's: ``|run - init| / |ref - init|`` (2-norms over all
    parameters); 1.0 when the runs moved the weights equally far."""
    num = sum(float((run[n] - init[n]).pow(2).sum()) for n in init) ** 0.5
    den = sum(float((ref[n] - init[n]).pow(2).sum()) for n in init) ** 0.5
    return num / den


def max_rel_diff(ref: Dict[str, torch.Tensor], run: Dict[str, torch.Tensor], init: Dict[str, torch.Tensor]) -> float:
    """Largest parameter difference between two runs relative to the reference's largest update."""
    moved = max(float((ref[n] - init[n]).abs().max()) for n in init)
    return max(float((ref[n] - run[n]).abs().max()) for n in init) / moved


# ---------------------------------------------------------------------------------------------- runners
def run_hf(kind: str, out_dir: str, *, k: int = 1, trainer_kwargs=None, args_kwargs=None,
           trainer_cls=None, guard_kwargs=None) -> Dict[str, Any]:
    """One HF ``Trainer`` run of ``kind``; ``k`` > 1 under ``MemGuardCallback(micro_batches=k,
    **guard_kwargs)``.
    Returns ``{"params", "losses", "steps", "rows"}`` (``rows``: the guard's forward sizes)."""
    from transformers import Trainer, TrainingArguments

    from memguard_hf import MemGuardCallback

    model = build_model(kind)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=BATCH, max_steps=STEPS,
                             learning_rate=LR, optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant",
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                             disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
                             **(args_kwargs or {}))
    cls = trainer_cls or Trainer
    trainer = cls(model=model, args=args, train_dataset=RowList(rows(kind)), data_collator=collate_for(kind),
                  **(trainer_kwargs or {}))
    trainer._get_train_sampler = lambda *a, **kw: torch.utils.data.SequentialSampler(trainer.train_dataset)
    guard = None
    if k > 1:
        guard = MemGuardCallback(preflight=False, budget_bytes=64 * 2**30, monitor_interval_s=0, micro_batches=k,
                                 **(guard_kwargs or {}))
        trainer.add_callback(guard)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"params": params(trainer.model), "losses": losses, "steps": trainer.state.global_step,
            "rows": list(guard.micro_batch_rows) if guard is not None else None}


def run_torch(kind: str, *, k: int = 1) -> Dict[str, Any]:
    """The same run as a plain loop: ``loss = model(**batch).loss`` per micro-batch, under
    ``TorchGuard(micro_batches=k)`` when ``k`` > 1."""
    from memguard_torch import TorchGuard

    model = build_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    guard = None
    if k > 1:
        guard = TorchGuard(model=model, optimizer=opt, preflight=False, budget_bytes=64 * 2**30,
                           monitor_interval_s=0, micro_batches=k)
    losses = []
    model.train()
    for batch in batches(kind):
        total = 0.0
        if guard is None:
            loss = model(**batch).loss
            loss.backward()
            total = float(loss)
        else:
            for chunk, weight in guard.chunks(batch):
                with guard.micro_step():
                    loss = model(**chunk).loss * weight
                    loss.backward()
                    total += float(loss)
        opt.step()
        opt.zero_grad()
        if guard is not None:
            guard.step_end()
        losses.append(total)
    rows_seen = None
    if guard is not None:
        rows_seen = list(guard.guard.micro_batch_rows)
        guard.finish()
    return {"params": params(model), "losses": losses, "steps": len(losses), "rows": rows_seen}


def run_lightning(kind: str, out_dir: str, *, k: int = 1) -> Dict[str, Any]:
    """The same run under Lightning (``training_step`` returns ``model(**batch).loss``), under
    ``MemGuardCallback(micro_batches=k)`` when ``k`` > 1."""
    import lightning.pytorch as pl

    from memguard_lightning import MemGuardCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model(kind)
            self.losses: List[float] = []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.log("train_loss", loss, on_step=True, batch_size=BATCH)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    module = Module()
    loader = torch.utils.data.DataLoader(RowList(rows(kind)), batch_size=BATCH, shuffle=False,
                                         collate_fn=collate_for(kind))
    callbacks = []
    guard = None
    if k > 1:
        guard = MemGuardCallback(preflight=False, budget_bytes=64 * 2**30, monitor_interval_s=0, micro_batches=k)
        callbacks.append(guard)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=out_dir, gradient_clip_val=None)
    trainer.fit(module, loader)
    return {"params": params(module.model), "losses": module.losses,
            "steps": trainer.global_step,
            "rows": list(guard.guard.micro_batch_rows) if guard is not None else None}
