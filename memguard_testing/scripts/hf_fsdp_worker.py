"""One rank of a 2-rank gloo HF ``Trainer`` run under FSDP2 (accelerate's ``fsdp_version: 2``,
``fully_shard`` per ``LlamaDecoderLayer`` and the root) or FSDP1 on CPU, for integration_tests/test_hf_fsdp.py.

usage: python -m torch.distributed.run --nproc_per_node=2 hf_fsdp_worker.py MODE[+MODE...] OUT_DIR

(``plain+split``: both runs in the same ranks, one after the other, in ``OUT_DIR/plain`` and
``OUT_DIR/split``.)

Modes:

* ``plain``: unguarded, HF's own FSDP2 run (the reference of ``split``).
* ``split``: guarded; rank 0 alone asks for k=2 at step 1 and k=4 after step 2's first batch
  (``memguard_testing.hf_tiny.SwitchSplit``), rank 1 follows through the all-reduce. Its preflight
  runs (a 16 GiB budget: it changes nothing) and ``layout`` records what it read of FSDP.
* ``oom-ref``: unguarded, no limit, longer rows (eager attention: activations dominate a rank's
  growth); records VmSize at train begin and VmPeak at the end (the test places its limit from them).
* ``oom:HEADROOM`` / ``oom-none:HEADROOM``: as ``oom-ref``, but rank 1 alone sets ``RLIMIT_AS`` to its
  VmSize at train begin plus HEADROOM bytes, so torch's CPU allocator really fails there; guarded
  (the monitor's step sample off, so the OOM path is what acts) or unguarded (the twin that dies).
* a ``1`` after any mode's name (``plain1``, ``split1``, ``oom-ref1``, ``oom1:HEADROOM``, ...): the
  same under FSDP1 (``fsdp_version: 1``, accelerate's ``FullyShardedDataParallel`` wrapping with
  ``use_orig_params``); ``reduce_scatters`` counts the gradient reduce-scatters FSDP1 issued.

The fakes (this machine has no GPU): accelerate 1.15 sets ``DistributedType.FSDP`` and keeps the
FSDP plugin only in ``AcceleratorState.__init__``'s branch for MULTI_GPU / NPU / XPU / ... devices
(``accelerate/state.py`` ~986-1013); a gloo CPU run is MULTI_CPU and loses the plugin, so the Trainer
would run plain DDP. :func:`fsdp_on_cpu` does after ``__init__`` what that branch does. Under FSDP1
it also sets the state's device to ``cpu``: accelerate's MULTI_CPU device is ``cpu:0``, which
FSDP1's init rejects against its compute device ``cpu`` (on a GPU both are ``cuda:<local rank>``).
Everything else is real: ``Trainer`` -> ``Accelerator.prepare`` -> ``fsdp2_prepare_model`` ->
``fully_shard`` (FSDP1: ``FullyShardedDataParallel`` with accelerate's auto-wrap) on CPU, gloo
all-gathers and reduce-scatters.

``MEMGUARD_TEST_DUMP_AFTER_S``: a hang dumps every thread's stack and exits (faulthandler).
"""

import json
import os
import resource
import sys

import accelerate.state as st
import torch
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback, TrainingArguments

from memguard_hf import MemGuardCallback
from memguard_testing.hf_tiny import VOCAB, RowsDataset, SwitchSplit, llama, lr_sequence, pad_collate
from memguard_testing.train_scripts import preflight_layout, proc_status_bytes


def fsdp_on_cpu() -> None:
    """Make accelerate keep the FSDP plugin on a MULTI_CPU (gloo) run, as its GPU branch does:
    ``distributed_type = FSDP``, the plugin's mixed precision set, ``fsdp_plugin`` kept."""
    orig = st.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        orig(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            if getattr(fsdp_plugin, "fsdp_version", 2) == 1:
                # accelerate's MULTI_CPU device is cpu:0 (set_device), which FSDP1's init rejects
                # against its own compute device "cpu" (torch fsdp/_init_utils.py _get_compute_device);
                # on a GPU both are cuda:<local rank>
                self.device = torch.device("cpu")

    st.AcceleratorState.__init__ = init


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if os.environ.get("MEMGUARD_TEST_DUMP_AFTER_S"):
        import faulthandler

        # a hang shows where each rank waits, and the rank exits (the test also has a timeout)
        faulthandler.dump_traceback_later(float(os.environ["MEMGUARD_TEST_DUMP_AFTER_S"]), exit=True)

    torch.set_num_threads(1)
    fsdp_on_cpu()
    # "plain+split": both runs in this process, one after the other (one process start and one
    # import of torch/transformers for both; each run builds its own seeded model and Trainer)
    modes = mode.split("+")
    for one in modes:
        run(one, os.path.join(out, one.partition(":")[0]) if len(modes) > 1 else out)
        torch.distributed.barrier()
    # leave without tearing the gloo group down: its teardown can abort the process after every
    # result is written
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(mode: str, out: str) -> None:
    """One ``Trainer`` run as ``mode`` says (the module docstring); writes ``params{rank}.pt`` and
    ``rank{rank}.json`` in ``out`` (``OUT_DIR/<mode>`` when several modes share the launch)."""
    kind, _, headroom = mode.partition(":")
    version = 1 if kind.endswith("1") else 2
    kind = kind.rstrip("1")
    rank = int(os.environ["RANK"])
    long_rows = kind.startswith("oom")
    guarded = kind in ("split", "oom")
    seq = 256 if long_rows else 24
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        max_steps=3 if long_rows else 4, learning_rate=5e-3, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, max_grad_norm=1.0, disable_tqdm=True, ddp_backend="gloo",
        fsdp=True, fsdp_config={"fsdp_version": version, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                "reshard_after_forward": True if version == 2 else "FULL_SHARD",
                                # FSDP1's default broadcast from rank 0 asks for an accelerator device
                                # (both ranks build the same seeded weights)
                                **({} if version == 2 else {"sync_module_states": False})})
    model = llama(VOCAB, hidden=64 if long_rows else 32, layers=4, max_positions=seq, seed=0)
    model.config._attn_implementation = "eager" if long_rows else "sdpa"
    callbacks = []
    guard = None
    if guarded:
        if kind == "oom":
            from memguard_core.monitor import Action, MemoryMonitor

            # the step sample would read the limit and split before the failure
            MemoryMonitor.step_sample = lambda self, step=None: Action.NONE
        guard = MemGuardCallback(preflight=kind == "split", budget_bytes=16 * 2**30, monitor_interval_s=0,
                                 leak_detector=False)
        callbacks.append(guard)
        if kind == "split":
            callbacks.append(SwitchSplit(guard, at_step={1: 2}, at_substep={2: 4}, ranks=[0]))
    vm = {}

    class Limit(TrainerCallback):
        """VmSize at train begin (after FSDP sharded the model); rank 1's RLIMIT_AS in ``oom`` modes."""

        def on_train_begin(self, *a, **kw):
            vm["base"] = proc_status_bytes("VmSize")
            if headroom and rank == 1:
                # the soft limit only: an unprivileged process can raise it back to the hard one
                resource.setrlimit(resource.RLIMIT_AS, (vm["base"] + int(headroom),
                                                        resource.getrlimit(resource.RLIMIT_AS)[1]))

    callbacks.append(Limit())
    scatters = [0]
    if version == 1:
        import torch.distributed as dist

        orig_scatter = dist.reduce_scatter_single

        def counting_scatter(*a, **kw):
            # an observation only: FSDP1 looks the collective up here at each gradient reduction
            # (torch fsdp/_runtime_utils.py _reduce_grad, without a comm hook)
            scatters[0] += 1
            return orig_scatter(*a, **kw)

        dist.reduce_scatter_single = counting_scatter
    trainer = Trainer(model=model, args=args, train_dataset=RowsDataset(96, max_len=seq), data_collator=pad_collate,
                      callbacks=callbacks)
    assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2 == (version == 2)
    try:
        trainer.train()
    finally:
        if version == 1:
            dist.reduce_scatter_single = orig_scatter   # the next run in this process counts its own
    peak = proc_status_bytes("VmPeak")
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    full = {}
    if version == 1:
        assert isinstance(trainer.model, FullyShardedDataParallel)
        with FullyShardedDataParallel.summon_full_params(trainer.model):   # an all-gather on every rank
            full = {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for name, p in trainer.model.named_parameters()}
    else:
        assert isinstance(trainer.model, FSDPModule)
        for name, p in trainer.model.named_parameters():   # full_tensor(): an all-gather on every rank
            t = p.detach()
            full[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    os.makedirs(out, exist_ok=True)
    torch.save(full, os.path.join(out, f"params{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"global_step": trainer.state.global_step, "lr": lr_sequence(trainer),
                   "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "base_vmsize": vm.get("base"), "vmpeak": peak,
                   "forward_rows": [int(r) for r in guard.micro_batch_rows] if guard else [],
                   "samples_per_step": guard.samples_per_step if guard else [],
                   "oom_retries": guard.oom_retries if guard else 0, "reduce_scatters": scatters[0],
                   "oom_errors": guard.oom_errors if guard else [],
                   "layout": preflight_layout(guard.preflight if guard else None, "fsdp_version", "offload")}, f)


if __name__ == "__main__":
    main()
