"""What the frameworks' own settings say about the data-parallel layout, as ``TrainSpec`` keywords.

The adapters read the layout from where users set it and pass the result to ``TrainSpec``
(``sharding``, ``offload``, ``shard_group_size``, ``bucket_cap_mb``, ``gradient_as_bucket_view``,
``fsdp_version``, ``zero_buckets``); ``memguard_core/estimator/sharding.py`` turns it into per-rank terms.
Everything here reads plain values or objects by their public attribute names (duck typing): it
imports no torch, accelerate, transformers or Lightning.

* :func:`zero_settings` -- a DeepSpeed JSON config (``zero_optimization``), as HF ``Trainer``
  (``TrainingArguments.deepspeed``), accelerate (``DeepSpeedPlugin.deepspeed_config``) and
  Lightning (``DeepSpeedStrategy.config``) hold it;
* :func:`fsdp1_sharding` -- FSDP1 ``ShardingStrategy`` (enum, name or accelerate's 1-based number);
* :func:`fsdp_plugin_settings` -- accelerate's ``FullyShardedDataParallelPlugin`` (FSDP1 and 2);
* :func:`accelerate_settings` -- an ``Accelerator`` (or its ``AcceleratorState``): DeepSpeed, FSDP,
  or DDP (``ddp_handler``: ``bucket_cap_mb``, ``gradient_as_bucket_view``) by ``distributed_type``;
  HSDP from ``parallelism_config`` (``dp_replicate_size`` x ``dp_shard_size``).

Each returns ``{}`` when its source says nothing about the layout (one process), so callers can
fall back to another source. A value that is present but not understood raises ``ConfigError``
naming it; the adapters log that and go on with the single-process estimate rather than stop the
user's run.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

from .errors import ConfigError
from .estimator.sharding import ZERO_BUCKETS

#: FSDP1 ``ShardingStrategy`` -> ``TrainSpec.sharding`` (``torch/distributed/fsdp/api.py``;
#: accelerate numbers them 1-5 in this order: ``accelerate/utils/constants.py``
#: ``FSDP_SHARDING_STRATEGY``). ``_HYBRID_SHARD_ZERO2`` keeps every block unsharded from its forward
#: to its backward inside the shard group, which ``fsdp-hybrid`` does not count: see
#: docs/distributed.md, "Where the adapters read the layout".
FSDP1_STRATEGIES = {"FULL_SHARD": "fsdp-full", "SHARD_GRAD_OP": "fsdp-grad-op", "NO_SHARD": "fsdp-no-shard",
                    "HYBRID_SHARD": "fsdp-hybrid", "HYBRID_SHARD_ZERO2": "fsdp-hybrid",
                    "_HYBRID_SHARD_ZERO2": "fsdp-hybrid"}
_FSDP1_BY_NUMBER = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")

#: DeepSpeed ``zero_optimization`` keys -> ``TrainSpec.zero_buckets`` keys
#: (``deepspeed/runtime/zero/config.py``, 0.19.8; its model takes a field's name as well as its
#: ``stage3_`` alias, ``populate_by_name``; the alias first).
ZERO_BUCKET_KEYS = {"reduce_bucket_size": "reduce", "allgather_bucket_size": "allgather",
                    "stage3_prefetch_bucket_size": "prefetch", "prefetch_bucket_size": "prefetch",
                    "stage3_max_live_parameters": "max_live", "max_live_parameters": "max_live",
                    "stage3_param_persistence_threshold": "persistence", "param_persistence_threshold": "persistence",
                    "overlap_comm": "overlap_comm"}

_OFFLOAD_DEVICES = ("cpu", "nvme")


def _name(x: Any) -> str:
    """An enum member's name, else the value as an upper-case string."""
    return str(getattr(x, "name", x)).strip().upper()


def fsdp1_sharding(strategy: Any) -> str:
    """``TrainSpec.sharding`` of an FSDP1 ``ShardingStrategy`` (the enum, its name in any case, or
    accelerate's number 1-5).

    Raises:
        ConfigError: a strategy FSDP1 does not have (field ``sharding_strategy``).
    """
    n = _name(strategy)
    if n.isdigit() and 1 <= int(n) <= len(_FSDP1_BY_NUMBER):
        n = _FSDP1_BY_NUMBER[int(n) - 1]
    if n not in FSDP1_STRATEGIES:
        raise ConfigError("sharding_strategy", "an FSDP ShardingStrategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
                          "HYBRID_SHARD, _HYBRID_SHARD_ZERO2)", strategy)
    return FSDP1_STRATEGIES[n]


def _number(key: str, v: Any) -> Optional[int]:
    """A DeepSpeed size (int, float such as 5e8, or numeric string); None for "auto". >= 0, and
    ``reduce_bucket_size`` > 0, as DeepSpeed's config model requires (``gt=0`` / ``ge=0``)."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = float("nan")
    low = 1 if key == "reduce_bucket_size" else 0
    if isinstance(v, bool) or not f >= low or f == float("inf"):
        raise ConfigError(f"zero_optimization.{key}", f"a number of elements >= {low} or \"auto\"", v)
    return int(f)


def deepspeed_config(config: Any) -> Mapping:
    """A DeepSpeed config as the mapping it is, or read from its JSON file when a path (``str`` /
    ``os.PathLike``), as ``TrainingArguments.deepspeed`` and ``memguard estimate --deepspeed`` take it.

    Raises:
        ConfigError: an unreadable file, or anything else than a mapping or a path (``deepspeed``).
    """
    if isinstance(config, (str, os.PathLike)):
        import json

        try:
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError("deepspeed", "a readable DeepSpeed JSON config file", f"{config} ({e})") from None
    if not isinstance(config, Mapping):
        raise ConfigError("deepspeed", "a DeepSpeed config dict or JSON file path", config)
    return config


def zero_settings(config: Any) -> Dict[str, Any]:
    """``TrainSpec`` keywords of a DeepSpeed config: ``sharding`` (``zero1``..``zero3``; stage 0,
    DeepSpeed's plain data parallelism, as ``ddp``), ``offload`` (``offload_optimizer`` /
    ``offload_param`` with ``device`` cpu or nvme; ``offload_param`` counts under stage 3 only, as
    in DeepSpeed) and ``zero_buckets`` (elements: the bucket sizes the config gives as numbers, and
    DeepSpeed's defaults, ``memguard_core.estimator.sharding.ZERO_BUCKETS["deepspeed"]``, for those it leaves
    out -- HF and accelerate fill "auto" values only; "auto" values are left to the framework's
    rule, ``memguard_core.estimator.sharding.zero_buckets``).

    ``config`` is the dict (HF's ``HfTrainerDeepSpeedConfig.config``, accelerate's
    ``deepspeed_config``, Lightning's ``DeepSpeedStrategy.config``) or a path to its JSON file.
    A config without ``zero_optimization`` is stage 0.

    Raises:
        ConfigError: an unreadable file, a config that is not a mapping, a stage outside 0-3 or a
            bucket size that is not a number (naming the key).
    """
    config = deepspeed_config(config)
    zo = config.get("zero_optimization") or {}
    if zo is True:  # DeepSpeed's deprecated boolean form: stage 1 (deepspeed/runtime/zero/config.py)
        zo = {"stage": 1}
    if not isinstance(zo, Mapping):
        raise ConfigError("zero_optimization", "a mapping", zo)
    stage = zo.get("stage", 0)
    if isinstance(stage, bool) or str(stage).strip() not in ("0", "1", "2", "3"):
        raise ConfigError("zero_optimization.stage", "0, 1, 2 or 3", stage)
    stage = int(str(stage).strip())
    if stage == 0:
        return {"sharding": "ddp"}

    def device(key: str) -> bool:
        o = zo.get(key) or {}
        if isinstance(o, Mapping) and str(o.get("device", "none")).strip().lower() in _OFFLOAD_DEVICES:
            return True
        # DeepSpeed's deprecated booleans: cpu_offload -> offload_optimizer, cpu_offload_param ->
        # offload_param, both on the cpu (deepspeed/runtime/zero/config.py, their new_param_fn)
        return zo.get({"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}[key]) is True

    offload = "params" if stage == 3 and device("offload_param") else "optimizer" if device("offload_optimizer") else "none"
    buckets: Dict[str, Any] = {}
    given = set()
    for key, ours in ZERO_BUCKET_KEYS.items():
        if key not in zo or ours in given:
            continue
        given.add(ours)
        if ours == "overlap_comm":
            v = zo[key]
            if isinstance(v, str) and v.strip().lower() == "auto":
                continue
            if not isinstance(v, bool):
                raise ConfigError(f"zero_optimization.{key}", "true, false or \"auto\"", v)
            buckets[ours] = v
        else:
            n = _number(key, zo[key])
            if n is not None:
                buckets[ours] = n
    # a key the config leaves out takes DeepSpeed's default, whatever the framework (overlap_comm:
    # None -> stage 3, the model's validator)
    for ours, default in ZERO_BUCKETS["deepspeed"].items():
        if ours not in given:
            buckets[ours] = stage == 3 if ours == "overlap_comm" else default
    out: Dict[str, Any] = {"sharding": f"zero{stage}", "offload": offload}
    if buckets:
        out["zero_buckets"] = buckets
    return out


def _offloads_params(cpu_offload: Any, version: int) -> bool:
    """Whether an FSDP offload setting moves the parameters to the host: FSDP2
    ``CPUOffloadPolicy`` (``OffloadPolicy``, its base, is "no offload"), FSDP1
    ``CPUOffload(offload_params=True)``, or a plain True."""
    if cpu_offload is None or cpu_offload is False:
        return False
    if cpu_offload is True:
        return True
    if version == 2:
        return type(cpu_offload).__name__ == "CPUOffloadPolicy"
    return bool(getattr(cpu_offload, "offload_params", False))


def local_world_size(world_size: int) -> Optional[int]:
    """Processes per node (``LOCAL_WORLD_SIZE``, set by torchrun / accelerate launch), when it
    divides ``world_size``: FSDP1's ``HYBRID_SHARD`` without a device mesh shards within a node."""
    try:
        n = int(os.environ.get("LOCAL_WORLD_SIZE", ""))
    except ValueError:
        return None
    return n if 1 <= n <= world_size and world_size % n == 0 else None


def fsdp_plugin_settings(plugin: Any, world_size: int = 1) -> Dict[str, Any]:
    """``TrainSpec`` keywords of accelerate's ``FullyShardedDataParallelPlugin`` (after its
    ``__post_init__``, as the ``Accelerator`` holds it): ``fsdp_version``; FSDP2's
    ``reshard_after_forward`` (True: ``fsdp-full``, False: ``fsdp-grad-op``); FSDP1's
    ``sharding_strategy`` (or ``reshard_after_forward`` holding the strategy, accelerate's newer
    spelling); ``cpu_offload`` -> ``offload="params"``; ``HYBRID_SHARD`` -> ``shard_group_size`` from
    ``LOCAL_WORLD_SIZE`` (:func:`local_world_size`).

    Raises:
        ConfigError: a version or strategy the plugin should not hold.
    """
    version = getattr(plugin, "fsdp_version", 1) or 1
    if isinstance(version, bool) or str(version).strip() not in ("1", "2"):
        raise ConfigError("fsdp_version", "1 or 2", version)
    version = int(str(version).strip())
    out: Dict[str, Any] = {"fsdp_version": version}
    if version == 2:
        raf = getattr(plugin, "reshard_after_forward", True)
        out["sharding"] = "fsdp-grad-op" if raf is False else "fsdp-full"
    else:
        strat = getattr(plugin, "sharding_strategy", None)
        if strat is None:
            strat = getattr(plugin, "reshard_after_forward", None)
        out["sharding"] = fsdp1_sharding("FULL_SHARD" if strat is None or strat is True else
                                         "SHARD_GRAD_OP" if strat is False else strat)
        if out["sharding"] == "fsdp-hybrid":
            out["shard_group_size"] = local_world_size(world_size)
    out["offload"] = "params" if _offloads_params(getattr(plugin, "cpu_offload", None), version) else "none"
    return out


def ddp_handler_settings(handler: Any) -> Dict[str, Any]:
    """``TrainSpec`` keywords of accelerate's ``DistributedDataParallelKwargs`` (``bucket_cap_mb``
    None or absent: DDP's 25; ``gradient_as_bucket_view``)."""
    out: Dict[str, Any] = {"sharding": "ddp"}
    cap = getattr(handler, "bucket_cap_mb", None)
    if cap is not None:
        out["bucket_cap_mb"] = cap
    view = getattr(handler, "gradient_as_bucket_view", None)
    if isinstance(view, bool):
        out["gradient_as_bucket_view"] = view
    return out


def accelerate_settings(accelerator: Any, world_size: int) -> Dict[str, Any]:
    """``TrainSpec`` keywords of an accelerate ``Accelerator`` (or ``AcceleratorState``) running
    ``world_size`` processes, by the plugin its state holds, as HF ``Trainer`` decides
    (``is_deepspeed_enabled`` / ``is_fsdp_enabled``), then its ``distributed_type``: a DeepSpeed
    plugin -> :func:`zero_settings` of its ``deepspeed_config``; an FSDP plugin ->
    :func:`fsdp_plugin_settings`, and HSDP when
    ``parallelism_config`` has ``dp_replicate_size`` > 1 and ``dp_shard_size`` > 1
    (``fsdp-hybrid``, shard group ``dp_shard_size``); ``MULTI_*`` (accelerate wraps the model in
    ``DistributedDataParallel``: ``Accelerator.prepare_model``) -> ``ddp`` with the ``ddp_handler``'s
    settings. DeepSpeed counts at any world size (one process still keeps its fp32 partitions and
    buckets); the others need more than one process. ``{}`` otherwise (``NO``, ``XLA``, ...).

    Raises:
        ConfigError: as :func:`zero_settings` / :func:`fsdp_plugin_settings`.
    """
    if accelerator is None:
        return {}
    state = getattr(accelerator, "state", accelerator)
    dtype = _name(getattr(accelerator, "distributed_type", None) or getattr(state, "distributed_type", ""))
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is not None:
        cfg = getattr(plugin, "deepspeed_config", None)
        if cfg is None:
            cfg = getattr(getattr(plugin, "hf_ds_config", None), "config", None)
        return zero_settings(cfg) if cfg is not None else {}
    if world_size <= 1:
        return {}
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is not None:
        out = fsdp_plugin_settings(plugin, world_size)
        pc = getattr(accelerator, "parallelism_config", None) or getattr(state, "parallelism_config", None)
        rep, shard = getattr(pc, "dp_replicate_size", 1) or 1, getattr(pc, "dp_shard_size", 1) or 1
        if isinstance(rep, int) and isinstance(shard, int) and rep > 1 and shard > 1 and world_size % shard == 0:
            out.update(sharding="fsdp-hybrid", shard_group_size=shard)
        return out
    if dtype.startswith("MULTI_"):
        return ddp_handler_settings(getattr(accelerator, "ddp_handler", None))
    return {}
