"""What the torch frameworks' own settings say about the data-parallel layout, as ``TrainSpec``
keywords: FSDP1 ``ShardingStrategy``, accelerate's ``FullyShardedDataParallelPlugin``,
``DistributedDataParallelKwargs`` and ``Accelerator`` (DeepSpeed configs: ``memguard_core.deepspeed_config``).
Objects are read by their public attribute names (duck typing). Each function returns ``{}`` when
its source says nothing about the layout; a value present but not understood raises ``ConfigError``
naming it (the adapters log that and go on with the single-process estimate).
docs/distributed.md, "Where the adapters read the layout".
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from memguard_core.deepspeed_config import zero_settings
from memguard_core.errors import ConfigError

__all__ = ["FSDP1_STRATEGIES", "fsdp1_sharding", "local_world_size", "fsdp_plugin_settings",
           "ddp_handler_settings", "accelerate_settings"]

#: FSDP1 ``ShardingStrategy`` -> ``TrainSpec.sharding`` (``torch/distributed/fsdp/api.py``;
#: accelerate numbers them 1-5 in this order: ``accelerate/utils/constants.py``
#: ``FSDP_SHARDING_STRATEGY``). ``_HYBRID_SHARD_ZERO2`` keeps every block unsharded from its forward
#: to its backward inside the shard group, which ``fsdp-hybrid`` does not count: see
#: docs/distributed.md, "Where the adapters read the layout".
FSDP1_STRATEGIES = {"FULL_SHARD": "fsdp-full", "SHARD_GRAD_OP": "fsdp-grad-op", "NO_SHARD": "fsdp-no-shard",
                    "HYBRID_SHARD": "fsdp-hybrid", "HYBRID_SHARD_ZERO2": "fsdp-hybrid",
                    "_HYBRID_SHARD_ZERO2": "fsdp-hybrid"}
_FSDP1_BY_NUMBER = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")

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
