"""``trim_heap`` at train start: a guarded HF ``Trainer`` run of a mixture-of-experts model in bf16
on a CPU device fixes glibc's mmap threshold at 4 MiB; dense models, fp32 MoE runs and
``trim_heap=False`` leave glibc's dynamic threshold alone. Real tiny Mixtral / Llama fine-tunes
under ``MemGuardCallback`` in fresh processes (the setting is process-wide and cannot be undone:
the runs that must not fix it share one, the run that does has its own), and glibc's own counters (``mallinfo2().hblkhd``) after
each: a 6 MiB tensor allocated right after a 16 MiB one was freed is mmapped only under a fixed
threshold (the freed 16 MiB chunk raises a dynamic one above it)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from memguard_testing import script, script_env
from memguard_testing.forkserver import run_script

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                reason="mallopt / mallinfo2 are glibc's (Linux)")


def _runs(*kinds: str) -> dict:
    p = run_script(script("mmap_threshold_run.py"), *kinds, timeout=300, env=script_env(OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    return {r["kind"]: r for r in json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])}


def test_a_bf16_moe_run_fixes_the_mmap_threshold_and_the_others_do_not():
    from memguard_core.probes.linux import heap

    if heap.malloc_in_use() is None:
        pytest.skip("glibc < 2.33: no mallinfo2")
    # the runs that must leave the threshold alone share a process; the one that fixes it gets a
    # fresh one, whose heap holds no free chunk from the others' 16 MiB tensors to serve 6 MiB from
    kept = _runs("dense-bf16", "moe-fp32", "moe-bf16-off")
    fixed = _runs("moe-bf16")["moe-bf16"]
    assert all(r["steps"] == 2 for r in [*kept.values(), fixed])
    for kind, r in kept.items():
        assert r["added"] == 0, kind      # from the heap: the dynamic threshold is above 6 MiB
        assert r["lines"] == [], kind
    assert fixed["added"] >= 6 << 20      # mmapped: the threshold is fixed at 4 MiB
    assert len(fixed["lines"]) == 1 and "4 MiB" in fixed["lines"][0]
