"""memguard_torch.TorchGuard on real CPU training loops with a tiny Llama (memguard_testing.hf_tiny):
a plain loop split in place ends with the unsplit run's parameters (padded and packed batches); an
accelerate ``Accelerator`` loop (``accumulate`` + ``backward``) the same; 2-rank DDP and FSDP2
(gloo, one thread per rank) split in place against their unsplit runs; a rank that asks for more
micro-batches alone; and a REAL allocator failure on one rank only (``RLIMIT_AS`` in that rank's
process) that every rank survives, with no hang, ending with the unsplit run's parameters.

Tolerance: the split run sums k weighted chunk gradients where the unsplit run computes one batch
mean, so the gradients agree to float32 rounding (~1e-7 relative); AdamW divides by sqrt of the
second moment, which carries such differences into the update at the same relative size, so after
a few steps at lr 1e-3 parameters agree to ~1e-6. ``atol=2e-5`` (as the HF split tests) is ten times
that and far below one update (1e-3).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from memguard_testing import placement, script_env
from memguard_testing.hf_tiny import RowsDataset, pad_collate, tiny_llama
from memguard_testing.torchrun import launch
from memguard_torch import TorchGuard

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "memguard_testing", "scripts",
                      "torch_loop_worker.py")
ATOL = 2e-5


def _max_diff(a, b) -> float:
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def _loop(k, collate, steps=3, rows=8, guarded=True):
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = RowsDataset(n=rows * steps)
    loader = torch.utils.data.DataLoader(ds, batch_size=rows, collate_fn=collate)
    guard = TorchGuard(model, opt, micro_batches=k, budget_gib=8, monitor_interval_s=0) if guarded else None
    for batch in loader:
        if guard is None:
            model(**batch).loss.backward()
        else:
            for chunk, weight in guard.chunks(batch):
                with guard.micro_step():
                    loss = model(**chunk).loss * weight
                    loss.backward()
        opt.step()
        opt.zero_grad()
        if guard is not None:
            guard.step_end()
    summary = guard.finish() if guard is not None else None
    return list(model.parameters()), guard, summary


def test_plain_loop_split_equals_unsplit():
    # padded rows: the tiny Llama's SDPA attends across the sequences of a packed row (no
    # flash-attention varlen kernel on CPU), so a packed batch cut at sequence boundaries is not the
    # same computation here; the packed cut itself is memguard_core.microbatch's (tests/test_microbatch.py)
    base, _, _ = _loop(1, pad_collate, guarded=False)
    split, guard, summary = _loop(3, pad_collate)
    assert _max_diff(base, split) < ATOL
    assert summary["optimizer_steps"] == 3 and summary["micro_batches"] == 3
    assert len(guard.micro_batch_rows) == 9            # three micro-batches per batch
    assert summary["samples_per_step"] == [8]          # rows per optimizer step
    assert guard.preflight is not None                  # read from the live module


def _accelerate_loop(k, guarded, steps=4, rows=8, accum=2):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(RowsDataset(n=rows * steps), batch_size=rows, collate_fn=pad_collate)
    model, opt, loader = acc.prepare(model, opt, loader)
    guard = TorchGuard(model, opt, accelerator=acc, micro_batches=k, budget_gib=8,
                       monitor_interval_s=0) if guarded else None
    for batch in loader:
        with acc.accumulate(model):
            if guard is None:
                acc.backward(model(**batch).loss)
            else:
                for chunk, weight in guard.chunks(batch):
                    with guard.micro_step():
                        acc.backward(model(**chunk).loss * weight)
            opt.step()
            opt.zero_grad()
        if guard is not None:
            guard.step_end()
    summary = guard.finish() if guard is not None else None
    params = list(acc.unwrap_model(model).parameters())
    return params, guard, summary


def test_accelerate_loop_split_equals_unsplit():
    base, _, _ = _accelerate_loop(1, guarded=False)
    split, guard, summary = _accelerate_loop(4, guarded=True)
    assert _max_diff(base, split) < ATOL
    # accelerate steps every second batch: the guard counts optimizer steps from sync_gradients
    assert summary["optimizer_steps"] == 2
    assert summary["samples_per_step"] == [16]
    assert guard.preflight is not None and guard.preflight.plan.train_spec.grad_accum == 2
    assert guard.micro_batch_rows == [2] * 16


# ---------------------------------------------------------------------------------------------
# multi-process runs (gloo on CPU)


def _launch(out, *args, world=2, timeout=150, **env_extra):
    """Run ``world`` ranks of the worker (``memguard_testing.torchrun``: torchrun's agent, the ranks
    forked from one launcher); returns (return code, output); the code is None when the run did not
    end within ``timeout`` seconds (a hang: the launcher and its ranks are killed). ``args`` may
    hold several scenarios separated by ``"--then"``, each with its own ``--out``, run in sequence
    by the same ranks (``out`` is then the first scenario's)."""
    env = script_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_ARENA_MAX="1", TOKENIZERS_PARALLELISM="false",
                     **env_extra)
    return launch(WORKER, "--out", str(out), *map(str, args), env=env, nproc=world, timeout=timeout)


def _check(rc, output):
    assert rc is not None, "the ranks hung:\n" + output[-6000:]
    assert rc == 0, output[-6000:]


def _results(out):
    params = torch.load(os.path.join(out, "params.pt"))
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    return params, ranks


def _diff(a, b) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


OOM_ARGS = ("--seq", 256, "--attn", "eager")   # eager attention: activations dominate a rank's growth

# Every run of a mode but the allocator-failure ones, in one 2-rank launch (one process start and one
# import of torch/transformers per rank for all of them; each run builds its own seeded model and
# optimizer). The out-of-memory test's reference comes first: its limit is placed from the VmPeak
# growth of that run, and VmPeak never falls within a process.
# ddp: chunks under no_sync, the guard averages; ddp --no-oom-sync: DDP reduces in the last chunk's
# backward; fsdp: sync points in FSDP's comms; fsdp --module-hooks: the module-hook fallback;
# fsdp1: FSDP1, sync points in its all-gathers and a communication hook; fsdp k-at-step: rank 1
# alone raises k at step 1
SCENARIOS = {
    "ddp": {"oom-ref": ("--plain", *OOM_ARGS), "ref": ("--plain",), "ddp": ("--k", 3),
            "ddp-no-oom-sync": ("--k", 3, "--no-oom-sync")},
    "fsdp": {"oom-ref": ("--plain", *OOM_ARGS), "ref": ("--plain",), "fsdp": ("--k", 3),
             "fsdp-module-hooks": ("--k", 3, "--module-hooks"), "k-at-step": ("--k-at-step", "1:1:4")},
    "fsdp1": {"oom-ref": ("--plain", *OOM_ARGS), "ref": ("--plain",), "fsdp1": ("--k", 3)},
}


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    """``mode_runs(mode)``: {scenario: (params, per-rank figures)} of SCENARIOS[mode], launched once
    per module on first use."""
    root = tmp_path_factory.mktemp("torch-loop-runs")
    cache = {}

    def get(mode):
        if mode not in cache:
            args = []
            for name, extra in SCENARIOS[mode].items():
                args += [*(["--then", "--out", root / mode / name] if args else []), "--mode", mode, *extra]
            _check(*_launch(root / mode / "oom-ref", *args, timeout=400))
            cache[mode] = {name: _results(root / mode / name) for name in SCENARIOS[mode]}
        return cache[mode]
    return get


@pytest.mark.parametrize("variant", ["ddp", "ddp-no-oom-sync", "fsdp", "fsdp-module-hooks", "fsdp1"])
def test_two_rank_split_equals_unsplit(variant, mode_runs):
    mode = variant.split("-")[0]
    runs = mode_runs(mode)
    params, ranks = runs[variant]
    assert _diff(runs["ref"][0], params) < ATOL
    for r in ranks:
        assert r["micro_batch_rows"] == [3, 2, 3] * 3 and r["optimizer_steps"] == 3 and r["oom_retries"] == 0
        # the preflight read the sharding from the live model (per-rank estimate, docs/distributed.md)
        assert r["preflight_sharding"] == {"ddp": "ddp", "fsdp": "fsdp-full", "fsdp1": "fsdp-full"}[mode]


def test_one_rank_asks_for_more_micro_batches(mode_runs):
    """Rank 1 alone raises k at step 1 (as its monitor would): both ranks cut alike (FSDP2 would hang
    otherwise) and the result is the unsplit one."""
    runs = mode_runs("fsdp")
    params, ranks = runs["k-at-step"]
    assert _diff(runs["ref"][0], params) < ATOL
    for r in ranks:
        assert r["micro_batch_rows"] == [8, 2, 2, 2, 2, 2, 2, 2, 2]


@pytest.mark.parametrize("mode, extra", [("fsdp", ()), ("fsdp", ("--module-hooks",)), ("ddp", ()), ("fsdp1", ())],
                         ids=["fsdp", "fsdp-module-hooks", "ddp", "fsdp1"])
def test_one_rank_out_of_memory_is_survived_by_every_rank(mode, extra, mode_runs, tmp_path):
    """Rank 1 alone gets an address-space limit (RLIMIT_AS) of its VmSize before training plus a
    fraction (0.7 first) of what the unsplit step added to its VmPeak in the reference run: its
    allocator really fails at the unsplit size (a 4-row split needs under half of it); where the
    guarded run meets no error or gives up at one row per forward, the limit is placed lower or
    higher (``placement.place_limit``). The monitor's step sample is off, so the OOM path is what
    acts. Every rank finishes every step within the timeout (a rank left in a collective would
    hang), both ranks record the retry, rank 1's errors are the allocator's own, and the parameters
    are the unsplit run's. Under DDP, the failing rank's first forward also
    leaves DDP's buffer-broadcast flag as it was (``memguard_torch._compat.ddp_after_abort``)."""
    ref_params, ref_ranks = mode_runs(mode)["oom-ref"]
    growth = ref_ranks[1]["vmpeak"] - ref_ranks[1]["base_vmsize"]

    def run(room: int):
        out = tmp_path / f"oom-{room}"
        rc, outs = _launch(out, "--mode", mode, *OOM_ARGS, "--rlimit-rank", 1, "--rlimit-headroom", room,
                           "--oom-path-only", *extra, timeout=240)
        assert rc is not None, "the ranks hung:\n" + outs[-6000:]
        if rc != 0:
            return placement.outcome_of(rc, outs, []), None
        ranks = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
        return placement.outcome_of(rc, outs, ranks[1]["oom_errors"]), (out, ranks)

    outcome, result, tried = placement.place_limit(run, growth, first=0.7)
    assert outcome == placement.BIT, tried
    out, ranks = result
    errors = ranks[1]["oom_errors"]
    assert errors and all("can't allocate memory" in e for e in errors), errors   # real allocator failures
    if mode.startswith("fsdp"):
        # rank 0 learnt of it at a sync point before one of its collectives (DDP's chunks have none:
        # rank 0 finishes its chunk and meets rank 1 at the chunk's end)
        assert ranks[0]["oom_errors"] and all(e.startswith("PeerOutOfMemoryError") for e in ranks[0]["oom_errors"])
    for r in ranks:
        assert r["optimizer_steps"] == 3
        assert r["oom_retries"] == len(errors)
        assert r["micro_batch_rows"] == ranks[0]["micro_batch_rows"]     # the ranks cut alike
    assert _diff(ref_params, torch.load(out / "params.pt")) < ATOL
