"""A real Lightning fit that ``memguard run`` can resume after an OOM kill (run inside a cgroup).

The model is the container scenarios' Llama from config numbers (``train_scripts.model_of``: vocab
``--vocab`` 16384, hidden ``--hidden`` 256, ``--layers`` blocks, random weights seeded 0) inside
a ``LightningModule``; AdamW at 1e-3 with a per-step linear LR decay (so a resume that lost the
scheduler state would show in the LR log). With micro-batch 16 x 256 tokens the fp32 logits
(16 x 256 x 16384 x 4 B = 256 MiB) and their cross-entropy temporaries dominate the peak.

    python memguard_testing/scripts/lightning_resume_run.py --default-root-dir ROOT [--steps 4]
        [--batch-size 16] [--seq-len 32] [--long-seq-len 256 --long-from-step 3] [--layers 2]

What makes it resumable, the way a user's script would do it:

* ``ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=True)`` with a ``CSVLogger``
  under ``ROOT``: every optimizer step writes ``ROOT/lightning_logs/version_<V>/checkpoints/
  epoch=0-step=<N>.ckpt`` and ``last.ckpt`` (each attempt gets a new version folder);
* ``trainer.fit(module, loader, ckpt_path=memguard_lightning.resume_checkpoint())``: the
  checkpoint ``memguard run`` names in ``MEMGUARD_RESUME_FROM`` (None on a first run);
* a stateful loader (``state_dict`` / ``load_state_dict``, Lightning's ``_Stateful`` protocol,
  which ``CombinedLoader`` saves into and restores from the checkpoint's ``loops`` state): a plain
  ``DataLoader`` restarts the epoch from its first batch after a mid-epoch resume; this one
  records the batches the finished optimizer steps consumed (``trainer.global_step``, one batch
  per step; not the loader's own count, which Lightning's one-batch prefetch runs ahead) and
  starts the resumed epoch after them. Rows are sequential, so the same rows come at the same
  steps on a resume.

``--long-seq-len S --long-from-step N``: the rows of optimizer steps >= N are S tokens long
instead of ``--seq-len``: a long batch arriving mid-run that no per-step guard can see coming.

The ``MemGuardCallback`` runs without its preflight and its background monitor thread
(``preflight=False, monitor_interval_s=0, grow=None``), so the micro-batches per batch are exactly
``MEMGUARD_MICRO_BATCHES`` (what the supervisor sets): the preflight would otherwise plan its own
split from the long rows it sees at the resumed attempt's first batch.

Files written into ``ROOT`` (what the tests read):

* ``steps.log``: one line per finished optimizer step, ``<pid> <global_step> <lr> <tokens per row>
  <rows of each forward...>``, appended (the attempts of one supervised run share it);
* ``attempts.jsonl``: one line per attempt at ``on_train_start``: pid, the step the fit starts at
  (the restored ``global_step``), ``ckpt_path``, ``MEMGUARD_MICRO_BATCHES``;
* ``result.json``: only when ``fit`` returned: global step, rows per step, the guard's
  micro-batch rows, the resumed checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from types import SimpleNamespace


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--default-root-dir", required=True, help="Trainer(default_root_dir=...), logs and checkpoints")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--long-seq-len", type=int, default=0)
    p.add_argument("--long-from-step", type=int, default=0)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from memguard_lightning import MemGuardCallback, resume_checkpoint
    from memguard_testing.train_scripts import model_of, vm_hwm_bytes, write_result

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(a.threads)
    root = a.default_root_dir
    os.makedirs(root, exist_ok=True)
    n_rows = a.batch_size * a.steps

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.rows = []
            for i in range(n_rows):
                long = a.long_seq_len and a.long_from_step and i // a.batch_size + 1 >= a.long_from_step
                length = a.long_seq_len if long else a.seq_len
                ids = torch.randint(1, a.vocab, (length,), generator=g)
                self.rows.append({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    class FromOffset(torch.utils.data.Sampler):
        """Sequential indices; the first iteration after a restore starts at ``start``."""

        def __init__(self, n: int):
            self.n, self.start = n, 0

        def __iter__(self):
            start, self.start = self.start, 0
            return iter(range(start, self.n))

        def __len__(self):
            return self.n  # the epoch's length: Lightning counts the restored batches in it

    class ResumableLoader(torch.utils.data.DataLoader):
        """A DataLoader with Lightning's ``_Stateful`` methods (see the module doc)."""

        batches_done = staticmethod(lambda: 0)

        def state_dict(self):
            return {"batches_done": int(self.batches_done())}

        def load_state_dict(self, state):
            self.sampler.start = int(state["batches_done"]) * self.batch_size

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model_of(SimpleNamespace(vocab=a.vocab, hidden=a.hidden, layers=a.layers),
                                  max_positions=max(a.seq_len, a.long_seq_len))

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=a.steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Record(pl.Callback):
        """What Lightning really ran: rows of each forward (a pre-hook on the model), the LR, the step."""

        def __init__(self):
            self.forwards, self.rows_per_step, self.lr, self.seq = [], [], None, 0

        def on_train_start(self, trainer, pl_module):
            def pre(mod, args, kw):
                self.forwards.append(int(kw["input_ids"].shape[0]))
                self.seq = int(kw["input_ids"].shape[1])
            pl_module.model.register_forward_pre_hook(pre, with_kwargs=True)
            with open(os.path.join(root, "attempts.jsonl"), "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "start_step": trainer.global_step, "ckpt_path": trainer.ckpt_path,
                                    "micro_batches": os.environ.get("MEMGUARD_MICRO_BATCHES")}) + "\n")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.forwards.clear()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.lr = optimizer.param_groups[0]["lr"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.rows_per_step.append(sum(self.forwards))
            with open(os.path.join(root, "steps.log"), "a") as f:
                f.write(f"{os.getpid()} {trainer.global_step} {self.lr:.6g} {self.seq} {' '.join(map(str, self.forwards))}\n")

    guard = MemGuardCallback(preflight=False, monitor_interval_s=0, grow=None)
    record = Record()
    ckpt = ModelCheckpoint(every_n_train_steps=1, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=1, default_root_dir=root,
                         logger=CSVLogger(root), callbacks=[guard, record, ckpt], enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1)
    loader = ResumableLoader(Rows(), batch_size=a.batch_size, sampler=FromOffset(n_rows),
                             collate_fn=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    ResumableLoader.batches_done = staticmethod(lambda: trainer.global_step)  # accumulate_grad_batches = 1
    resume = resume_checkpoint()
    print(f"lightning_resume_run: pid {os.getpid()} micro_batches_env={os.environ.get('MEMGUARD_MICRO_BATCHES')} "
          f"resume={resume}", flush=True)
    trainer.fit(LM(), loader, ckpt_path=resume)
    write_result(root, {"completed": True, "global_step": trainer.global_step, "max_steps": a.steps,
                        "rows_per_step": record.rows_per_step, "micro_batch_rows": list(guard.micro_batch_rows),
                        "resumed_from": resume, "vm_hwm_bytes": vm_hwm_bytes()})
    print(f"lightning_resume_run: done at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
