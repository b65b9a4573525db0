"""Reading the data-parallel layout from where users set it (memguard_core/deepspeed_config.py, memguard_torch/sharding_settings.py and
the adapters' readers): DeepSpeed configs, accelerate's real plugin objects, HF ``TrainingArguments``,
live DDP / ``fully_shard`` wrappers in a real one-process gloo group.

Fakes: an ``Accelerator`` running FSDP or DeepSpeed cannot be built on this CPU-only machine (its
FSDP and DeepSpeed paths need a GPU accelerator), so those tests hand the reader a namespace holding
the real plugin objects and the real ``DistributedType`` -- the attributes ``Accelerator`` exposes,
nothing else. Real multi-process runs through HF ``Trainer`` DDP are in integration_tests/
(test_hf_microbatch.py, test_distributed_estimate.py).
"""

from __future__ import annotations

import json
import os
import socket
from types import SimpleNamespace

import pytest

from memguard_core.errors import ConfigError
from memguard_core.deepspeed_config import zero_settings
from memguard_torch.sharding_settings import accelerate_settings, fsdp1_sharding, fsdp_plugin_settings
from memguard_core.estimator.specs import TrainSpec


def _zo(**zo):
    return {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": zo}


#: DeepSpeed's defaults (deepspeed/runtime/zero/config.py, 0.19.8), for the keys a config leaves out
_DS_DEFAULTS = dict(reduce=500_000_000, allgather=500_000_000, prefetch=50_000_000, max_live=1_000_000_000,
                    persistence=100_000)
_ALL_BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                    "stage3_max_live_parameters", "stage3_param_persistence_threshold", "overlap_comm")


# --- DeepSpeed configs ---------------------------------------------------------------------------


@pytest.mark.parametrize("zo,want", [
    (dict(stage=1), dict(sharding="zero1", offload="none")),
    (dict(stage=2, offload_optimizer={"device": "cpu", "pin_memory": True}),
     dict(sharding="zero2", offload="optimizer")),
    # offload_param counts under stage 3 only, as in DeepSpeed
    (dict(stage=2, offload_param={"device": "cpu"}), dict(sharding="zero2", offload="none")),
    (dict(stage=3, offload_optimizer={"device": "cpu"}, offload_param={"device": "nvme"}),
     dict(sharding="zero3", offload="params")),
    (dict(stage=3, offload_optimizer={"device": "none"}), dict(sharding="zero3", offload="none")),
    (dict(stage="3"), dict(sharding="zero3", offload="none")),
])
def test_zero_stage_and_offload(zo, want):
    got = zero_settings(_zo(**zo))
    assert got.pop("zero_buckets") == _DS_DEFAULTS | {"overlap_comm": got["sharding"] == "zero3"}
    assert got == want


def test_zero_stage_0_and_no_zero_section_are_plain_data_parallel():
    assert zero_settings(_zo(stage=0)) == {"sharding": "ddp"}
    assert zero_settings({"bf16": {"enabled": True}}) == {"sharding": "ddp"}


def test_zero_bucket_numbers_are_kept_and_auto_values_left_to_the_framework():
    got = zero_settings(_zo(stage=3, reduce_bucket_size=5e8, stage3_prefetch_bucket_size="auto",
                            stage3_param_persistence_threshold="1e4", stage3_max_live_parameters=10**9,
                            overlap_comm=True, contiguous_gradients=True))
    assert got["zero_buckets"] == {"reduce": 500_000_000, "persistence": 10_000, "max_live": 10**9,
                                   "overlap_comm": True, "allgather": 500_000_000}
    assert "zero_buckets" not in zero_settings(_zo(stage=2, **{k: "auto" for k in _ALL_BUCKET_KEYS}))


def test_zero_bucket_keys_left_out_are_deepspeeds_defaults_and_field_names_count():
    # HF and accelerate fill "auto" values only; DeepSpeed gives a missing key its own default
    assert zero_settings(_zo(stage=2))["zero_buckets"] == _DS_DEFAULTS | {"overlap_comm": False}
    assert zero_settings(_zo(stage=3))["zero_buckets"] == _DS_DEFAULTS | {"overlap_comm": True}
    # DeepSpeed's model takes a field's name as well as its stage3_ alias
    got = zero_settings(_zo(stage=3, prefetch_bucket_size=1000, max_live_parameters=2000,
                            param_persistence_threshold=3000))["zero_buckets"]
    assert (got["prefetch"], got["max_live"], got["persistence"]) == (1000, 2000, 3000)


def test_zero_config_without_bucket_sizes_is_estimated_with_deepspeeds_buckets():
    from memguard_core.estimator.estimate import estimate
    from memguard_hf.model_spec import model_spec_from_hf_config

    with open(os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")) as f:
        ms = model_spec_from_hf_config({k: v for k, v in json.load(f).items() if not k.startswith("_")})
    base = dict(batch_size=2, seq_length=128, method="full", dtype="bf16", framework="hf", device="cuda",
                world_size=2)
    bare = estimate(ms, TrainSpec(**base, **zero_settings(_zo(stage=2))))
    auto = estimate(ms, TrainSpec(**base, **zero_settings(_zo(stage=2, reduce_bucket_size="auto"))))
    # no reduce_bucket_size: DeepSpeed's 5e8 elements, not HF's "auto" hidden_size**2
    grow = bare.phase_breakdowns["backward"]["backward_transients"] - auto.phase_breakdowns["backward"]["backward_transients"]
    assert grow == (500_000_000 - ms.hidden_size ** 2) * 2


def test_zero_buckets_change_the_estimate():
    from memguard_core.estimator.estimate import estimate
    from memguard_hf.model_spec import model_spec_from_hf_config

    with open(os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")) as f:
        ms = model_spec_from_hf_config({k: v for k, v in json.load(f).items() if not k.startswith("_")})
    base = dict(batch_size=2, seq_length=128, method="full", dtype="bf16", framework="hf", device="cuda",
                world_size=2)
    auto = estimate(ms, TrainSpec(**base, **zero_settings(_zo(stage=2, reduce_bucket_size="auto"))))
    big = estimate(ms, TrainSpec(**base, **zero_settings(_zo(stage=2, reduce_bucket_size=5e8))))
    # "auto" under HF: hidden_size**2 elements; 5e8 given: 5e8 bf16 gradients more of reduce buffer
    grow = big.phase_breakdowns["backward"]["backward_transients"] - auto.phase_breakdowns["backward"]["backward_transients"]
    assert grow == (500_000_000 - ms.hidden_size ** 2) * 2


def test_zero_config_from_a_json_file(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(_zo(stage=2, offload_optimizer={"device": "cpu"})))
    got = zero_settings(str(p))
    assert (got["sharding"], got["offload"], got["zero_buckets"]["reduce"]) == ("zero2", "optimizer", 500_000_000)


@pytest.mark.parametrize("cfg,field", [
    (_zo(stage=4), "zero_optimization.stage"),
    (_zo(stage=True), "zero_optimization.stage"),
    (_zo(stage=2, reduce_bucket_size="big"), "zero_optimization.reduce_bucket_size"),
    (_zo(stage=2, reduce_bucket_size=-1), "zero_optimization.reduce_bucket_size"),
    (_zo(stage=2, overlap_comm="yes"), "zero_optimization.overlap_comm"),
    ({"zero_optimization": [2]}, "zero_optimization"),
    ([1, 2], "deepspeed"),
    ("/nonexistent/ds_config.json", "deepspeed"),
])
def test_bad_deepspeed_config_names_the_key(cfg, field):
    with pytest.raises(ConfigError) as e:
        zero_settings(cfg)
    assert e.value.field == field


@pytest.mark.parametrize("kw,field", [
    (dict(sharding="ddp", zero_buckets={"reduce": 10}), "zero_buckets"),
    (dict(sharding="zero2", zero_buckets={"bucket": 10}), "zero_buckets"),
    (dict(sharding="zero2", zero_buckets={"reduce": 1.5}), "zero_buckets['reduce']"),
    (dict(sharding="zero2", zero_buckets={"overlap_comm": 1}), "zero_buckets['overlap_comm']"),
])
def test_bad_zero_buckets_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        TrainSpec(batch_size=1, seq_length=8, world_size=2, **kw)
    assert e.value.field == field


# --- FSDP: strategy names and accelerate's real plugin -------------------------------------------


def test_fsdp1_strategy_names_enums_and_accelerate_numbers():
    torch = pytest.importorskip("torch")
    from torch.distributed.fsdp import ShardingStrategy

    assert fsdp1_sharding(ShardingStrategy.SHARD_GRAD_OP) == "fsdp-grad-op"
    assert fsdp1_sharding(ShardingStrategy._HYBRID_SHARD_ZERO2) == "fsdp-hybrid"
    assert fsdp1_sharding("full_shard") == "fsdp-full"
    assert fsdp1_sharding(3) == "fsdp-no-shard"  # accelerate's FSDP_SHARDING_STRATEGY order, 1-based
    assert fsdp1_sharding("4") == "fsdp-hybrid"
    with pytest.raises(ConfigError) as e:
        fsdp1_sharding("ZERO3")
    assert e.value.field == "sharding_strategy"
    assert torch  # imported for the enum


def test_accelerate_fsdp2_plugin(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin as Plugin

    assert fsdp_plugin_settings(Plugin(fsdp_version=2)) == dict(fsdp_version=2, sharding="fsdp-full", offload="none")
    assert fsdp_plugin_settings(Plugin(fsdp_version=2, reshard_after_forward=False, cpu_offload=True)) == \
        dict(fsdp_version=2, sharding="fsdp-grad-op", offload="params")


def test_accelerate_fsdp1_plugin_as_prepare_model_reads_it(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin as Plugin

    got = fsdp_plugin_settings(Plugin(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP", cpu_offload=True), 8)
    assert got == dict(fsdp_version=1, sharding="fsdp-grad-op", offload="params")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    got = fsdp_plugin_settings(Plugin(fsdp_version=1, sharding_strategy="HYBRID_SHARD"), 8)
    assert got == dict(fsdp_version=1, sharding="fsdp-hybrid", shard_group_size=4, offload="none")
    TrainSpec(batch_size=1, seq_length=8, world_size=8, **got)  # a valid spec


def test_accelerate_state_by_distributed_type():
    pytest.importorskip("accelerate")
    from accelerate.utils import (DeepSpeedPlugin, DistributedDataParallelKwargs, DistributedType,
                                  FullyShardedDataParallelPlugin)

    # see the module docstring: the Accelerator's attributes, holding real plugin objects
    ddp = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU,
                          ddp_handler=DistributedDataParallelKwargs(bucket_cap_mb=50, gradient_as_bucket_view=True),
                          state=SimpleNamespace())
    assert accelerate_settings(ddp, 2) == dict(sharding="ddp", bucket_cap_mb=50, gradient_as_bucket_view=True)
    assert accelerate_settings(ddp, 1) == {}
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, ddp_handler=None, state=SimpleNamespace())
    assert accelerate_settings(plain, 4) == {"sharding": "ddp"}
    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, parallelism_config=None,
                           state=SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)))
    assert accelerate_settings(fsdp, 4)["sharding"] == "fsdp-full"
    fsdp.parallelism_config = SimpleNamespace(dp_replicate_size=2, dp_shard_size=4)
    assert accelerate_settings(fsdp, 8) == dict(fsdp_version=2, sharding="fsdp-hybrid", shard_group_size=4,
                                                offload="none")
    ds = DeepSpeedPlugin(hf_ds_config=_zo(stage=3, offload_param={"device": "cpu"}))
    zero = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, state=SimpleNamespace(deepspeed_plugin=ds))
    got = accelerate_settings(zero, 2)
    assert (got["sharding"], got["offload"]) == ("zero3", "params")


# --- HF TrainingArguments (a trainer without an accelerator) --------------------------------------


def test_hf_training_arguments_fallback(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from memguard_hf.specs import layout_of_trainer

    def layout(world, **kw):
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)
        return layout_of_trainer(SimpleNamespace(args=args), world)

    assert layout(1, ddp_bucket_cap_mb=10) == {"sharding": "none"}
    assert layout(2, ddp_bucket_cap_mb=10) == {"sharding": "ddp", "bucket_cap_mb": 10}
    assert layout(2, fsdp=True, fsdp_config={"reshard_after_forward": False, "cpu_offload": True}) == \
        dict(fsdp_version=2, sharding="fsdp-grad-op", offload="params")
    # FSDP1: accelerate 1.15's plugin fills sharding_strategy (FULL_SHARD, or FSDP_SHARDING_STRATEGY)
    # and Accelerator.prepare_model prefers it to the reshard_after_forward HF passes: what runs
    monkeypatch.delenv("FSDP_SHARDING_STRATEGY", raising=False)
    assert layout(4, fsdp=True, fsdp_config={"version": 1, "reshard_after_forward": "no_shard"}) == \
        dict(fsdp_version=1, sharding="fsdp-full", offload="none")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    assert layout(4, fsdp=True, fsdp_config={"version": 1})["sharding"] == "fsdp-grad-op"


# --- live wrappers in a real one-process gloo group ----------------------------------------------


@pytest.fixture
def gloo_group():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield torch
    finally:
        dist.destroy_process_group()


def _net(torch):
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8)),
                               torch.nn.Sequential(torch.nn.Linear(8, 8)))


def test_live_ddp_bucket_settings(gloo_group):
    torch = gloo_group
    from memguard_torch import _compat
    from memguard_torch.specs import layout_of

    ddp = torch.nn.parallel.DistributedDataParallel(_net(torch), bucket_cap_mb=5, gradient_as_bucket_view=True)
    assert _compat.ddp_layout(ddp) == dict(sharding="ddp", bucket_cap_mb=5.0, gradient_as_bucket_view=True)
    # through the layout reader, with the world size the run would have
    assert layout_of(ddp, None, 2) == dict(sharding="ddp", bucket_cap_mb=5.0, gradient_as_bucket_view=True)
    assert layout_of(ddp, None, 1) == {"sharding": "none"}


@pytest.mark.parametrize("reshard,offload,want", [
    (True, False, dict(sharding="fsdp-full", fsdp_version=2)),
    (False, False, dict(sharding="fsdp-grad-op", fsdp_version=2)),
    (True, True, dict(sharding="fsdp-full", fsdp_version=2, offload="params")),
])
def test_live_fully_shard_settings(gloo_group, reshard, offload, want):
    torch = gloo_group
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from memguard_torch import _compat

    net = _net(torch)
    kw = dict(reshard_after_forward=reshard, offload_policy=CPUOffloadPolicy(pin_memory=False) if offload else None)
    kw = {k: v for k, v in kw.items() if v is not None}
    for block in (net[1], net[2]):
        fully_shard(block, **kw)
    fully_shard(net, **kw)
    assert _compat.fsdp2_layout(net, 1) == want
    # the same one-rank shard mesh in a larger world is a replicate-only layout
    assert _compat.fsdp2_layout(net, 2)["sharding"] == "fsdp-no-shard"


@pytest.mark.parametrize("offload,want", [
    (False, dict(sharding="fsdp-no-shard", fsdp_version=1)),
    (True, dict(sharding="fsdp-no-shard", fsdp_version=1, offload="params")),
])
def test_live_fsdp1_settings(gloo_group, offload, want):
    """A live FSDP1 ``FullyShardedDataParallel`` model: the layout from the root's strategy (in a
    one-process group FSDP1 itself switches FULL_SHARD to NO_SHARD, which is what runs and what is
    read; the 2-rank FULL_SHARD case is in integration_tests/test_torch_loop.py) and offload; under
    parameter offload TorchGuard does not split (FSDP1 cannot sum the gradients of several
    synchronised backwards there) and says why."""
    strategy = "FULL_SHARD"
    torch = gloo_group
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP, ShardingStrategy

    from memguard_torch import TorchGuard, _compat
    from memguard_torch.guard_setup import why_no_split
    from memguard_torch.specs import layout_of

    net = _net(torch)
    kw = dict(sharding_strategy=getattr(ShardingStrategy, strategy), device_id=torch.device("cpu"),
              use_orig_params=True, cpu_offload=CPUOffload(offload_params=offload))
    net[1], net[2] = FSDP(net[1], **kw), FSDP(net[2], **kw)
    model = FSDP(net, **kw)
    assert _compat.fsdp1_layout(model, 2) == want
    assert layout_of(model, None, 2) == want
    assert _compat.fsdp1_layout(net[0], 2) == {}          # a plain module holds no FSDP1 unit
    assert _compat.fsdp1_offloads_params(model) is offload
    guard = TorchGuard(model, torch.optim.AdamW(model.parameters()), budget_gib=16, monitor_interval_s=0,
                       preflight=False, leak_detector=False)
    why = why_no_split(guard.model, guard.accelerator)
    assert (why is not None and "offload" in why) if offload else why is None


def test_fsdp1_reset_after_an_aborted_forward_gives_the_modules_their_parameters_back(gloo_group):
    """One process: FSDP1 runs NO_SHARD. A forward that an error stops inside a unit leaves that
    unit's original parameters replaced by plain tensor views (FSDP1 puts them back in its
    post-forward, which never ran); ``reset_fsdp1_after_abort`` must put them back, or the optimizer
    would step parameters the model no longer uses. The error is raised by a forward hook: what
    is checked is the reset after an aborted forward, whatever stopped it."""
    torch = gloo_group
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

    from memguard_torch import _compat

    torch.manual_seed(0)
    net = _net(torch)
    kw = dict(sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu"), use_orig_params=True)
    net[1], net[2] = FSDP(net[1], **kw), FSDP(net[2], **kw)
    model = FSDP(net, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    registered = {id(p) for p in model.parameters()}
    x = torch.randn(4, 8)
    model(x).sum().backward()               # a first step (lazy init, gradients)
    opt.step()
    opt.zero_grad()

    def stop(module, args):
        raise RuntimeError("stopped inside the unit's forward")

    handle = net[2].module[0].register_forward_pre_hook(stop)
    with pytest.raises(RuntimeError, match="stopped"):
        model(x)
    handle.remove()
    assert _compat.reset_fsdp1_after_abort(model)
    for lin in (net[0], net[1].module[0], net[2].module[0]):
        assert isinstance(lin.weight, torch.nn.Parameter) and id(lin.weight) in registered
    before = {id(p): p.detach().clone() for p in model.parameters()}
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()                               # every parameter the forward used moves
    assert all(not torch.equal(before[id(p)], p.detach()) for p in model.parameters())


# --- the CLI's --deepspeed ----------------------------------------------------------------------


def test_cli_deepspeed_config(tmp_path, capsys):
    from memguard_core.cli import main

    smol = os.path.join(os.path.dirname(__file__), "configs", "smollm2-135m.json")

    def run(*a, rc=0):
        assert main(["estimate", "--config", smol, "--method", "full", "--dtype", "bf16", "--batch-size", "2",
                     "--seq-length", "128", "--framework", "hf", "--device", "cuda", "--world-size", "2",
                     "--json", *a]) == rc
        out, err = capsys.readouterr()
        return json.loads(out) if rc == 0 else err

    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps(_zo(stage=3, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"},
                                 reduce_bucket_size="auto", stage3_prefetch_bucket_size=5e7)))
    got = run("--deepspeed", str(ds))
    assert (got["train"]["sharding"], got["train"]["offload"]) == ("zero3", "params")
    assert got["train"]["zero_buckets"]["prefetch"] == 50_000_000
    assert "reduce" not in got["train"]["zero_buckets"]   # "auto": HF's rule (--framework hf)
    flags = run("--sharding", "zero3", "--offload", "params")
    # the config's explicit 5e7-element prefetch bucket is larger than HF's "auto" 0.9 x hidden^2
    assert got["peak_bytes"] > flags["peak_bytes"]
    assert "--sharding" in run("--deepspeed", str(ds), "--sharding", "zero2", rc=2)
    ds.write_text(json.dumps(_zo(stage=5)))
    assert "zero_optimization.stage" in run("--deepspeed", str(ds), rc=2)


# --- Lightning strategies (real strategy objects; their runs need a GPU, their constructors do not) --


def test_lightning_fsdp_strategy_settings():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import FSDPStrategy

    from memguard_lightning.specs import layout_of_strategy

    def layout(strategy, world):
        return layout_of_strategy(SimpleNamespace(strategy=strategy), None, world)

    assert layout(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), 4) == \
        dict(fsdp_version=1, sharding="fsdp-grad-op", offload="none")
    assert layout(FSDPStrategy(sharding_strategy="HYBRID_SHARD", cpu_offload=True, device_mesh=(2, 4)), 8) == \
        dict(fsdp_version=1, sharding="fsdp-hybrid", shard_group_size=4, offload="params")
    assert layout(FSDPStrategy(), 1) == {"sharding": "none"}


def test_lightning_deepspeed_strategy_settings():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("lightning")
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from memguard_lightning.specs import layout_of_strategy

    got = layout_of_strategy(SimpleNamespace(strategy=DeepSpeedStrategy(stage=2)), None, 2)
    # Lightning writes its own bucket defaults into the config it builds
    assert got == dict(sharding="zero2", offload="none",
                       zero_buckets=_DS_DEFAULTS | {"reduce": 200_000_000, "allgather": 200_000_000,
                                                    "overlap_comm": True})
    got = layout_of_strategy(SimpleNamespace(strategy=DeepSpeedStrategy(stage=3, offload_parameters=True)), None, 1)
    assert (got["sharding"], got["offload"]) == ("zero3", "params")   # one process: still ZeRO


def test_deprecated_boolean_zero_optimization_is_stage_1():
    assert zero_settings({"zero_optimization": True})["sharding"] == "zero1"
    assert zero_settings({"zero_optimization": False}) == {"sharding": "ddp"}


def test_deprecated_offload_booleans_and_bucket_bounds():
    assert zero_settings(_zo(stage=2, cpu_offload=True))["offload"] == "optimizer"
    assert zero_settings(_zo(stage=3, cpu_offload=True, cpu_offload_param=True))["offload"] == "params"
    assert zero_settings(_zo(stage=2, cpu_offload=False))["offload"] == "none"
    # DeepSpeed's model: reduce_bucket_size > 0, the others >= 0
    with pytest.raises(ConfigError) as e:
        zero_settings(_zo(stage=2, reduce_bucket_size=0))
    assert e.value.field == "zero_optimization.reduce_bucket_size"
    assert zero_settings(_zo(stage=3, stage3_param_persistence_threshold=0))["zero_buckets"]["persistence"] == 0
