"""The options every adapter's guard takes (HF and Lightning ``MemGuardCallback``, ``MlxGuard``),
validated once, here, with errors that name the field.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Optional, Sequence, Tuple

from .errors import ConfigError, require_fraction
from .monitor import Thresholds

#: What a preflight may change in place.
APPLY_CHOICES = ("grad_checkpoint", "micro_batch")
#: How chunk losses are weighted.
LOSS_WEIGHTINGS = ("auto", "tokens", "rows")
_DEVICE = re.compile(r"auto|cpu|mlx|cuda(:\d+)?")
#: Fields of ``GuardOptions`` that an adapter (HF and Lightning ``MemGuardCallback``, ``MlxGuard``)
#: keeps under another public name: the monitor's ``split`` is the live one, and ``preflight``
#: holds the preflight's result there. Every other field keeps its own name.
ADAPTER_NAMES = {"split": "initial_split", "preflight": "do_preflight"}


@dataclass(frozen=True)
class GuardOptions:
    """Validated guard options (see the adapters' docstrings for their meaning).

    ``split`` falls back to the ``MEMGUARD_SPLIT`` environment variable (set by ``memguard run``
    after an out-of-memory kill), then to 1.
    """

    budget_bytes: Optional[int] = None
    safety_ratio: float = 0.8
    thresholds: Thresholds = Thresholds()
    seq_length: Optional[int] = None
    apply: Tuple[str, ...] = APPLY_CHOICES
    fail_fast: bool = False
    loss_weighting: str = "auto"
    split: int = 1
    monitor_interval_s: float = 0.5
    device: str = "auto"
    preflight: bool = True

    @classmethod
    def from_kwargs(cls, *, budget_bytes: Optional[int] = None, safety_ratio: float = 0.8,
                    thresholds: Optional[Thresholds] = None, seq_length: Optional[int] = None,
                    apply: Sequence[str] = APPLY_CHOICES, fail_fast: bool = False, loss_weighting: str = "auto",
                    split: Optional[int] = None, monitor_interval_s: float = 0.5, device: str = "auto",
                    preflight: bool = True) -> "GuardOptions":
        """Validate and normalise.

        Raises:
            ConfigError: naming the first bad field (``MEMGUARD_SPLIT`` for a bad environment value).
        """
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                         or budget_bytes <= 0):
            raise ConfigError("budget_bytes", "a positive integer number of bytes or None", budget_bytes)
        ratio = require_fraction("safety_ratio", safety_ratio)
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise ConfigError("thresholds", "a memguard_core.monitor.Thresholds", thresholds)
        if seq_length is not None and (isinstance(seq_length, bool) or not isinstance(seq_length, int)
                                       or seq_length < 1):
            raise ConfigError("seq_length", "an integer >= 1", seq_length)
        if isinstance(apply, str):
            apply = (apply,)
        if not all(a in APPLY_CHOICES for a in apply):
            raise ConfigError("apply", f"a subset of {APPLY_CHOICES}", list(apply))
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ConfigError("loss_weighting", "'auto', 'tokens' or 'rows'", loss_weighting)
        env_split = os.environ.get("MEMGUARD_SPLIT")
        if split is None and env_split:
            try:
                split = int(env_split)
            except ValueError:
                raise ConfigError("MEMGUARD_SPLIT", "an integer >= 1", env_split) from None
            if split < 1:
                raise ConfigError("MEMGUARD_SPLIT", "an integer >= 1", env_split)
        if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
            raise ConfigError("split", "an integer >= 1", split)
        if isinstance(monitor_interval_s, bool) or not isinstance(monitor_interval_s, (int, float)) \
                or monitor_interval_s < 0:
            raise ConfigError("monitor_interval_s", "a number of seconds >= 0", monitor_interval_s)
        if not isinstance(device, str) or _DEVICE.fullmatch(device) is None:
            raise ConfigError("device", '"auto", "cpu", "cuda", "cuda:<index>" or "mlx"', device)
        for name, flag in (("fail_fast", fail_fast), ("preflight", preflight)):
            if not isinstance(flag, bool):
                raise ConfigError(name, "True or False", flag)
        return cls(budget_bytes=budget_bytes, safety_ratio=ratio, thresholds=thresholds or Thresholds(),
                   seq_length=seq_length, apply=tuple(apply), fail_fast=fail_fast, loss_weighting=loss_weighting,
                   split=split or 1, monitor_interval_s=float(monitor_interval_s), device=device,
                   preflight=preflight)

    def set_on(self, adapter: object, skip: Sequence[str] = ()) -> None:
        """Set every option on ``adapter`` under its public name (``ADAPTER_NAMES``), except
        the fields named in ``skip`` (options the adapter does not have, e.g. ``MlxGuard`` has no
        ``loss_weighting`` nor ``device``). The adapters' ``__init__`` call this once, after
        ``from_kwargs``.

        Raises:
            ConfigError: ``skip`` names something that is not a field.
        """
        names = [f.name for f in fields(self)]
        for name in skip:
            if name not in names:
                raise ConfigError("skip", f"field names among {tuple(names)}", name)
        for name in names:
            if name not in skip:
                setattr(adapter, ADAPTER_NAMES.get(name, name), getattr(self, name))
