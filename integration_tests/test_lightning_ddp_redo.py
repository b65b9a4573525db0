"""The Lightning adapter under DDP (2 gloo ranks on CPU, one thread each): every micro-batch of an
accumulation window runs without DDP's gradient all-reduce and memguard averages the gradients once
both ranks agreed the window went through, so an out-of-memory error in a backward on one rank is
redone by both, with no hang (docs/lightning.md, "Under DDP").

* A real allocator failure: rank 1 alone gets an address-space limit (``RLIMIT_AS``) halfway
  between the VmPeak of step 2's forward and that of its backward in an unlimited, unguarded
  reference run of the same fit (SmolLM2-135M shape cut to 2 blocks, vocabulary 32768, fp32,
  AdamW, 8 x 256 tokens per rank), so the unsplit backward Lightning runs, the one DDP
  all-reduces in, cannot fit there. The guarded run (only its OOM path acting, nothing injected)
  meets the allocator's failure on rank 1 in a backward, redoes the window at 2 micro-batches on
  both ranks and ends with the reference's parameters; a placement that missed leaves it nothing
  to redo and fails the test. (No unguarded twin: this file runs in the serial part, where its
  launch cost half a minute of CI's wall time; a Lightning twin dying at such a limit is
  test_lightning_window_redo.py's.)
* Chosen failure points on the tiny model (an allocator error raised from a backward hook on rank 1
  alone: ``RLIMIT_AS`` cannot place a failure at a chosen backward): Lightning's own backward at
  the end of a window, a memguard-run chunk's backward mid-window, and again during the redo; and
  the split and unsplit guarded runs against Lightning's own DDP run.

Each launch is killed after its timeout (a hang), and each rank dumps its stacks before that
(``MEMGUARD_TEST_DUMP_AFTER_S``).
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import memguard_testing  # noqa: E402
from memguard_testing.torchrun import launch  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS, gloo")

SCRIPT = memguard_testing.script("lightning_ddp_worker.py")


def _launch(out, *modes: str, timeout: int = 900):
    """The worker on 2 ranks (``memguard_testing.torchrun``) with ``modes``; (return code, output).
    A launch still running after ``timeout`` seconds is killed with its ranks and fails the test."""
    env = memguard_testing.script_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="1",
                                      MEMGUARD_TEST_DUMP_AFTER_S=str(timeout - 60))
    rc, output = launch(SCRIPT, str(out), *modes, env=env, timeout=timeout)
    if rc is None:
        pytest.fail("the ranks hung:\n" + output[-6000:])
    return rc, output


def _load(out, mode: str):
    name = mode.replace(":", "_").replace(",", "_")
    return [torch.load(out / f"{name}_rank{r}.pt") for r in (0, 1)]


def _peak(run: dict, phase: str, index: int) -> int:
    return [p for name, p in run["peaks"] if name == phase][index]


def _sampled_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(max(abs(x - y) for x, y in zip(a[n], b[n])) for n in a)


def test_one_rank_real_oom_in_the_synchronised_backward_is_redone_by_both(tmp_path):
    rc, output = _launch(tmp_path, "rlimit-ref")
    assert rc == 0, output[-4000:]
    ref = _load(tmp_path, "rlimit-ref")
    assert all(r["steps"] == 2 for r in ref), output[-4000:]
    fwd2, bwd2 = _peak(ref[1], "forward", 1), _peak(ref[1], "backward", 1)   # step 2: AdamW's states held
    assert bwd2 - fwd2 > 64 * 2**20, ref[1]["peaks"]                          # room for a limit between them
    limit = (fwd2 + bwd2) // 2

    rc, output = _launch(tmp_path, f"rlimit-oom:{limit}")
    assert rc == 0, output[-4000:]
    guarded = _load(tmp_path, f"rlimit-oom:{limit}")
    assert guarded[0]["forward_rows"] == guarded[1]["forward_rows"]   # the ranks stayed in step
    for r, g in enumerate(guarded):
        assert "failed" not in g, g.get("error")
        assert g["steps"] == 2
        assert g["oom_retries"] == 1                        # rank 0 redid the window with rank 1
        assert g["micro_batches"] == 2
        # Unsplit, then the failed window again in halves and the rest in halves. Step 1 holds no
        # AdamW states yet, so its backward peak sits below step 2's by about their size: the limit
        # bites in step 1's backward, or where that peak stays just under it, in step 2's.
        assert g["forward_rows"] in ([8, 4, 4, 4, 4], [8, 8, 4, 4]), g["forward_rows"]
        assert g["samples_per_step"] == [8, 8]
        assert g["ddp_averages"] == 2                       # the gradients were averaged by memguard
        assert _sampled_diff(g["params"], ref[r]["params"]) < 1e-6
    assert any("out of memory in the backward" in m for m in guarded[1]["messages"]), guarded[1]["messages"]
    assert any("another rank ran out of memory" in m for m in guarded[0]["messages"]), guarded[0]["messages"]


# (mode, OOM retries, micro-batch rows of each forward on rank 0 and rank 1): accumulation 2, 4
# optimizer steps, 4 rows per rank and batch, so 8 batches; batches 0-1 are the first window.
# hook:1:2 : Lightning's backward of batch 1, the window's last (the one DDP would all-reduce in);
# hook:2:3 : the first, memguard-run chunk of batch 1 (rank 1's second chunk then runs its forward
#            without gradients, for its logged values);
# hook:2:4,5 : batch 1's final chunk, then again the first backward of rank 1's redo (rank 0 has
#            done its whole redo when the ranks agree; both redo again at the floor, 1 row).
CASES = [("hook:1:2", 1, [4, 4] + [2] * 4 + [2] * 12, None),
         ("hook:2:3", 1, [2] * 4 + [1] * 8 + [1] * 24, None),
         ("hook:2:4,5", 2, [2] * 4 + [1] * 8 + [1] * 8 + [1] * 24, [2] * 4 + [1] + [1] * 8 + [1] * 24)]


def test_chosen_backward_failures_on_one_rank_and_split_equals_unsplit(tmp_path):
    modes = ["plain", "base", "split"] + [c[0] for c in CASES]
    rc, output = _launch(tmp_path, *modes)
    assert rc == 0, output[-4000:]
    runs = {m: _load(tmp_path, m) for m in modes}
    plain = runs["plain"]

    def same_run(got, r):
        b = plain[r]
        assert got["global_step"] == b["global_step"] == 4
        assert got["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert got["samples_per_step"] == [8] * 4
        assert got["ddp_averages"] == 4
        assert got["returned_losses"] == pytest.approx(b["returned_losses"], rel=1e-5)
        assert got["logged_losses"] == pytest.approx(b["logged_losses"], rel=1e-5)
        worst = max((got["params"][n] - b["params"][n]).abs().max().item() for n in b["params"])
        assert worst < 2e-5

    for r in (0, 1):
        same_run(runs["base"][r], r)
        assert runs["base"][r]["forward_rows"] == [4] * 8
        same_run(runs["split"][r], r)
        assert runs["split"][r]["forward_rows"] == [4] + [2] * 6 + [1] * 16   # rank 1 followed rank 0
    for mode, retries, rows0, rows1 in CASES:
        for r in (0, 1):
            got = runs[mode][r]
            same_run(got, r)
            assert got["oom_retries"] == retries, (mode, r)
            assert got["forward_rows"] == (rows0 if r == 0 or rows1 is None else rows1), (mode, r)
        p0, p1 = runs[mode][0]["params"], runs[mode][1]["params"]
        assert max((p0[n] - p1[n]).abs().max().item() for n in p0) == 0.0   # the replicas stayed identical
