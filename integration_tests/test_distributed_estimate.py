"""Real 2-process training (gloo, CPU): each rank's VmHWM against memguard's per-rank estimate.

Runs ``bench/distributed.py``'s cases for DDP, FSDP2 and FSDP1 full shard on the 30M-parameter Llama shape
(2 ranks, one thread each, 2 x 128 tokens per rank, fp32 full fine-tune, AdamW, 3 steps): about a
minute on 2 cores. Bounds: ``CI_LOW`` / ``CI_HIGH`` per rank, the issue's -5 % / +15 % widened by
5 points each way: one run of a rank on a shared 2-core host spreads by about that much (its glibc
heap depends on the timing of gloo's threads; the same 30M full-shard rank read -1.7 .. -3.7 % in
four runs and -6.2 % in a fifth on one fresh clone). The issue's band is scored where many runs
are, in ``bench/distributed.py``'s table (bench/results/distributed_cpu.md). The same runs check the premise of
docs/distributed.md "Per-rank spread": the ranks' live heap (glibc ``mallinfo2`` in use + mmapped)
is the same at every end of a backward, so what differs between ranks is the heap's holes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("torch")
pytest.importorskip("transformers")


#: this test's band (%): the bench's LOW / HIGH widened by one run's spread (module docstring)
CI_LOW, CI_HIGH = -10.0, 20.0


def _harness():
    spec = importlib.util.spec_from_file_location("mg_bench_distributed", os.path.join(ROOT, "bench", "distributed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM needs Linux /proc")
@pytest.mark.parametrize("mode", ["ddp", "fsdp-full", "fsdp1-full"])
def test_two_ranks_within_the_band(mode):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    d = _harness()
    ranks = d.run_case(mode, "30m", 2, timeout=300)
    assert len(ranks) == 2
    for r in ranks:
        est = d.estimate_case(mode, "30m", 2, r["rss_file_start"])
        err = 100.0 * (est.peak_bytes - r["vm_hwm"]) / r["vm_hwm"]
        assert CI_LOW <= err <= CI_HIGH, (mode, r["rank"], r["vm_hwm"] >> 20, est.peak_bytes >> 20, err)
    # live heap (uordblks + hblkhd) at each end of a backward, per rank; zeros without glibc >= 2.33
    live = [[s[5] + s[6] for s in r["stages"] if s[1] == "backward"] for r in ranks]
    if not any(any(x) for x in live):
        return
    assert all(len(x) == d.STEPS for x in live)
    for step, per_rank in enumerate(zip(*live)):
        # 16 MiB: two of the 30M model's FSDP units (6 MiB each), a collective's buffer a gloo worker
        # thread may not have released yet when the backward returns
        assert max(per_rank) - min(per_rank) <= 16 << 20, (mode, step, [x >> 20 for x in per_rank])
