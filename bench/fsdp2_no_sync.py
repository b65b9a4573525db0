"""Why memguard reduce-scatters every micro-batch under FSDP2 (docs/torch_loop.md): the alternative,
``set_requires_gradient_sync(False)`` for the non-final micro-batches of a window, keeps every unit's
unsharded gradient until the window's last backward.

Two unguarded 2-rank FSDP2 runs of ``memguard_testing/scripts/torch_loop_worker.py`` on CPU (gloo,
one thread per rank; a Llama-shape model at hidden 1024, 4 micro-batches per batch, 1 step), each in
its own launch (a second run in the same ranks starts on what the first left): one reduce-scatters
every micro-batch's gradients (what memguard does), the other turns the gradient sync off for all
but the last micro-batch. glibc's mmap threshold is fixed at 64 KiB, so large blocks are mapped on
their own and unmapped when freed, and the resident peak (VmHWM growth over the training) follows
the live tensors. Prints, per rank, both growths and their difference against the model's unsharded
fp32 gradients; the premise holds where the no-sync run is higher by more than a quarter of them.

    python bench/fsdp2_no_sync.py [--hidden 1024]

(It was ``integration_tests/test_torch_loop.py::test_fsdp2_no_sync_holds_the_unsharded_gradients``
until 2026-11-29: a property of torch's FSDP2 that memguard's design rests on, not memguard's own
behaviour, measured here instead of in every CI run.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from memguard_testing import script, script_env  # noqa: E402
from memguard_testing.torchrun import launch  # noqa: E402

MiB = 2**20


def run(out: str, hidden: int, no_sync: bool) -> list:
    """One 2-rank launch; the ranks' results (``rank{r}.json``). Raises RuntimeError when the launch
    failed or hung."""
    env = script_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="1", TOKENIZERS_PARALLELISM="false",
                     MALLOC_MMAP_THRESHOLD_="65536")
    args = ["--out", out, "--mode", "fsdp", "--plain", "--hidden", str(hidden), "--chunks", "4", "--steps", "1"]
    rc, output = launch(script("torch_loop_worker.py"), *args, *(["--fsdp-no-sync"] if no_sync else []),
                        env=env, nproc=2, timeout=600)
    if rc != 0:
        raise RuntimeError(f"the launch {'hung' if rc is None else f'ended with {rc}'}:\n{output[-4000:]}")
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024, help="the model's hidden size (default 1024)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memguard_no_sync_") as tmp:
        print(f"[fsdp2_no_sync] reduce-scatter run (hidden {a.hidden})", flush=True)
        rs = run(os.path.join(tmp, "reduce_scatter"), a.hidden, False)
        print("[fsdp2_no_sync] no-sync run", flush=True)
        ns = run(os.path.join(tmp, "no_sync"), a.hidden, True)
    grads = ns[0]["param_bytes"]
    print(f"\nunsharded fp32 gradients: {grads / MiB:.1f} MiB\n")
    print("| rank | reduce-scatter growth MiB | no-sync growth MiB | difference MiB | difference / gradients |")
    print("|---|---|---|---|---|")
    holds = True
    for r, (x, y) in enumerate(zip(rs, ns)):
        diff = y["hwm_growth"] - x["hwm_growth"]
        holds = holds and diff > 0.25 * grads
        print(f"| {r} | {x['hwm_growth'] / MiB:.1f} | {y['hwm_growth'] / MiB:.1f} | {diff / MiB:.1f} | {diff / grads:.2f} |")
    print(f"\npremise {'holds' if holds else 'does NOT hold'}: the no-sync run is higher by more than a quarter "
          "of the unsharded gradients on every rank")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
