"""bench/cuda_reserved.py's replay of the caching allocator's recorded history, on hand-made traces
in ``torch.cuda.memory._snapshot()``'s format (this machine has no CUDA to record one): a new segment
while the large pool's free bytes would hold the request is counted as fragmentation, one while they
would not is not; step marks split the peaks."""

from __future__ import annotations

import pytest

from memguard_testing.bench_scripts import load_bench_script

MiB = 1 << 20


@pytest.fixture(scope="module")
def cr():
    return load_bench_script("cuda_reserved")


def _alloc(addr, size, name="forward"):
    return {"action": "alloc", "addr": addr, "size": size, "frames": [{"filename": "/x/models/m.py", "line": 1, "name": name}]}


def _free(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size}


def _seg(addr, size):
    return {"action": "segment_alloc", "addr": addr, "size": size}


def _mark(addr):
    return _alloc(addr, 8, name="_step_mark")


def test_census_tells_fragmentation_from_growth(cr):
    base = 1 << 40
    trace = [
        _seg(0, 2 * MiB), _mark(0),                      # step 1 begins (small pool)
        _seg(base, 100 * MiB), _alloc(base, 100 * MiB),  # growth: nothing cached
        _free(base, 100 * MiB),
        _alloc(base, 30 * MiB), _alloc(base + 60 * MiB, 30 * MiB),  # 40 MiB free, in runs of 30 and 10
        _mark(512),                                      # step 1 ends
        _mark(1024),                                     # step 2 begins
        _seg(base + 200 * MiB, 40 * MiB), _alloc(base + 200 * MiB, 40 * MiB),  # fits the free sum, not a run
    ]
    c = cr.census({"device_traces": [trace]})
    grow, frag = [s for s in c["segment_allocs"] if s["segment"] > 2 * MiB]
    assert (grow["step"], grow["fragmented"], grow["free_large"]) == (1, False, 0)
    assert grow["frames"] == ["models/m.py:1 forward"]
    assert frag["step"] == 2 and frag["fragmented"] is True
    assert frag["free_large"] == 40 * MiB and frag["largest_free_large"] == 30 * MiB
    assert frag["allocated"] == 60 * MiB + 3 * 512 and frag["reserved"] == 102 * MiB
    assert c["peaks"]["1"]["allocated"] == 100 * MiB + 512
    assert c["peaks"]["2"]["reserved"] == 142 * MiB
