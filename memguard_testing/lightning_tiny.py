"""Tiny real Lightning fine-tunes for the integration tests: the 4-layer Llama of ``hf_tiny`` inside
a ``LightningModule`` (token-mean loss = HF's causal-LM loss; or a per-sample-mean loss), AdamW with
a per-step OneCycleLR (so the LR sequence is informative), the variable-length masked rows of
``hf_tiny`` (rows hold different numbers of valid labels, so equal chunk weights would be wrong),
a recorder of what Lightning really did (forward sizes from a forward pre-hook on the model, LR and
rows per optimizer step, the losses Lightning returned and logged), and a callback that switches the
guard's micro-batches per batch k at chosen batches, as the monitor would.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from memguard_testing.hf_tiny import RowsDataset, pad_collate, tiny_llama

for _name in ("lightning", "lightning.pytorch", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.ERROR)
os.environ.setdefault("PL_DISABLE_FORK", "1")


class TinyLM(pl.LightningModule):
    """``loss="tokens"``: HF's causal-LM loss (mean over valid shifted tokens of the batch);
    ``loss="samples"``: mean over rows of each row's mean token loss (per-sample mean)."""

    def __init__(self, loss: str = "tokens", lr: float = 5e-3, total_steps: int = 8, seed: int = 0,
                 manual: bool = False, guard=None):
        super().__init__()
        self.model = tiny_llama(seed)
        self.loss_kind = loss
        self.lr = lr
        self.total_steps = total_steps
        self.automatic_optimization = not manual
        self.guard = guard  # only for manual optimization (guard.chunks)

    def compute_loss(self, batch):
        if self.loss_kind == "tokens":
            return self.model(**batch).loss
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        tok = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels, ignore_index=-100, reduction="none")
        valid = labels.ne(-100)
        per_row = (tok * valid).sum(1) / valid.sum(1).clamp(min=1)
        return per_row.mean()

    def training_step(self, batch, batch_idx):
        if not self.automatic_optimization:
            opt = self.optimizers()
            sched = self.lr_schedulers()
            opt.zero_grad()
            total = 0.0
            for chunk, w in self.guard.chunks(batch):
                loss = self.compute_loss(chunk)
                self.manual_backward(loss * w)
                total += float(loss.detach()) * w
            self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            opt.step()
            sched.step()
            self.log("train_loss", total)
            return None
        loss = self.compute_loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("val_loss", loss)   # on_epoch: Lightning's batch-size-weighted mean over the epoch
        self.log("val_rows", float(batch["input_ids"].shape[0]), reduce_fx="sum")
        return loss

    def test_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("test_loss", loss)
        return {"loss": loss}

    def predict_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return {"logits": out.logits, "loss": self.compute_loss(batch)}

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.total_steps + 1,
                                                    pct_start=0.3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    """What really happened, independent of the guard's own bookkeeping."""

    def __init__(self):
        self.batches: List[List[int]] = []  # rows of each forward, grouped by batch
        self.lrs: List[float] = []  # LR at each optimizer step
        self.samples_per_step: List[int] = []
        self.returned_losses: List[float] = []  # loss Lightning got back from training_step
        self.logged_losses: List[float] = []  # train_loss_step as logged
        self.val_metrics: List[Dict[str, float]] = []  # val_loss and val_rows at each validation end
        self._rows = 0
        self._hooked = False

    def on_fit_start(self, trainer, pl_module):
        if not self._hooked:
            def pre(module, args, kwargs):
                ids = kwargs.get("input_ids", args[0] if args else None)
                if self.batches and torch.is_grad_enabled():  # training forwards, not evaluation's
                    self.batches[-1].append(int(ids.shape[0]))
            pl_module.model.register_forward_pre_hook(pre, with_kwargs=True)
            self._hooked = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([])

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if isinstance(outputs, dict) and "loss" in outputs:
            self.returned_losses.append(float(outputs["loss"]))
        v = trainer.callback_metrics.get("train_loss_step", trainer.callback_metrics.get("train_loss"))
        if v is not None:
            self.logged_losses.append(float(v))

    def on_validation_epoch_end(self, trainer, pl_module):
        m = trainer.callback_metrics
        self.val_metrics.append({k: float(m[k]) for k in ("val_loss", "val_rows") if k in m})

    @property
    def forward_rows(self) -> List[int]:
        return [r for b in self.batches for r in b]

    def rows_per_step(self, accumulate: int) -> List[int]:
        """Rows that went through a forward, per optimizer step (batches grouped by accumulation;
        a failed forward, re-done, is counted by the caller)."""
        return [sum(sum(b) for b in self.batches[i:i + accumulate])
                for i in range(0, len(self.batches) - accumulate + 1, accumulate)]


class SwitchSplit(pl.Callback):
    """Sets the guard's micro-batches per batch at given batches (counted over the whole fit), as memory pressure
    would; ``ranks``: only these ranks do (the others must follow through the all-reduce)."""

    def __init__(self, guard, at_batch: Dict[int, int], ranks: Optional[Sequence[int]] = None):
        self.guard = guard
        self.at_batch = at_batch
        self.ranks = ranks
        self.seen = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        n = self.seen
        self.seen += 1
        if n in self.at_batch and (self.ranks is None or trainer.global_rank in self.ranks):
            self.guard.monitor._micro_batches = self.at_batch[n]  # a direct set: tests also go back down


def make_loader(batch_size: int = 8, n_rows: int = 96, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(RowsDataset(n_rows), batch_size=batch_size, shuffle=True, generator=g,
                                       collate_fn=pad_collate, num_workers=0)


def make_val_loader(batch_size: int = 12, n_rows: int = 36, seed: int = 2):
    """Validation rows (another seed than training's), in order."""
    return torch.utils.data.DataLoader(RowsDataset(n_rows, seed=seed), batch_size=batch_size, shuffle=False,
                                       collate_fn=pad_collate, num_workers=0)


def make_trainer(*, callbacks=(), max_steps: int = 8, accumulate: int = 2, **kwargs) -> pl.Trainer:
    args = dict(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, gradient_clip_val=1.0,
                callbacks=list(callbacks))
    args.update(kwargs)
    return pl.Trainer(**args)


def fit(*, guard=None, switch: Optional[Dict[int, int]] = None, loss: str = "tokens", max_steps: int = 8,
        accumulate: int = 2, batch_size: int = 8, manual: bool = False, module_hook=None,
        extra_callbacks=(), val_loader=None, **trainer_kwargs):
    """One seeded fit; returns ``(trainer, module, recorder)``. ``guard`` comes first among the
    callbacks so that its monitor exists when ``SwitchSplit`` runs."""
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    module = TinyLM(loss=loss, total_steps=max_steps, manual=manual, guard=guard)
    if module_hook is not None:
        module_hook(module)
    rec = Recorder()
    cbs = ([guard] if guard is not None else []) + [rec]
    if switch:
        cbs.append(SwitchSplit(guard, switch))
    cbs += list(extra_callbacks)
    if manual:
        trainer_kwargs.setdefault("gradient_clip_val", None)  # Lightning refuses it under manual optimization
    trainer = make_trainer(callbacks=cbs, max_steps=max_steps, accumulate=accumulate, **trainer_kwargs)
    trainer.fit(module, make_loader(batch_size), val_loader)
    return trainer, module, rec


def params(module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def max_param_diff(a, b) -> float:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    return max((pa[n] - pb[n]).abs().max().item() for n in pa)
