"""The parallel layout of a ``TrainSpec`` (``world_size``, ``sharding``, ``offload``, ``shard_group_size``,
DDP buckets, FSDP version, DeepSpeed buckets) and its validation, apart from the per-rank rules
(:mod:`.sharding`), so that the types import no rule. docs/distributed.md.
"""

from __future__ import annotations

import math

from ..errors import ConfigError, require_choice

SHARDINGS = ("none", "ddp", "fsdp-full", "fsdp-grad-op", "fsdp-hybrid", "fsdp-no-shard", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "params")
#: The keys of ``TrainSpec.zero_buckets``, in the order of ``sharding.ZERO_BUCKETS``' entries.
ZERO_BUCKET_KEYS = ("reduce", "allgather", "prefetch", "max_live", "persistence", "overlap_comm")


def validate_sharding(ts) -> None:
    """Check the sharding fields of a TrainSpec (called from ``TrainSpec.__post_init__``).

    Raises:
        ConfigError: an unknown ``sharding`` / ``offload``; an offload the layout has no such thing
            for (``ddp`` / ``none``: none; FSDP: ``params``, which moves gradients and optimizer
            states too; ZeRO-1/2: ``optimizer``); ``shard_group_size`` outside ``fsdp-hybrid`` or
            not dividing ``world_size``; ``bucket_cap_mb`` <= 0; ``fsdp_version`` not 1 or 2;
            sharding under ``framework="mlx"``.
    """
    object.__setattr__(ts, "sharding", require_choice("sharding", ts.sharding, SHARDINGS))
    object.__setattr__(ts, "offload", require_choice("offload", ts.offload, OFFLOADS))
    s, o = ts.sharding, ts.offload
    allowed = {"none": ("none",), "ddp": ("none",), "zero1": ("none", "optimizer"),
               "zero2": ("none", "optimizer"), "zero3": OFFLOADS}.get(s, ("none", "params"))
    if o not in allowed:
        raise ConfigError("offload", f"one of {', '.join(allowed)} with sharding={s!r}", o)
    g = ts.shard_group_size
    if g is not None:
        if s != "fsdp-hybrid":
            raise ConfigError("shard_group_size", "None unless sharding='fsdp-hybrid'", g)
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or ts.world_size % g:
            raise ConfigError("shard_group_size", f"a positive divisor of world_size={ts.world_size}", g)
    b = ts.bucket_cap_mb
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b > 0) or math.isinf(b):
        raise ConfigError("bucket_cap_mb", "a positive number of MiB (DDP's default: 25)", b)
    if not isinstance(ts.gradient_as_bucket_view, bool):
        raise ConfigError("gradient_as_bucket_view", "True or False", ts.gradient_as_bucket_view)
    if ts.fsdp_version not in (1, 2) or isinstance(ts.fsdp_version, bool):
        raise ConfigError("fsdp_version", "1 (FullyShardedDataParallel) or 2 (fully_shard)", ts.fsdp_version)
    if s != "none" and ts.framework == "mlx":
        raise ConfigError("sharding", "'none' with framework='mlx' (mlx_lm has no DDP/FSDP/ZeRO)", s)
    zb = ts.zero_buckets
    if zb is not None:
        if not s.startswith("zero"):
            raise ConfigError("zero_buckets", f"None unless sharding is zero1/zero2/zero3 (sharding={s!r})", zb)
        keys = ZERO_BUCKET_KEYS
        if not isinstance(zb, dict) or any(k not in keys for k in zb):
            raise ConfigError("zero_buckets", f"a dict with keys among {', '.join(keys)}", zb)
        for k, v in zb.items():
            ok = isinstance(v, bool) if k == "overlap_comm" else (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
            if not ok:
                raise ConfigError(f"zero_buckets[{k!r}]", "True or False" if k == "overlap_comm"
                                  else "an integer number of elements >= 0", v)
