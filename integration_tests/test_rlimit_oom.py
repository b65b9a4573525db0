"""Real out-of-memory errors, not injected ones: an HF full fine-tune (SmolLM2-135M shape cut to
12 blocks, fp32, AdamW, batch 8 x 256 tokens, 2 optimizer steps) in a child process under an
address-space limit (``RLIMIT_AS``, what ``prlimit --as`` sets), so torch's CPU allocator really
fails ("DefaultCPUAllocator: can't allocate memory"). Each limit places the unguarded twin's
failure in one phase; the guarded run (only its OOM path acting: a 1 TiB budget, no preflight, the
monitor's step sample off) must finish every step with the parameters of an unlimited, unsplit run.

Every limited run starts in a fresh child process, as a user's run would: a run after another in
the same process starts with what the first left mapped (~0.1 GB here, more than some limits leave
between a phase that must fit and the one that must fail). Only the unlimited reference shares a
process, after the probe test's run (the module fixture). The children are forked from a server
that imported the script's top level (``memguard_testing.forkserver``): a fresh process holding
what a fresh interpreter holds after the same imports, without paying them again.

The limits were found on this machine from the child's VmPeak after each phase (the script prints
them): forward of step 1 ~4.45-4.65 GB, its backward ~4.85-5.05 GB; step 2 (with AdamW's states)
forward ~5.3 GB, backward ~5.7 GB; with one row per batch the first optimizer step (states + the
foreach temporaries) ~3.6 GB above a ~3.1 GB backward. They carry the baseline address space of
torch's libraries and threads, which differs between machines.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from memguard_testing import ROOT
from memguard_testing.forkserver import run_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS")

SCRIPT = os.path.join(ROOT, "memguard_testing", "scripts", "rlimit_hf_run.py")
ALLOC_FAILED = "DefaultCPUAllocator: can't allocate memory"


def _run(tmp_path, *runs: str, **extra_env: str) -> dict:
    """The child with ``runs`` (``NAME=LIMIT,MODE,STEPS,BATCH``, in that order); its results by name."""
    out = tmp_path / f"{'-'.join(r.split('=')[0] for r in runs)}.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="2", **extra_env)
    proc = run_script(SCRIPT, str(out), *runs, env=env, timeout=900)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _bare_fails(tmp_path, limit: int, phase: str, steps: int = 2, batch: int = 8, **extra_env: str) -> None:
    """The unguarded twin fails with the allocator's error in ``phase``."""
    bare = _run(tmp_path, f"bare={limit},none,{steps},{batch}", **extra_env)["bare"]
    assert bare.get("failed") == phase and ALLOC_FAILED in bare["error"], bare.get("error")


def _guarded(tmp_path, limit: int, steps: int = 2, batch: int = 8, **extra_env: str) -> dict:
    return _run(tmp_path, f"guarded={limit},oom,{steps},{batch}", **extra_env)["guarded"]


@pytest.fixture(scope="module")
def probe_and_reference(tmp_path_factory):
    """The probe test's guarded run (the backward test's limit, default budget, one optimizer
    step), then the run without a limit, unguarded and unsplit, for two steps: the reference."""
    runs = _run(tmp_path_factory.mktemp("ref"), "probe=5500000000,probe,1,8", "ref=0,none,2,8")
    assert runs["ref"]["steps"] == 2, runs["ref"]
    return runs


@pytest.fixture
def reference(probe_and_reference):
    return probe_and_reference["ref"]


def _assert_same_params(run: dict, reference: dict, after_step: int = 2) -> None:
    ref = reference["params"] if after_step == 2 else reference["step_params"][after_step - 1]
    got = run["params"]
    assert ref.keys() == got.keys()
    worst = max(max(abs(a - b) for a, b in zip(ref[n], got[n])) for n in ref)
    assert worst < 1e-6, f"parameters differ from the unsplit run by {worst}"


def _assert_finished(run: dict, reference: dict, steps: int = 2) -> None:
    assert "failed" not in run, run.get("error")
    assert run["steps"] == steps
    assert run["oom_retries"] >= 1                # the OOM path acted, not something else
    assert run["samples_per_step"] == [8] * steps  # samples per optimizer step kept
    _assert_same_params(run, reference, steps)


def test_forward_oom_is_survived(tmp_path, reference):
    """Near the issue's limit (``prlimit --as=4400000000``): the first forward fails unguarded;
    guarded, the forward's rows are redone in smaller micro-batches (AdamW's states, allocated up
    front, make it need more of them), down to one row. The guarded run's peak lies within about
    0.1 GB of the unguarded forward's, less than glibc's per-thread arenas move the address space
    from run to run (each reserves 64 MiB of it), so both runs use one arena
    (``MALLOC_ARENA_MAX=1``) and the limit sits between them:
    unguarded forward ~4.30 GB (in about one run in three; the others peak ~0.2 GB higher), guarded
    ~4.21 GB. A child forked from the server (module docstring) starts ~8 MiB below a fresh
    interpreter and its unguarded forward peaked 16 MiB lower than a fresh one's low reading (4,101
    against 4,117 MiB), so the limit sits that much lower than where it was placed for fresh
    interpreters (4.28 GB), the same ~38 MiB under the unguarded peak. One optimizer step: the
    failure and the split are in step 1, and a second step at one row per micro-batch would prove
    nothing more."""
    limit = 4_260_000_000
    _bare_fails(tmp_path, limit, "forward", steps=1, MALLOC_ARENA_MAX="1")
    guarded = _guarded(tmp_path, limit, steps=1, MALLOC_ARENA_MAX="1")
    _assert_finished(guarded, reference, steps=1)
    assert min(guarded["rows"]) < 8


def test_backward_oom_redoes_the_window(tmp_path, reference):
    """Step 1 fits; step 2 (AdamW's states now held) fails in its backward unguarded, the failure
    memguard used to re-raise. Guarded: the window's gradients are zeroed, memory freed and the
    window redone with 2 micro-batches."""
    limit = 5_500_000_000
    _bare_fails(tmp_path, limit, "backward")
    guarded = _guarded(tmp_path, limit)
    _assert_finished(guarded, reference)
    assert 4 in guarded["rows"]


def test_optimizer_step_oom_ends_with_the_plan(tmp_path):
    """One row per batch: the first optimizer step (AdamW's lazy states plus its temporaries) is
    the peak and fails unguarded. No split can shrink it (parameters, gradients and states are the
    same at any k): guarded, the states are allocated before the first forward, the failure comes
    where the split acts, and at one row per forward the run ends with ``WindowOOMError`` naming
    the plan that would fit instead of the allocator's bare error."""
    limit = 3_400_000_000
    _bare_fails(tmp_path, limit, "optimizer", batch=1)
    guarded = _guarded(tmp_path, limit, batch=1)
    assert guarded["error"].startswith("WindowOOMError"), guarded["error"]
    assert "A plan that would fit" in guarded["error"] and "out of memory" in guarded["error"]


def test_probe_reads_the_limit_and_prevents_the_failure(probe_and_reference):
    """The backward test's limit with the default budget: the Linux probe reads RLIMIT_AS as the
    budget and the plan splits before any allocation fails. One optimizer step is enough: the guard
    allocates AdamW's states before the first forward, so its step 1 holds what the unguarded
    run's step 2 holds when its backward fails at this limit."""
    guarded, reference = probe_and_reference["probe"], probe_and_reference["ref"]
    assert "failed" not in guarded, guarded.get("error")
    assert guarded["steps"] == 1 and guarded["oom_retries"] == 0
    assert guarded["micro_batches"] > 1 and guarded["samples_per_step"] == [8]
    _assert_same_params(guarded, reference, after_step=1)
