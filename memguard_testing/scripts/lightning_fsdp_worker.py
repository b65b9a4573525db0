"""One rank of a 2-process gloo Lightning fit under FSDP, for integration_tests/test_lightning_fsdp.py:
``ModelParallelStrategy`` (FSDP2: the module's ``configure_model`` applies ``fully_shard`` to every
decoder block and the model over the ``data_parallel`` mesh dimension), or, with
``MEMGUARD_TEST_FSDP_VERSION=1``, ``FSDPStrategy`` (FSDP1: every decoder layer auto-wrapped, the
model wrapped at the root, full shard; Lightning's defaults otherwise, ``use_orig_params=True``
included; no gradient clipping, which ``FSDPPrecision`` refuses by norm).

usage: python -m torch.distributed.run --nproc_per_node=2 lightning_fsdp_worker.py MODE[+MODE...] OUT_DIR

(``plain+split``: both fits in the same ranks, one after the other.)

* ``plain``: unguarded, Lightning's own FSDP run (batch 4 per rank, accumulation 2, 4 steps,
  gradient clipping at norm 1 under FSDP2).
* ``split``: guarded (its preflight on with a 64 GiB budget: it changes nothing, and ``layout``
  records what it read); rank 0 alone asks for k=2 at batch 1 (mid window) and k=4 at batch 4.
* ``oom-ref``: unguarded, no limit, a wider model and rows up to 256 tokens (eager attention:
  activations dominate a rank's growth), batch 8 per rank, 3 steps, the loss logged with
  ``sync_dist=True``; records VmSize at train start, VmPeak at the end (the test places its limit
  from them) and the loss logged after each batch.
* ``oom:HEADROOM`` / ``oom-none:HEADROOM``: as ``oom-ref``, but rank 1 alone sets ``RLIMIT_AS`` to
  its VmSize at train start plus HEADROOM bytes, so torch's CPU allocator really fails there;
  guarded (the monitor's step sample off, so the OOM path is what acts) or unguarded.

Saves ``OUT_DIR/{mode}_rank{r}.pt`` (mode without its headroom): the full (all-gathered)
parameters, the forward sizes per batch, the LR per step, the global step, the gradient
reduce-scatters FSDP1 issued and, guarded, the guard's figures. ``MEMGUARD_TEST_DUMP_AFTER_S``: a
hang dumps every thread's stack and exits.
"""

import os
import resource
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from memguard_lightning import MemGuardCallback
from memguard_testing.hf_tiny import VOCAB, RowsDataset, llama, pad_collate
from memguard_testing.lightning_tiny import Recorder, SwitchSplit, TinyLM, make_loader, make_trainer
from memguard_testing.train_scripts import preflight_layout, proc_status_bytes


class ShardedLM(TinyLM):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class CpuFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU ranks: the thinnest stand-in for a GPU found. Lightning's
    accelerator connector refuses an ``FSDPStrategy`` on a non-CUDA accelerator
    (``_check_strategy_and_fallback`` tests ``type(strategy) is FSDPStrategy``; a subclass passes),
    and ``_setup_model`` passes ``device_id=root_device.index``, which is a GPU's index and None on
    CPU, where FSDP1 then refuses ("FSDP needs a non-CPU accelerator device"): here the wrap gets
    ``torch.device("cpu")`` instead, everything else is Lightning's and FSDP1's own."""

    def _setup_model(self, model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        init = FSDP.__init__

        def cpu_init(fsdp, *args, **kwargs):
            if kwargs.get("device_id") is None:
                kwargs["device_id"] = torch.device("cpu")
            init(fsdp, *args, **kwargs)

        FSDP.__init__ = cpu_init
        try:
            return super()._setup_model(model)
        finally:
            FSDP.__init__ = init


def _sync_logged(base):
    class SyncLoggedLM(base):
        """Logs its loss with ``sync_dist=True`` (an all-reduce on the default group at each log
        call): a rank that logged while a peer was stopped by an OOM would wait for it."""

        def training_step(self, batch, batch_idx):
            loss = self.compute_loss(batch)
            self.log("train_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
            return loss
    return SyncLoggedLM


def full_params(module, trainer) -> dict:
    """Every parameter whole: FSDP2's ``DTensor.full_tensor()`` (an all-gather on every rank), or
    FSDP1's ``summon_full_params`` of the root."""
    out = {}
    root = trainer.strategy.model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if isinstance(root, FSDP):
        with FSDP.summon_full_params(root, writeback=False):
            for name, p in root.named_parameters():
                out[name] = p.detach().clone()
        return out
    for name, p in module.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


class Limit(pl.Callback):
    """VmSize at train start (after ``configure_model`` sharded the model); rank 1's RLIMIT_AS."""

    def __init__(self, headroom: int):
        self.headroom = headroom
        self.base = None

    def on_train_start(self, trainer, pl_module):
        self.base = proc_status_bytes("VmSize")
        if self.headroom and trainer.global_rank == 1:
            # the soft limit only: an unprivileged process can raise it back to the hard one
            resource.setrlimit(resource.RLIMIT_AS, (self.base + self.headroom,
                                                    resource.getrlimit(resource.RLIMIT_AS)[1]))


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if os.environ.get("MEMGUARD_TEST_DUMP_AFTER_S"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["MEMGUARD_TEST_DUMP_AFTER_S"]), exit=True)
    # "plain+split": both fits in this process, one after the other (one process start and one
    # import of torch/Lightning for both; each fit seeds and builds its own module)
    for one in mode.split("+"):
        run(one, out)


def run(mode: str, out: str) -> None:
    """One fit as ``mode`` says (the module docstring); saves ``OUT/{kind}_rank{r}.pt``."""
    kind, _, headroom = mode.partition(":")
    long_rows = kind.startswith("oom")
    steps = 3 if long_rows else 4
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    guard = None
    rec = Recorder()
    cbs = [rec]
    if kind == "split":
        guard = MemGuardCallback(budget_bytes=64 * 2**30, monitor_interval_s=0)
        cbs = [guard, rec, SwitchSplit(guard, {1: 2, 4: 4}, ranks=[0])]
    elif kind == "oom":
        from memguard_core.monitor import Action, MemoryMonitor

        # the step sample would read the limit and split before the failure
        MemoryMonitor.step_sample = lambda self, step=None: Action.NONE
        guard = MemGuardCallback(preflight=False, budget_bytes=16 * 2**30, monitor_interval_s=0,
                                 leak_detector=False)
        cbs = [guard, rec]
    limit = Limit(int(headroom or 0))
    cbs.append(limit)
    fsdp1 = os.environ.get("MEMGUARD_TEST_FSDP_VERSION") == "1"
    base = TinyLM if fsdp1 else ShardedLM
    module = (_sync_logged(base) if long_rows else base)(total_steps=steps)
    loader = make_loader(batch_size=4)
    if long_rows:
        module.model = llama(VOCAB, hidden=64, layers=4, max_positions=256, seed=0)
        module.model.config._attn_implementation = "eager"
        g = torch.Generator().manual_seed(0)
        loader = torch.utils.data.DataLoader(RowsDataset(96, max_len=256), batch_size=8, shuffle=True, generator=g,
                                             collate_fn=pad_collate, num_workers=0)
    if fsdp1:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy = CpuFSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy="FULL_SHARD")
        extra = {"gradient_clip_val": None}   # FSDPPrecision refuses clipping by norm
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        extra = {}
    scatters = [0]
    if fsdp1:
        import torch.distributed as dist

        orig_scatter = dist.reduce_scatter_single

        def counting_scatter(*a, **kw):
            # an observation only: FSDP1 (and memguard's comm hook doing its default reduction)
            # looks the collective up here at each gradient reduction
            scatters[0] += 1
            return orig_scatter(*a, **kw)

        dist.reduce_scatter_single = counting_scatter
    trainer = make_trainer(callbacks=cbs, max_steps=steps, accumulate=2, devices=2, strategy=strategy, **extra)
    try:
        trainer.fit(module, loader)
    finally:
        if fsdp1:
            dist.reduce_scatter_single = orig_scatter   # the next fit in this process counts its own
    peak = proc_status_bytes("VmPeak")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    params = full_params(module, trainer)
    r = {"params": params, "batches": rec.batches, "lr": rec.lrs, "global_step": trainer.global_step,
         "base_vmsize": limit.base, "vmpeak": peak, "logged": rec.logged_losses, "reduce_scatters": scatters[0]}
    if guard is not None:
        r.update(split_disabled=guard.split_disabled_reason, samples_per_step=list(guard.samples_per_step),
                 layout=preflight_layout(guard.preflight, "fsdp_version"), oom_retries=guard.oom_retries,
                 oom_errors=list(guard.step.oom_errors), forward_rows=[int(x) for x in guard.micro_batch_rows])
    os.makedirs(out, exist_ok=True)
    torch.save(r, os.path.join(out, f"{kind}_rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
