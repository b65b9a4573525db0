"""Real 2-process training (gloo, CPU): each rank's VmHWM against memguard's per-rank estimate.

Runs ``bench/distributed.py``'s cases for DDP and FSDP2 full shard on the 30M-parameter Llama shape
(2 ranks, one thread each, 2 x 128 tokens per rank, fp32 full fine-tune, AdamW, 3 steps): about a
minute on 2 cores. Bounds: the issue's -5 % / +15 % per rank. The same runs check the premise of
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


def _harness():
    spec = importlib.util.spec_from_file_location("mg_bench_distributed", os.path.join(ROOT, "bench", "distributed.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="VmHWM needs Linux /proc")
@pytest.mark.parametrize("mode", ["ddp", "fsdp-full"])
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
        assert d.LOW <= err <= d.HIGH, (mode, r["rank"], r["vm_hwm"] >> 20, est.peak_bytes >> 20, err)
    # live heap (uordblks + hblkhd) at each end of a backward, per rank; zeros without glibc >= 2.33
    live = [[s[5] + s[6] for s in r["stages"] if s[1] == "backward"] for r in ranks]
    if not any(any(x) for x in live):
        return
    assert all(len(x) == d.STEPS for x in live)
    for step, per_rank in enumerate(zip(*live)):
        # 16 MiB: two of the 30M model's FSDP units (6 MiB each), a collective's buffer a gloo worker
        # thread may not have released yet when the backward returns
        assert max(per_rank) - min(per_rank) <= 16 << 20, (mode, step, [x >> 20 for x in per_rank])
