"""A guarded tiny mlx_lm LoRA run as a child process, for the resume test: the tiny run of
``memguard_testing.mlx_tiny`` (numpy seeded 0 as ``mlx_lm.lora`` seeds it, 10 iterations,
accumulation 2, saves every 4) through ``memguard_mlx.train``, which resumes by itself when
``MEMGUARD_RESUME_FROM`` names an adapter save.

    python memguard_testing/scripts/mlx_resume_run.py OUT [--hang-at N]

Writes into ``OUT`` (the adapter directory): ``reports.jsonl``, one line per train / validation
report dict as the ``TrainingCallback`` receives it (flushed at once); ``--hang-at N``: at the
train report of iteration N the script writes ``OUT/hanging`` and sleeps (the caller kills it);
``result.json`` when ``train`` returned: the optimizer's ``step``, the guard's optimizer updates,
``resumed_from`` and the iterations reached.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--hang-at", type=int, default=0)
    a = p.parse_args(argv)

    import numpy as np

    import memguard_mlx
    from memguard_testing.mlx_tiny import TokenRows, build_model, schedule_optimizer, training_args

    reports = open(os.path.join(a.out, "reports.jsonl"), "a")

    class Callback:
        def on_train_loss_report(self, info):
            reports.write(json.dumps(dict(info, kind="train"), default=float) + "\n")
            reports.flush()
            if a.hang_at and info["iteration"] == a.hang_at:
                open(os.path.join(a.out, "hanging"), "w").close()
                time.sleep(600)

        def on_val_loss_report(self, info):
            reports.write(json.dumps(dict(info, kind="val"), default=float) + "\n")
            reports.flush()

    np.random.seed(0)  # iterate_batches shuffles with numpy's global generator (mlx_lm.lora seeds it)
    model = build_model("llama")
    opt = schedule_optimizer()
    args = training_args(os.path.dirname(a.out), os.path.basename(a.out))
    guard = memguard_mlx.train(model, opt, TokenRows(), TokenRows(16, seed=5), args=args,
                               training_callback=Callback(), budget_bytes=2**30, monitor_interval_s=0)
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump({"optimizer_step": int(opt.state["step"]), "updates": guard.optimizer_steps,
                   "resumed_from": guard.resumed_from, "iterations": guard.summary["iterations"]}, f)


if __name__ == "__main__":
    main()
