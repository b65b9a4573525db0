"""One rank of a 2-process gloo Lightning fit under ``ModelParallelStrategy`` (FSDP2: the module's
``configure_model`` applies ``fully_shard`` to every decoder block and the model over the
``data_parallel`` mesh dimension), for integration_tests/test_lightning_fsdp2.py.

usage: python -m torch.distributed.run --nproc_per_node=2 lightning_fsdp2_worker.py plain|split OUT_DIR

* ``plain``: unguarded, Lightning's own FSDP2 run (batch 4 per rank, accumulation 2, 4 steps,
  gradient clipping at norm 1).
* ``split``: guarded (its preflight on with a 64 GiB budget: it changes nothing, and ``layout``
  records what it read); rank 0 alone asks for k=2 at batch 1 (mid window) and k=4 at batch 4.

Saves ``OUT_DIR/{mode}_rank{r}.pt``: the full (all-gathered) parameters, the forward sizes per
batch, the LR per step, the global step and, guarded, the guard's figures.
"""

import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from memguard_lightning import MemGuardCallback
from memguard_testing.lightning_tiny import Recorder, SwitchSplit, TinyLM, make_loader, make_trainer
from memguard_testing.train_scripts import preflight_layout


class ShardedLM(TinyLM):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def full_params(module) -> dict:
    """Every parameter whole (``DTensor.full_tensor()``: an all-gather on every rank)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    pl.seed_everything(0, verbose=False)
    guard = None
    rec = Recorder()
    cbs = [rec]
    if mode == "split":
        guard = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0)
        cbs = [guard, rec, SwitchSplit(guard, {1: 2, 4: 4}, ranks=[0])]
    module = ShardedLM(total_steps=4)
    trainer = make_trainer(callbacks=cbs, max_steps=4, accumulate=2, devices=2,
                           strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    trainer.fit(module, make_loader(batch_size=4))
    params = full_params(module)
    r = {"params": params, "batches": rec.batches, "lr": rec.lrs, "global_step": trainer.global_step}
    if guard is not None:
        r.update(split_disabled=guard.split_disabled_reason, samples_per_step=list(guard.samples_per_step),
                 layout=preflight_layout(guard.preflight, "fsdp_version"))
    os.makedirs(out, exist_ok=True)
    torch.save(r, os.path.join(out, f"{mode}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
