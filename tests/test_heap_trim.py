"""``trim_heap``: at the end of an optimizer step on a CPU device on Linux, the guard hands glibc's
free heap back to the kernel. Real heap holes (freed 64 KiB tensors between kept ones, in a fresh
process so the heap is this test's own), real RSS from /proc; the same step with ``trim_heap=False``
keeps the holes resident."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from memguard_core.errors import ConfigError
from memguard_core.options import GuardOptions
from memguard_testing import ROOT, script_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                                reason="malloc_trim is glibc's (Linux)")

SCRIPT = os.path.join(ROOT, "memguard_testing", "scripts", "heap_holes_step.py")


def _step(mode: str) -> dict:
    p = subprocess.run([sys.executable, SCRIPT, mode], capture_output=True, text=True, timeout=300, env=script_env())
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_step_end_returns_the_holes_of_the_heap():
    on, off = _step("on"), _step("off")
    # 1,000 freed 64 KiB blocks: all but their chunk headers' pages go back (~58 MiB)
    assert on["before"] - on["after"] > 40 * 2**20
    assert abs(off["before"] - off["after"]) < 4 * 2**20
    assert on["steps"] == off["steps"] == 1


def test_step_end_trims_when_the_adapter_samples_outside_batch_boundaries():
    # Lightning's non-splitting paths (DeepSpeed, FSDP1 offload, manual optimization) sample memory
    # themselves; their step ends must still return the holes, as the estimate assumes
    got = _step("unsampled")
    assert got["before"] - got["after"] > 40 * 2**20


def test_trim_heap_takes_a_bool():
    assert GuardOptions.from_kwargs().trim_heap is True
    with pytest.raises(ConfigError, match="trim_heap"):
        GuardOptions.from_kwargs(trim_heap="yes")


def test_the_mmap_threshold_is_fixed_for_routed_half_precision_runs_on_a_cpu_only():
    from memguard_core.estimator.specs import ModelSpec, ParamCounts, TrainSpec
    from memguard_core.estimator.trainable import routed_half_precision_on_cpu

    moe = ModelSpec(name="m", model_type="mixtral", vocab_size=96, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, params=ParamCounts(),
                    num_experts=4, num_experts_per_tok=2)
    dense = moe.replace(model_type="llama", num_experts=0, num_experts_per_tok=0)
    assert routed_half_precision_on_cpu(moe, TrainSpec(dtype="bf16", device="cpu"))
    assert routed_half_precision_on_cpu(moe, TrainSpec(dtype="bf16", mixed_precision=True, device="cpu"))
    assert routed_half_precision_on_cpu(moe, TrainSpec(dtype="fp16", device="cpu"))
    assert not routed_half_precision_on_cpu(moe, TrainSpec(dtype="fp32", device="cpu"))
    assert not routed_half_precision_on_cpu(moe, TrainSpec(dtype="bf16", device="cuda"))
    assert not routed_half_precision_on_cpu(moe, TrainSpec(dtype="bf16", device="cpu", framework="mlx"))
    assert not routed_half_precision_on_cpu(dense, TrainSpec(dtype="bf16", device="cpu"))
