"""One rank of a 2-rank gloo DDP run of ``rlimit_hf_eval_run.py``'s HF ``Trainer`` (2 optimizer steps,
an evaluation of one 16 x 256-token batch of a 49152-token vocabulary per rank after each), then a
``predict()`` of a small ragged set with its logits kept; for
``integration_tests/test_hf_eval_split.py::test_ddp_one_rank_eval_oom``.

usage: python -m torch.distributed.run --nproc_per_node=2 rlimit_hf_eval_ddp.py MODES OUT_DIR
       [LIMIT_RANK HEADROOM_BYTES]

MODES: one or more of these, comma-separated, run in that order by each rank in this one launch
(each on a freshly built model and ``Trainer`` over the same process group, the limit lifted after
each, so a test pays one launch instead of one per run): ``none`` (unguarded), ``ref`` (unguarded,
no limit on any rank), ``oom`` (guarded, only the OOM path acting, as in
``rlimit_hf_eval_run.py``); ``oom-k4``: guarded with ``eval_micro_batches = 4`` from the start (the
split's peak, for placing the limit). With LIMIT_RANK, that rank alone sets ``RLIMIT_AS`` to its
VmSize when the run's first evaluation starts plus HEADROOM_BYTES, so torch's CPU allocator really
fails in that rank's evaluation forward when it needs more, the other rank unlimited. A run that
fails ends the launch (exit 1), so an unguarded limited run goes last. One thread per rank;
``MEMGUARD_TEST_DUMP_AFTER_S`` (default 480) arms a faulthandler watchdog that dumps every thread
and exits, so a hang shows where each rank waits.

Each rank writes ``OUT_DIR/<MODE>-rank<R>.json`` per run: the failed phase and error, or the steps
done, every ``eval_loss``, the eval metrics, a fingerprint of the predictions, the guard's training
and evaluation micro-batch rows and retries, its limit, and VmSize at the first evaluation's start
and VmPeak after each phase (bytes, for finding limits; VmPeak is the process's, so only the first
run's readings are its own).
"""

import faulthandler
import gc
import json
import os
import resource
import sys

import torch

from memguard_testing.rlimit import PEAKS, PHASE, TokenRows, act_only_on_oom, mark, run_limited, sampled_params
from memguard_testing.scripts.rlimit_hf_eval_run import PhaseTrainer, build_trainer

PRED_ROWS, PRED_SEQ = 4, 32   # per rank; each rank's predict batch is filled up to the eval batch (even_batches)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


class LimitedTrainer(PhaseTrainer):
    """Sets the rank's address-space limit when its first evaluation starts (``limit`` bytes above
    its VmSize then; 0: none)."""

    headroom = 0
    limit = 0
    vm_at_eval = 0

    def evaluate(self, *args, **kwargs):
        if not self.vm_at_eval:
            self.vm_at_eval = _vm_size()
            if self.headroom:
                self.limit = self.vm_at_eval + self.headroom
                resource.setrlimit(resource.RLIMIT_AS, (self.limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        return super().evaluate(*args, **kwargs)


def run_one(mode: str, out_dir: str, rank: int, limit_rank: int, headroom: int) -> bool:
    """One run (module docstring) on a fresh model and ``Trainer``; writes its result and returns
    whether it failed."""
    PHASE["now"] = "setup"
    PEAKS.clear()
    trainer = build_trainer(out_dir, ranks=2, trainer_cls=LimitedTrainer, ddp_backend="gloo")
    torch.set_num_threads(1)   # smollm2() sets 2; one per rank on a shared machine
    if rank == limit_rank and mode != "ref":
        trainer.headroom = headroom
    guard = None
    if mode.startswith("oom"):
        from memguard_hf import MemGuardCallback

        act_only_on_oom()
        guard = MemGuardCallback.attach(trainer, budget_bytes=2**40, preflight=False, monitor_interval_s=0)
        if mode == "oom-k4":
            guard.eval_micro_batches = 4
    vocab = trainer.model.config.vocab_size

    def train(r):
        trainer.train()
        r["params"] = sampled_params(trainer.model)
        PHASE["now"] = "predict"
        pred = trainer.predict(TokenRows(vocab, PRED_ROWS * 2, PRED_SEQ, 2, ragged=True))
        mark("predict")
        logits = torch.from_numpy(pred.predictions)
        r.update(pred_shape=list(logits.shape), pred_tokens=logits.argmax(-1).flatten().tolist(),
                 pred_sample=logits.flatten()[::4999].tolist(), pred_labels=pred.label_ids.flatten().tolist(),
                 test_loss=pred.metrics["test_loss"])

    def finish(r):
        r.update(rank=rank, steps=trainer.state.global_step, limit=trainer.limit, vm_at_eval=trainer.vm_at_eval,
                 eval_losses=[h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
                 eval_metrics=[{k: v for k, v in h.items() if k.startswith("eval_") and "per_second" not in k
                                and "runtime" not in k} for h in trainer.state.log_history if "eval_loss" in h])
        if guard is not None:
            r.update(oom_retries=guard.oom_retries, rows=[int(x) for x in guard.micro_batch_rows],
                     eval_oom_retries=guard.eval_oom_retries, eval_rows=list(guard.eval_micro_batch_rows),
                     eval_micro_batches=guard.eval_micro_batches,
                     micro_batches=guard.monitor.micro_batches if guard.monitor is not None else None)

    out = os.path.join(out_dir, f"{mode}-rank{rank}.json")
    run_limited(0, mode, out, train, finish)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))   # the next run sets its own
    with open(out) as f:
        failed = "failed" in json.load(f)
    return failed


def main() -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("MEMGUARD_TEST_DUMP_AFTER_S", "480")), exit=True)
    modes, out_dir = sys.argv[1].split(","), sys.argv[2]
    limit_rank = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    headroom = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    rank = int(os.environ["RANK"])
    os.makedirs(out_dir, exist_ok=True)
    for mode in modes:
        if run_one(mode, out_dir, rank, limit_rank, headroom):
            sys.stdout.flush()
            os._exit(1)   # no interpreter teardown: the peer may be gone, and gloo's teardown would wait on it
        gc.collect()   # the run's model, optimizer states and frames, before the next run builds its own
    faulthandler.cancel_dump_traceback_later()
    torch.distributed.destroy_process_group()

if __name__ == "__main__":
    main()
