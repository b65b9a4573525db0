"""The Lightning adapter survives real out-of-memory errors in a backward: a Lightning full fine-tune
(SmolLM2-135M shape cut to 2 blocks, vocabulary 32768, fp32, AdamW, batch 8 x 256 tokens) in a child
process under an address-space limit (``RLIMIT_AS``, what ``prlimit --as`` sets), so torch's CPU
allocator really fails ("DefaultCPUAllocator: can't allocate memory"), in Lightning's own backward
of the unsplit batch. The unguarded twin dies there; the guarded run (only its OOM path acting: a
1 TiB budget, no preflight, the monitor's step sample off) zeroes the gradients, frees memory and
redoes the accumulation window at a doubled k, and finishes every step with the parameters of an
unlimited, unsplit run.

The limit is placed from the unlimited reference run of the same script on this machine (its VmPeak
after each phase): halfway between the peak of step 2's forward and that of its backward (AdamW's
states are held from step 1's update on; the guarded run allocates them before its first forward),
so the unsplit backward cannot fit and a split one can. The test checks the unguarded twin really
fails in a backward, so a placement that missed would fail the test rather than pass it. The
room between those two peaks comes from the backward's gradients and temporaries and the logits'
gradient; at vocabulary 16384 it was 70-94 MiB and, on a host loaded beyond the suite's two
workers, 36 MiB (below the 64 MiB asserted); at 32768 it is 93-126 MiB.

The window redo at chosen points (a backward OOM in a non-final micro-batch, in the second batch of
an accumulation window, again during a redo) runs on the tiny model with the allocator's error
raised from a backward hook: RLIMIT_AS cannot place a failure at a chosen backward call.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("lightning")

import memguard_testing  # noqa: E402
from memguard_testing.forkserver import run_script  # noqa: E402
from memguard_testing.train_scripts import alloc_fails_at  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS")

SCRIPT = memguard_testing.script("rlimit_lightning_run.py")
ALLOC_FAILED = "DefaultCPUAllocator: can't allocate memory"
SHAPE = ["--steps", "2", "--vocab", "32768", "--layers", "2", "--batch", "8"]


def _run(tmp_path, limit: int, mode: str, *extra: str) -> dict:
    out = tmp_path / f"{mode}-{limit}-{'-'.join(extra) or 'plain'}.json"
    env = memguard_testing.script_env(OMP_NUM_THREADS="2")
    proc = run_script(SCRIPT, str(limit), mode, str(out), *SHAPE, *extra, env=env, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _assert_same_params(run: dict, reference: dict) -> None:
    """``run``'s final parameters (``steps`` optimizer steps) equal ``reference``'s after as many."""
    ref, got = reference["step_params"][run["steps"] - 1], run["params"]
    assert ref.keys() == got.keys()
    worst = max(max(abs(a - b) for a, b in zip(ref[n], got[n])) for n in ref)
    assert worst < 1e-6, f"parameters differ from the unsplit run by {worst}"


def _peak(run: dict, phase: str, index: int) -> int:
    return [p for name, p in run["peaks"] if name == phase][index]


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """(reference run, limit): the unlimited unguarded unsplit run, and the limit halfway between
    step 2's forward and backward peaks."""
    reference = _run(tmp_path_factory.mktemp("ref"), 0, "none", "--accum", "1")
    assert reference["steps"] == 2, reference.get("error")
    fwd2 = _peak(reference, "forward", 1)    # step 2: AdamW's states held
    bwd2 = _peak(reference, "backward", 1)
    assert bwd2 - fwd2 > 64 * 2**20, reference["peaks"]  # room for a limit between them
    return reference, (fwd2 + bwd2) // 2


def test_backward_oom_redoes_the_window(tmp_path, placed):
    """Unguarded (the twin): step 1 fits, step 2 (AdamW's states held) dies in Lightning's backward
    of the unsplit batch. Guarded: the same backward fails (its states are allocated up front, so
    possibly already in step 1), the window is redone with 2 micro-batches per batch, both steps
    finish with the unlimited unsplit run's parameters. (Real failures under
    ``accumulate_grad_batches=2`` are the FSDP tests' (test_lightning_fsdp.py); a failure in a
    window's later batch, its kept batches redone too, at chosen backward calls is the tiny-model
    cases' below. The same run at accumulation 2 cost CI about a minute of wall time.)"""
    extra = ("--accum", "1")
    reference, limit = placed
    bare = _run(tmp_path, limit, "none", *extra)
    assert bare.get("failed") == "backward" and ALLOC_FAILED in bare["error"], bare
    guarded = _run(tmp_path, limit, "oom", *extra)
    assert "failed" not in guarded, guarded.get("error")
    assert guarded["steps"] == 2
    assert guarded["oom_retries"] >= 1                     # the OOM path acted
    assert guarded["micro_batches"] >= 2
    assert 8 in guarded["rows"] and 4 in guarded["rows"]   # unsplit, then redone in halves
    assert guarded["samples_per_step"] == [8] * 2          # samples per optimizer step kept
    _assert_same_params(guarded, reference)


def test_probe_reads_the_limit_and_prevents_the_failure(tmp_path, placed):
    """The same limit with the defaults (preflight on): the Linux probe reads RLIMIT_AS as the
    budget, the plan splits before the first forward and nothing fails; the parameters after
    step 1 are the unsplit run's."""
    reference, limit = placed
    guarded = _run(tmp_path, limit, "probe", "--steps", "1")  # the split comes before step 1
    assert "failed" not in guarded, guarded.get("error")
    assert guarded["steps"] == 1 and guarded["oom_retries"] == 0
    assert guarded["micro_batches"] > 1 and max(guarded["rows"]) < 8 and guarded["samples_per_step"] == [8]
    _assert_same_params(guarded, reference)


# --------------------------------------------------------------------- chosen failure points
def _alloc_fails_at(calls):
    """``alloc_fails_at`` on the first decoder block."""
    hook = alloc_fails_at(calls)
    return lambda m: m.model.model.layers[0].register_full_backward_hook(hook)


@pytest.fixture(scope="module")
def base_run():
    from memguard_testing.lightning_tiny import fit

    return fit(max_steps=4)


# (micro_batches at the start, failing backward calls, rows of every forward tried): accumulation
# 2 and 4 optimizer steps, so 8 batches of 8 rows; batches 0-1 are the first window.
# 1/[2]: Lightning's backward of batch 1 fails, batch 0 is redone from the kept reference;
# 2/[2]: the final chunk of batch 0 (Lightning's backward);
# 2/[3]: the first, memguard-run chunk of batch 1;
# 2/[4, 5]: batch 1's final chunk, then again the first backward of the redo (k 2 -> 4 -> 8).
CASES = [(1, [2], [8, 8] + [4] * 4 + [4] * 12),
         (2, [2], [4, 4] + [2] * 4 + [2] * 28),
         (2, [3], [4, 4, 4] + [2] * 8 + [2] * 24),
         (2, [4, 5], [4] * 4 + [2] + [1] * 16 + [1] * 48)]


@pytest.mark.parametrize("k0,fail_at,rows", CASES, ids=["lightning-backward-batch-1", "final-chunk",
                                                        "memguard-chunk-batch-1", "again-during-redo"])
def test_window_redo_at_chosen_points(base_run, k0, fail_at, rows):
    from memguard_lightning import MemGuardCallback
    from memguard_testing.lightning_tiny import fit, max_param_diff

    guard = MemGuardCallback(preflight=False, budget_bytes=2**40, monitor_interval_s=0, micro_batches=k0)
    trainer, module, rec = fit(guard=guard, max_steps=4, module_hook=_alloc_fails_at(fail_at))
    tb, mb, rb = base_run
    assert guard.oom_retries == len(fail_at)
    assert guard.micro_batch_rows == rows
    assert guard.samples_per_step == [16] * 4
    assert trainer.global_step == tb.global_step == 4
    assert rec.lrs == pytest.approx(rb.lrs, rel=1e-12)
    assert rec.returned_losses == pytest.approx(rb.returned_losses, rel=1e-5)
    assert rec.logged_losses == pytest.approx(rb.logged_losses, rel=1e-5)
    assert max_param_diff(mb, module) < 2e-5


def test_oom_in_a_single_row_backward_ends_with_the_plan():
    """Every backward fails: the window is redone down to one row per forward, gets one more redo
    after the free, then ends with ``WindowOOMError`` naming the plan instead of the allocator's
    bare error."""
    from memguard_core.errors import WindowOOMError
    from memguard_lightning import MemGuardCallback
    from memguard_testing.lightning_tiny import fit

    guard = MemGuardCallback(preflight=False, budget_bytes=2**40, monitor_interval_s=0)
    with pytest.raises(WindowOOMError) as err:
        fit(guard=guard, max_steps=2, module_hook=_alloc_fails_at(range(1, 10**6)))
    assert "out of memory in the backward" in str(err.value) and "A plan that would fit" in str(err.value)
    assert err.value.micro_batches == 8 and guard.oom_retries == 4   # k 1 -> 2 -> 4 -> 8, 8 once more


def test_adam_states_up_front_and_an_optimizer_step_oom_named():
    """AdamW's states exist before the first forward (the guard allocates them at its first
    batch), and the run's parameters are unchanged by it; an out-of-memory error raised inside the
    optimizer step after Lightning's closure (training_step and backward) completed (from the
    step's post-hook, as the allocator's error: no limit places a failure there on this model)
    ends in ``WindowOOMError`` for the optimizer step with the plan, not in a redo."""
    import lightning.pytorch as pl

    from memguard_core.errors import WindowOOMError
    from memguard_lightning import MemGuardCallback
    from memguard_testing.lightning_tiny import fit, max_param_diff

    seen = {}

    class States(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not seen:
                opt = trainer.optimizers[0]
                seen["states"] = sum(1 for p in pl_module.parameters() if "exp_avg_sq" in opt.state.get(p, {}))
                seen["params"] = sum(1 for p in pl_module.parameters() if p.requires_grad)

    guard = MemGuardCallback(preflight=False, budget_bytes=2**40, monitor_interval_s=0)
    _, module, _ = fit(guard=guard, max_steps=2, extra_callbacks=[States()])
    assert seen["states"] == seen["params"] > 0
    _, base, _ = fit(max_steps=2)
    assert max_param_diff(base, module) < 2e-5

    class FailStep(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            def post(optimizer, args, kwargs):
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                                   "allocate memory: you tried to allocate 268435456 bytes.")
            trainer.optimizers[0].register_step_post_hook(post)

    guard = MemGuardCallback(preflight=False, budget_bytes=2**40, monitor_interval_s=0)
    with pytest.raises(WindowOOMError) as err:
        fit(guard=guard, max_steps=2, extra_callbacks=[FailStep()])
    assert err.value.phase == "optimizer step" and "A plan that would fit" in str(err.value)
    assert guard.oom_retries == 0
