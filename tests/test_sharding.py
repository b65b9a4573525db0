"""Per-rank estimates (memguard_core/sharding.py): what each layout divides and adds, DeepSpeed's
model-state formulas, validation, and the CLI's --world-size / --sharding / --offload."""

from __future__ import annotations

import json
import math
import os

import pytest

from memguard_core.cli import main
from memguard_core.errors import ConfigError
from memguard_core.estimator.cuda import CUDA_FRAGMENTATION
from memguard_core.estimator.estimate import estimate
from memguard_core.estimator.sharding import (DEEPSPEED_CPU_RUNTIME_BYTES, DIST_CPU_RUNTIME_BYTES, FSDP_CPU_HEAP_SLACK, deepspeed_zero2_model_states, deepspeed_zero3_model_states, shard_group,
                                    zero1_model_states, zero_buckets)
from memguard_core.estimator.specs import TrainSpec
from memguard_hf.model_spec import model_spec_from_hf_config

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
SMOL = os.path.join(CONFIGS, "smollm2-135m.json")
STATE = ("weights", "gradients", "optimizer_states", "master_weights")


@pytest.fixture(scope="module")
def smol():
    with open(SMOL) as f:
        return model_spec_from_hf_config({k: v for k, v in json.load(f).items() if not k.startswith("_")})


def ts(**kw) -> TrainSpec:
    base = dict(batch_size=2, seq_length=128, method="full", dtype="fp32", optimizer="adamw",
                framework="torch", device="cpu")
    base.update(kw)
    return TrainSpec(**base)


def test_none_equals_the_single_process_estimate_exactly(smol):
    one = estimate(smol, ts())
    for t in (ts(world_size=1, sharding="none"), ts(world_size=4, sharding="none"),
              ts(world_size=1, sharding="ddp", gradient_as_bucket_view=True)):
        e = estimate(smol, t)
        if t.sharding == "none":
            assert e.peak_bytes == one.peak_bytes and e.phase_breakdowns == one.phase_breakdowns
    # the HF convention is untouched too
    hf = dict(framework="hf")
    assert estimate(smol, ts(**hf)).peak_bytes == estimate(smol, ts(sharding="none", world_size=8, **hf)).peak_bytes


def test_ddp_buckets_copy_the_gradients_unless_they_are_views(smol):
    one = estimate(smol, ts())
    g = one.phase_breakdowns["optimizer"]["gradients"]
    d = estimate(smol, ts(world_size=2, sharding="ddp"))
    assert d.phase_breakdowns["optimizer"]["gradients"] == 2 * g
    assert d.phase_breakdowns["loss"]["gradients"] == g  # the buckets outlive zero_grad(set_to_none)
    assert d.phase_breakdowns["backward"]["backward_transients"] == \
        one.phase_breakdowns["backward"]["backward_transients"] + min(25 << 20, g)
    v = estimate(smol, ts(world_size=2, sharding="ddp", gradient_as_bucket_view=True))
    assert v.phase_breakdowns["optimizer"]["gradients"] == g
    assert v.phase_breakdowns["loss"]["gradients"] == g
    # activations and logits are per rank already; a rank adds torch.distributed's fixed cost on cpu
    for k in ("activations", "logits"):
        assert d.phase_breakdowns["loss"][k] == one.phase_breakdowns["loss"][k]
    assert d.phase_breakdowns["loss"]["runtime_overhead"] == \
        one.phase_breakdowns["loss"]["runtime_overhead"] + DIST_CPU_RUNTIME_BYTES


def test_allocator_slack_per_rank(smol):
    t = ts()
    one = estimate(smol, t)
    # the unsharded block bytes one step passes through the heap: every block's all-gather output
    # and its unsharded gradients (full fine-tune, fp32: 4 + 4 bytes per block parameter)
    p = smol.params
    block = p.blocks // smol.num_layers
    traffic = smol.num_layers * block * 4 + (p.total * 4 - int(p.total * 4 * (p.total - p.blocks) / p.total))
    for mode in ("fsdp-full", "fsdp-no-shard", "zero3"):
        e = estimate(smol, ts(world_size=2, sharding=mode))
        for k in ("backward", "optimizer"):
            assert e.phase_breakdowns[k]["allocator_slack"] == \
                one.phase_breakdowns[k]["allocator_slack"] + int(FSDP_CPU_HEAP_SLACK[mode] * traffic)
        assert e.phase_breakdowns["loss"]["allocator_slack"] == one.phase_breakdowns["loss"]["allocator_slack"]
        assert sum(e.breakdown.values()) == e.peak_bytes
    c = estimate(smol, ts(world_size=2, sharding="fsdp-full", device="cuda"))
    for b in c.phase_breakdowns.values():  # the caching allocator's fraction of the per-rank moment
        live = sum(v for k, v in b.items() if k not in ("allocator_slack", "runtime_overhead"))
        assert b["allocator_slack"] == int(CUDA_FRAGMENTATION * live)
    assert sum(c.breakdown.values()) == c.peak_bytes


def test_fsdp_full_divides_the_model_state_and_keeps_the_root_unsharded(smol):
    one = estimate(smol, ts())
    p = smol.params
    root = (p.total - p.blocks) * 4
    for n in (2, 4, 8):
        e = estimate(smol, ts(world_size=n, sharding="fsdp-full"))
        opt, loss = e.phase_breakdowns["optimizer"], e.phase_breakdowns["loss"]
        for t in ("weights", "gradients", "optimizer_states"):
            assert opt[t] == math.ceil(one.phase_breakdowns["optimizer"][t] / n)
        assert loss["weight_copies"] == root  # embeddings + final norm, fp32 (tied head)
        assert loss["activations"] == one.phase_breakdowns["loss"]["activations"]
        # on cuda (no heap slack) the rank holds less than one process
        assert estimate(smol, ts(world_size=n, sharding="fsdp-full", device="cuda")).peak_bytes < \
            estimate(smol, ts(device="cuda")).peak_bytes
    # reshard_after_forward=False: every block is unsharded at the loss moment too
    g = estimate(smol, ts(world_size=2, sharding="fsdp-grad-op")).phase_breakdowns["loss"]
    assert g["weight_copies"] == root + smol.num_layers * (p.blocks // smol.num_layers) * 4


def test_fsdp_hybrid_and_no_shard_use_their_shard_group(smol):
    h = estimate(smol, ts(world_size=8, sharding="fsdp-hybrid", shard_group_size=2))
    f = estimate(smol, ts(world_size=2, sharding="fsdp-full"))
    assert h.phase_breakdowns == f.phase_breakdowns
    assert shard_group(ts(world_size=8, sharding="fsdp-no-shard")) == 1
    ns = estimate(smol, ts(world_size=4, sharding="fsdp-no-shard")).phase_breakdowns["optimizer"]
    one = estimate(smol, ts()).phase_breakdowns["optimizer"]
    assert all(ns[t] == one[t] for t in ("weights", "gradients", "optimizer_states"))


def test_fsdp_mixed_precision_gathers_in_param_dtype(smol):
    e = estimate(smol, ts(world_size=2, sharding="fsdp-full", dtype="bf16", mixed_precision=True))
    p = smol.params
    assert e.phase_breakdowns["loss"]["weight_copies"] == (p.total - p.blocks) * 2  # bf16 root


def test_offload_is_host_memory_of_the_same_process_on_cpu(smol):
    a = estimate(smol, ts(world_size=2, sharding="fsdp-full"))
    b = estimate(smol, ts(world_size=2, sharding="fsdp-full", offload="params"))
    assert a.peak_bytes == b.peak_bytes
    ca = estimate(smol, ts(world_size=2, sharding="fsdp-full", device="cuda"))
    cb = estimate(smol, ts(world_size=2, sharding="fsdp-full", offload="params", device="cuda"))
    assert cb.phase_breakdowns["optimizer"]["optimizer_states"] == 0 < ca.phase_breakdowns["optimizer"]["optimizer_states"]
    assert cb.peak_bytes < ca.peak_bytes


# --- DeepSpeed -------------------------------------------------------------------------------
# Values computed by hand from deepspeed/runtime/zero/stage_1_and_2.py and stage3.py (0.19.8):
# zero2 gpu = 2P + int(18P/gpus); offload gpu = 2P, cpu = P*max(4*gpus, 16)*1.5 (per node)
# zero3 gpu = 4L + int(18P/gpus); optimizer offload 4L + int(2P/gpus); param offload 4L.


def test_zero2_formula_values():
    P = 10**9
    assert deepspeed_zero2_model_states(P, 8, 1, cpu_offload=False) == (48 * 10**9, 4_250_000_000)
    assert deepspeed_zero2_model_states(P, 8, 1, cpu_offload=True) == (48 * 10**9, 2 * 10**9)
    assert deepspeed_zero2_model_states(P, 1, 1, cpu_offload=True) == (24 * 10**9, 2 * 10**9)
    assert zero1_model_states(P, 8) == 4 * P + 2 * P


def test_zero3_formula_values():
    P, L = 10**9, 10**8
    assert deepspeed_zero3_model_states(P, L, 8, 1, cpu_offload=False) == (4_800_000_000, 2_650_000_000, 4 * L)
    assert deepspeed_zero3_model_states(P, L, 8, 1, cpu_offload=True, cpu_offload_params=False) == \
        (24 * 10**9, 650_000_000, 4 * L)
    assert deepspeed_zero3_model_states(P, L, 8, 1, cpu_offload=True, cpu_offload_params=True) == \
        (27 * 10**9, 4 * L, 4 * L)
    assert deepspeed_zero3_model_states(P, L, 8, 2, cpu_offload=True, zero_init=False)[0] == \
        int(P * max(4 * 8, 18 / 2) * 1.5)


def test_zero_estimates_follow_deepspeeds_model_states(smol):
    P = smol.params.total
    for n in (2, 8):
        # 16-bit weights (bf16, not autocast): DeepSpeed's own setting
        z2 = estimate(smol, ts(world_size=n, sharding="zero2", dtype="bf16")).phase_breakdowns["optimizer"]
        assert abs(sum(z2[t] for t in STATE) - deepspeed_zero2_model_states(P, n, 1, cpu_offload=False)[1]) <= 4
        z3 = estimate(smol, ts(world_size=n, sharding="zero3", dtype="bf16")).phase_breakdowns["optimizer"]
        assert abs(sum(z3[t] for t in STATE) - int(18 * P / n)) <= 4
        z1 = estimate(smol, ts(world_size=n, sharding="zero1", dtype="bf16")).phase_breakdowns["optimizer"]
        assert abs(sum(z1[t] for t in STATE) - zero1_model_states(P, n)) <= 4


def test_zero_reduce_bucket_resident_pages_on_cpu(smol):
    # DeepSpeed's defaults (plain loop): a 5e8-element bucket; on cpu only the written pages count
    P = smol.params.total
    one = estimate(smol, ts(dtype="bf16"))
    for dev, elems in (("cpu", min(P, 500_000_000)), ("cuda", 500_000_000)):
        z2 = estimate(smol, ts(world_size=2, sharding="zero2", dtype="bf16", device=dev)).phase_breakdowns["backward"]
        base = estimate(smol, ts(dtype="bf16", device=dev)).phase_breakdowns["backward"]["backward_transients"]
        assert z2["backward_transients"] - base == elems * 2  # bf16 gradients, one buffer (no overlap_comm)
    z = estimate(smol, ts(world_size=2, sharding="zero2", dtype="bf16"))
    assert z.phase_breakdowns["loss"]["runtime_overhead"] == \
        one.phase_breakdowns["loss"]["runtime_overhead"] + DIST_CPU_RUNTIME_BYTES + DEEPSPEED_CPU_RUNTIME_BYTES


def test_zero_buckets_by_framework():
    assert zero_buckets(576, "hf")["reduce"] == 576 * 576
    assert zero_buckets(576, "hf")["prefetch"] == int(0.9 * 576 * 576)
    assert zero_buckets(576, "hf")["persistence"] == 5760
    assert zero_buckets(576, "lightning")["reduce"] == 200_000_000
    assert zero_buckets(576, "torch")["reduce"] == 500_000_000


def test_transcription_matches_the_installed_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2

    for P, L in ((134_515_008, 28_311_552), (7 * 10**9, 5 * 10**8)):
        for gpus, nodes in ((1, 1), (8, 1), (8, 4)):
            for off in (False, True):
                assert deepspeed_zero2_model_states(P, gpus, nodes, off) == z2(P, gpus, nodes, off)
                for off_p in (False, True):
                    for zi in (False, True):
                        assert deepspeed_zero3_model_states(P, L, gpus, nodes, off, off_p, zi) == \
                            tuple(int(x) for x in z3(P, L, gpus, nodes, off, off_p, zi))


# --- validation and CLI --------------------------------------------------------------------------


@pytest.mark.parametrize("kw,field", [
    (dict(sharding="fsdp"), "sharding"),
    (dict(sharding="ddp", offload="params"), "offload"),
    (dict(sharding="fsdp-full", offload="optimizer"), "offload"),
    (dict(sharding="zero2", offload="params"), "offload"),
    (dict(sharding="fsdp-full", offload="disk"), "offload"),
    (dict(sharding="fsdp-full", shard_group_size=2), "shard_group_size"),
    (dict(sharding="fsdp-hybrid", world_size=4, shard_group_size=3), "shard_group_size"),
    (dict(sharding="ddp", bucket_cap_mb=0), "bucket_cap_mb"),
    (dict(sharding="fsdp-full", fsdp_version=3), "fsdp_version"),
    (dict(sharding="ddp", framework="mlx", device="mlx"), "sharding"),
])
def test_bad_sharding_names_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        ts(**kw)
    assert field in str(e.value)


def test_cli_sharding_json(capsys):
    def run(*a):
        assert main(["estimate", "--config", SMOL, "--method", "full", "--dtype", "fp32", "--batch-size", "2",
                     "--seq-length", "128", "--framework", "torch", "--device", "cpu", "--json", *a]) == 0
        return json.loads(capsys.readouterr()[0])

    single = run()
    d = run("--world-size", "2", "--sharding", "fsdp-full")
    assert d["train"]["sharding"] == "fsdp-full" and d["train"]["world_size"] == 2
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    ddp = run("--world-size", "2", "--sharding", "ddp")["peak_bytes"]
    assert ddp > single["peak_bytes"] and ddp > d["peak_bytes"]
    o = run("--world-size", "2", "--sharding", "fsdp-full", "--offload", "params")
    assert o["train"]["offload"] == "params" and o["peak_bytes"] == d["peak_bytes"]
    assert main(["estimate", "--config", SMOL, "--sharding", "ddp", "--offload", "params", "--json"]) == 2
    assert "--offload" in capsys.readouterr()[1]


def test_untrimmed_fsdp_keeps_the_backward_holes_at_every_moment(smol):
    """heap_trim=False (a plain loop without the guard's step-end trim): glibc returns no hole of
    the main heap, so under FSDP / ZeRO-3 every moment carries the largest moment's slack
    (sharding._untrimmed_holes_persist); trimmed runs, DDP and cuda are unchanged."""
    long = dict(seq_length=256)  # issue 35's case: the loss moment's live set is the larger one
    for mode in ("fsdp-full", "zero3"):
        t = estimate(smol, ts(world_size=2, sharding=mode, **long))
        u = estimate(smol, ts(world_size=2, sharding=mode, heap_trim=False, **long))
        held = max(b["allocator_slack"] for b in t.phase_breakdowns.values())
        for k, b in u.phase_breakdowns.items():
            assert b["allocator_slack"] == held
            assert {x: y for x, y in b.items() if x != "allocator_slack"} == \
                {x: y for x, y in t.phase_breakdowns[k].items() if x != "allocator_slack"}
        assert sum(u.breakdown.values()) == u.peak_bytes
        if mode == "fsdp-full":  # the loss moment (activations + logits) on top of the backward's holes
            assert u.phase == "loss" and u.peak_bytes > t.peak_bytes
    for kw in (dict(sharding="ddp"), dict(sharding="fsdp-full", device="cuda")):
        assert estimate(smol, ts(world_size=2, heap_trim=False, **long, **kw)).phase_breakdowns == \
            estimate(smol, ts(world_size=2, **long, **kw)).phase_breakdowns
