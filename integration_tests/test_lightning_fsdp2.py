"""Lightning under ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in ``configure_model``) on 2
real gloo CPU ranks (memguard_testing/scripts/lightning_fsdp2_worker.py): the guard splits batches
in place -- every chunk's backward reduce-scatters (Lightning's ``block_backward_sync`` has no
``no_sync`` for FSDP2, so no unsharded gradients are accumulated) -- both ranks cut alike when only
rank 0 asks, and the run ends with the parameters of Lightning's own unsplit FSDP2 run. The
preflight reads the layout from the sharded modules (per-rank FSDP2 full shard)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import memguard_testing  # noqa: E402


def _run(tmp_path, mode: str, port: int) -> list:
    env = memguard_testing.script_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                           str(port), memguard_testing.script("lightning_fsdp2_worker.py"), mode, str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=420)   # a hang ends in the timeout
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(tmp_path / f"{mode}_rank{r}.pt") for r in (0, 1)]


def test_fsdp2_split_in_place_equals_the_unsplit_run(tmp_path):
    port = 29200 + (os.getpid() % 500) * 2
    plain, split = _run(tmp_path, "plain", port), _run(tmp_path, "split", port + 1)
    expected = [[4], [2, 2], [2, 2], [2, 2]] + [[1, 1, 1, 1]] * 4
    for r in (0, 1):
        p, s = plain[r], split[r]
        assert p["batches"] == [[4]] * 8
        assert s["batches"] == expected            # rank 1 followed rank 0's k through the all-reduce
        assert s["split_disabled"] is None
        assert s["global_step"] == p["global_step"] == 4
        assert s["lr"] == pytest.approx(p["lr"], rel=1e-12)
        assert s["samples_per_step"] == [8] * 4
        worst = max((s["params"][n] - p["params"][n]).abs().max().item() for n in p["params"])
        assert worst < 2e-5
        assert s["layout"] == {"world_size": 2, "sharding": "fsdp-full", "fsdp_version": 2, "applied": [],
                               "split": 1}
    # the gathered parameters are the same on both ranks
    assert max((split[0]["params"][n] - split[1]["params"][n]).abs().max().item() for n in split[0]["params"]) == 0
