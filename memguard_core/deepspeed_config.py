"""The layout a DeepSpeed config (``zero_optimization``) sets, as ``TrainSpec`` keywords: the JSON
config HF ``Trainer`` (``TrainingArguments.deepspeed``), accelerate (``DeepSpeedPlugin.deepspeed_config``),
Lightning (``DeepSpeedStrategy.config``) and ``memguard estimate --deepspeed`` hold. A plain file
format, read without DeepSpeed; the torch adapters read FSDP / DDP / accelerate objects in
``memguard_torch.sharding_settings``. docs/distributed.md, "Where the adapters read the layout".
"""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

from .errors import ConfigError
from .estimator.sharding import ZERO_BUCKETS

__all__ = ["ZERO_BUCKET_KEYS", "deepspeed_config", "zero_settings"]

#: DeepSpeed ``zero_optimization`` keys -> ``TrainSpec.zero_buckets`` keys
#: (``deepspeed/runtime/zero/config.py``, 0.19.8; its model takes a field's name as well as its
#: ``stage3_`` alias, ``populate_by_name``; the alias first).
ZERO_BUCKET_KEYS = {"reduce_bucket_size": "reduce", "allgather_bucket_size": "allgather",
                    "stage3_prefetch_bucket_size": "prefetch", "prefetch_bucket_size": "prefetch",
                    "stage3_max_live_parameters": "max_live", "max_live_parameters": "max_live",
                    "stage3_param_persistence_threshold": "persistence", "param_persistence_threshold": "persistence",
                    "overlap_comm": "overlap_comm"}

_OFFLOAD_DEVICES = ("cpu", "nvme")


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
