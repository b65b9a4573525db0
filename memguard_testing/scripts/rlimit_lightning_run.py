"""One Lightning full fine-tune of the SmolLM2-135M shape cut to a few blocks (random fp32 weights,
a smaller vocabulary, AdamW, ``accumulate_grad_batches``), under a real address-space limit
(``RLIMIT_AS``, what ``prlimit --as`` / ``ulimit -v`` set) that the child sets on itself once the
model is built, so torch's CPU allocator really fails ("DefaultCPUAllocator: can't allocate memory").

usage: python rlimit_lightning_run.py LIMIT_BYTES MODE OUT_JSON [--steps N] [--accum A] [--batch B]
       [--layers L] [--vocab V] [--val-batch R] [--val-batches N] [--val-every N] [--eval-micro-batches K]

LIMIT_BYTES 0: no limit. MODE: ``none`` (unguarded), ``oom`` (guarded, only the OOM path acting:
budget 1 TiB, no preflight, no background thread, the monitor's step sample switched off so its
reading of the limit cannot split first), ``probe`` (guarded with the defaults, preflight included,
no background thread: the probe reads the limit as the budget). ``--val-batch R`` adds a validation
set of ``--val-batches`` (default 2) R-row batches, run every ``--val-every`` batches
(``val_check_interval``; default A: after every optimizer step) and logging ``val_loss``.

Writes OUT_JSON: the phase of the failure (``forward`` / ``backward`` / ``optimizer`` /
``validation``) and its message, or the steps done, a fingerprint of the final parameters (every
997th value of each), that fingerprint after each optimizer step (``step_params``, so a run of
fewer steps compares with a longer reference) and the validation losses (the epoch value after each
validation); the guard's retries, training micro-batch rows, samples per step and split, its
evaluation rows, retries and k_eval; and VmPeak after each phase (bytes, the test places its limits
from them).
"""

import argparse

import lightning.pytorch as pl
import torch

from memguard_testing.rlimit import PEAKS, PHASE, TokenRows, act_only_on_oom, run_limited, sampled_params, smollm2, vm_peak

ROWS, SEQ = 64, 256


class LM(pl.LightningModule):
    """HF's causal-LM loss (token mean over the batch); phases recorded for the failure report; with
    ``record_steps`` the parameter fingerprint after each optimizer step in ``step_params``."""

    def __init__(self, model, record_steps: bool = False):
        super().__init__()
        self.model = model
        self.record_steps = record_steps
        self.val_losses = []
        self.step_params = []

    def training_step(self, batch, batch_idx):
        PHASE["now"] = "forward"
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True)
        return loss

    def validation_step(self, batch, batch_idx):
        PHASE["now"] = "validation"
        loss = self.model(**batch).loss
        self.log("val_loss", loss, on_epoch=True)
        return loss

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        PEAKS.append(("validation", vm_peak()))

    def on_validation_epoch_end(self):
        v = self.trainer.callback_metrics.get("val_loss")
        if v is not None:
            self.val_losses.append(float(v))

    def on_before_backward(self, loss):
        PEAKS.append(("forward", vm_peak()))
        PHASE["now"] = "backward"

    def on_after_backward(self):
        PEAKS.append(("backward", vm_peak()))

    def on_before_optimizer_step(self, optimizer):
        PHASE["now"] = "optimizer"

    def on_train_batch_end(self, outputs, batch, batch_idx):
        PEAKS.append(("optimizer" if PHASE["now"] == "optimizer" else "batch", vm_peak()))
        if self.record_steps and PHASE["now"] == "optimizer":
            # after the peak reading, and in every run alike (limited or not), so the small lists
            # it keeps shift no run's placement against its reference
            self.step_params.append(sampled_params(self))
        PHASE["now"] = "other"

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("limit", type=int)
    ap.add_argument("mode", choices=("none", "oom", "probe"))
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--val-batch", type=int, default=0)
    ap.add_argument("--val-batches", type=int, default=2)
    ap.add_argument("--val-every", type=int, default=None)
    ap.add_argument("--eval-micro-batches", type=int, default=None)
    a = ap.parse_args()
    model = smollm2(a.layers, vocab_size=a.vocab)
    module = LM(model, record_steps=True)
    loader = torch.utils.data.DataLoader(TokenRows(a.vocab, ROWS, SEQ), batch_size=a.batch, shuffle=False)
    val = None
    if a.val_batch:
        val_rows = torch.utils.data.Subset(TokenRows(a.vocab, ROWS, SEQ, seed=1),
                                           range(a.val_batches * a.val_batch))
        val = torch.utils.data.DataLoader(val_rows, batch_size=a.val_batch, shuffle=False)
    callbacks = []
    guard = None
    if a.mode == "oom":
        from memguard_lightning import MemGuardCallback

        act_only_on_oom()
        kw = {} if a.eval_micro_batches is None else {"eval_micro_batches": a.eval_micro_batches}
        guard = MemGuardCallback(budget_bytes=2**40, preflight=False, monitor_interval_s=0, **kw)
        callbacks.append(guard)
    elif a.mode == "probe":
        from memguard_lightning import MemGuardCallback

        guard = MemGuardCallback(monitor_interval_s=0)
        callbacks.append(guard)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=a.steps, accumulate_grad_batches=a.accum,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks,
                         limit_val_batches=a.val_batches if val is not None else 0,
                         val_check_interval=(a.val_every or a.accum) if val is not None else None)
    def train(r):
        trainer.fit(module, loader, val)
        r["steps"] = trainer.global_step
        r["params"] = sampled_params(module)
        r["step_params"] = module.step_params
        r["val_losses"] = module.val_losses

    def finish(r):
        if guard is not None:
            r.update(oom_retries=guard.oom_retries, rows=[int(x) for x in guard.micro_batch_rows],
                     samples_per_step=guard.samples_per_step,
                     micro_batches=guard.monitor.micro_batches if guard.monitor is not None else None,
                     eval_rows=guard.evals.rows, eval_oom_retries=guard.evals.oom_retries,
                     eval_k=guard.evals.micro_batches)

    run_limited(a.limit, a.mode, a.out, train, finish)

if __name__ == "__main__":
    main()
