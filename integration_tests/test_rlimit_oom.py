"""Real out-of-memory errors, not injected ones: an HF full fine-tune (SmolLM2-135M shape cut to
12 blocks, fp32, AdamW, batch 8 x 256 tokens, 2 optimizer steps) in a child process under an
address-space limit (``RLIMIT_AS``, what ``prlimit --as`` sets), so torch's CPU allocator really
fails ("DefaultCPUAllocator: can't allocate memory"). Each limit places the unguarded twin's
failure in one phase; the guarded run (only its OOM path acting: a 1 TiB budget, no preflight, the
monitor's step sample off) must finish every step with the parameters of an unlimited, unsplit run.

The limits were found on this machine from the child's VmPeak after each phase (the script prints
them): forward of step 1 ~4.45-4.65 GB, its backward ~4.85-5.05 GB; step 2 (with AdamW's states)
forward ~5.3 GB, backward ~5.7 GB; with one row per batch the first optimizer step (states + the
foreach temporaries) ~3.6 GB above a ~3.1 GB backward. They carry the baseline address space of
torch's libraries and threads, which differs between machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memguard_testing import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux RLIMIT_AS")

SCRIPT = os.path.join(ROOT, "memguard_testing", "scripts", "rlimit_hf_run.py")
ALLOC_FAILED = "DefaultCPUAllocator: can't allocate memory"


def _run(tmp_path, limit: int, mode: str, batch: int = 8, **extra_env: str) -> dict:
    out = tmp_path / f"{mode}-{limit}-{batch}.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="2", **extra_env)
    proc = subprocess.run([sys.executable, SCRIPT, str(limit), mode, str(out), "2", "1", str(batch)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run without a limit, unguarded and unsplit."""
    r = _run(tmp_path_factory.mktemp("ref"), 0, "none")
    assert r["steps"] == 2, r
    return r


def _assert_same_params(run: dict, reference: dict) -> None:
    ref, got = reference["params"], run["params"]
    assert ref.keys() == got.keys()
    worst = max(max(abs(a - b) for a, b in zip(ref[n], got[n])) for n in ref)
    assert worst < 1e-6, f"parameters differ from the unsplit run by {worst}"


def _assert_finished(run: dict, reference: dict) -> None:
    assert "failed" not in run, run.get("error")
    assert run["steps"] == 2
    assert run["oom_retries"] >= 1           # the OOM path acted, not something else
    assert run["samples_per_step"] == [8, 8]  # samples per optimizer step kept
    _assert_same_params(run, reference)


def test_forward_oom_is_survived(tmp_path, reference):
    """Near the issue's limit (``prlimit --as=4400000000``): the first forward fails unguarded;
    guarded, the forward's rows are redone in smaller micro-batches (AdamW's states, allocated up
    front, make it need more of them), down to one row. The guarded run's peak lies within about
    0.1 GB of the unguarded forward's, less than glibc's per-thread arenas move the address space
    from run to run (each reserves 64 MiB of it), so both runs use one arena
    (``MALLOC_ARENA_MAX=1``: the peaks then repeat within a few MB) and the limit sits between them:
    unguarded forward ~4.32 GB, guarded ~4.21 GB."""
    limit = 4_280_000_000
    bare = _run(tmp_path, limit, "none", MALLOC_ARENA_MAX="1")
    assert bare.get("failed") == "forward" and ALLOC_FAILED in bare["error"], bare.get("error")
    guarded = _run(tmp_path, limit, "oom", MALLOC_ARENA_MAX="1")
    _assert_finished(guarded, reference)
    assert min(guarded["rows"]) < 8


def test_backward_oom_redoes_the_window(tmp_path, reference):
    """Step 1 fits; step 2 (AdamW's states now held) fails in its backward unguarded, the failure
    memguard used to re-raise. Guarded: the window's gradients are zeroed, memory freed and the
    window redone with 2 micro-batches."""
    limit = 5_500_000_000
    bare = _run(tmp_path, limit, "none")
    assert bare.get("failed") == "backward" and ALLOC_FAILED in bare["error"], bare.get("error")
    guarded = _run(tmp_path, limit, "oom")
    _assert_finished(guarded, reference)
    assert 4 in guarded["rows"]


def test_optimizer_step_oom_ends_with_the_plan(tmp_path):
    """One row per batch: the first optimizer step (AdamW's lazy states plus its temporaries) is
    the peak and fails unguarded. No split can shrink it (parameters, gradients and states are the
    same at any k): guarded, the states are allocated before the first forward, the failure comes
    where the split acts, and at one row per forward the run ends with ``WindowOOMError`` naming
    the plan that would fit instead of the allocator's bare error."""
    limit = 3_400_000_000
    bare = _run(tmp_path, limit, "none", batch=1)
    assert bare.get("failed") == "optimizer" and ALLOC_FAILED in bare["error"], bare.get("error")
    guarded = _run(tmp_path, limit, "oom", batch=1)
    assert guarded["error"].startswith("WindowOOMError"), guarded["error"]
    assert "A plan that would fit" in guarded["error"] and "out of memory" in guarded["error"]


def test_probe_reads_the_limit_and_prevents_the_failure(tmp_path, reference):
    """The backward test's limit with the default budget: the Linux probe reads RLIMIT_AS as the
    budget and the monitor splits before any allocation fails."""
    limit = 5_500_000_000
    guarded = _run(tmp_path, limit, "probe")
    assert "failed" not in guarded, guarded.get("error")
    assert guarded["steps"] == 2 and guarded["oom_retries"] == 0
    assert guarded["micro_batches"] > 1 and guarded["samples_per_step"] == [8, 8]
    _assert_same_params(guarded, reference)
