"""The options every adapter takes (HF and Lightning ``MemGuardCallback``, ``TorchGuard``,
``MlxGuard``), with the same names in all four, validated once, here, with errors that name the
field. The adapters hand the result to :class:`memguard_core.guard.Guard`; see docs/lifecycle.md.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Tuple, Union

from .errors import ConfigError, require_fraction, require_int, require_number
from .monitor import GrowPolicy, Thresholds

#: What a preflight may change in place.
APPLY_CHOICES = ("grad_checkpoint", "micro_batch")
#: How chunk losses are weighted.
LOSS_WEIGHTINGS = ("auto", "tokens", "rows")
#: The environment variable with the starting number of micro-batches per batch (``memguard run``
#: sets it after an out-of-memory kill).
MICRO_BATCHES_ENV = "MEMGUARD_MICRO_BATCHES"
_DEVICE = re.compile(r"auto|cpu|mlx|mps|cuda(:\d+)?")


def _positive_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _positive_number(value: object) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and value > 0)


def micro_batches_from_env(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The starting micro-batches per batch from the environment (``MEMGUARD_MICRO_BATCHES``); None
    when it is not set.

    Raises:
        ConfigError: the value is not an integer >= 1 (the error names the variable).
    """
    env = os.environ if env is None else env
    name = MICRO_BATCHES_ENV
    raw = env.get(name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, "an integer >= 1", raw) from None
    if value < 1:
        raise ConfigError(name, "an integer >= 1", raw)
    return value


@dataclass(frozen=True)
class GuardOptions:
    """Validated guard options, shared by the three adapters.

    Attributes:
        budget_bytes: memory the training process may use (bytes); None: (memory the process holds
            + memory available) x ``safety_ratio`` at train start, container-aware.
        safety_ratio: fraction of the available memory that the default budget takes (0 < r <= 1).
        thresholds: the monitor's levels (``memguard_core.monitor.Thresholds``).
        seq_length: tokens per row for the preflight (None: read from the run).
        apply: what the preflight may change in place (``grad_checkpoint``, ``micro_batch``).
        fail_fast: raise ``DoesNotFitError`` at train start when the plan needs a change that cannot
            be applied in place or nothing fits (and re-raise a preflight that cannot read the run).
        loss_weighting: ``auto`` | ``tokens`` | ``rows`` (the torch adapters' chunk loss weights).
        micro_batches: micro-batches each batch is cut into at the start (>= 1; the guard raises it
            under pressure). Falls back to ``MEMGUARD_MICRO_BATCHES`` in the environment, then 1.
        eval_micro_batches: micro-batches each evaluation / validation / prediction batch is cut
            into at the start (>= 1, default 1); doubled after an out-of-memory error there, never
            shared with the training split (docs/evaluation.md).
        monitor_interval_s: background sampling period in seconds (0: no thread).
        device: which memory to probe (``auto`` | ``cpu`` | ``cuda`` | ``cuda:<i>`` | ``mps`` | ``mlx``).
        preflight: estimate and plan at train start.
        preflight_probe: before planning, run one forward + backward of the live model at one row of
            a few hundred tokens (two sizes), read on the device's own counter, and correct the
            estimate by what it saw (docs/estimator.md, "In-process measurement"): ``"auto"``
            (default) where it costs a few seconds at most (CUDA / MPS; CPU for a model small
            enough), ``True`` always, ``False`` never. The torch adapters; nothing on mlx_lm.
        grow: when the number of micro-batches may halve again after pressure has gone
            (``memguard_core.monitor.GrowPolicy``; None: never).
        log_dir: folder of the run event log (``memguard_core.events``: one JSONL file per rank);
            None: ``MEMGUARD_LOG_DIR`` from the environment at train start, else no log.
        cuda_snapshots: folder for CUDA allocator snapshots (``memguard_torch.cuda_snapshots``:
            history recorded from train start, dumps on entering critical pressure, on a caught
            out-of-memory error and at ``snapshot_steps``); None: ``MEMGUARD_CUDA_SNAPSHOTS``, else off.
            Only on CUDA devices; it costs time per allocation, see that module.
        snapshot_steps: optimizer steps at which to dump a CUDA snapshot.
        leak_detector: warn when the process figure at step boundaries rises step after step
            (``memguard_core.leak``; the torch adapters; MLX has its own on active memory).
        trim_heap: on a CPU device on Linux, hand glibc's free heap back to the kernel
            (``malloc_trim(0)``) after every optimizer step, so that holes the step's allocation
            sizes left do not count against the budget in the next; and, for a mixture-of-experts
            model computing in bf16 / fp16 there, fix glibc's mmap threshold at 4 MiB at train
            start (``mallopt``; needs the preflight, which reads the model), for the rest of the
            process (docs/monitor.md, "The CPU heap
            between steps"). Nothing on CUDA, MPS, MLX or other hosts.
        reset_peak_rss: on a CPU device on Linux, reset the process's peak resident set (VmHWM,
            through ``/proc/self/clear_refs``) at every step sample, so each sample reads its own
            step's peak; the process's peak over its life is kept and reported as
            ``process_peak_rss_bytes`` (run summary, event log) and VmHWM is raised back to it at
            train end where memory allows, so ``ru_maxrss`` and ``time -v`` read it then. False:
            VmHWM is never reset; a step's peak is VmHWM where the step raised it (exact), else the
            largest RSS the samples read (a lower bound: the transient between two samples is
            missed). docs/monitor.md, "The process's own peak". Nothing on CUDA,
            MPS, MLX or other hosts (their OS peak is never reset).
    """

    budget_bytes: Optional[int] = None
    safety_ratio: float = 0.8
    thresholds: Thresholds = Thresholds()
    seq_length: Optional[int] = None
    apply: Tuple[str, ...] = APPLY_CHOICES
    fail_fast: bool = False
    loss_weighting: str = "auto"
    micro_batches: int = 1
    eval_micro_batches: int = 1
    monitor_interval_s: float = 0.5
    device: str = "auto"
    preflight: bool = True
    preflight_probe: Union[bool, str] = "auto"
    grow: Optional[GrowPolicy] = GrowPolicy()
    log_dir: Optional[str] = None
    cuda_snapshots: Optional[str] = None
    snapshot_steps: Tuple[int, ...] = ()
    leak_detector: bool = True
    trim_heap: bool = True
    reset_peak_rss: bool = True

    @classmethod
    def from_kwargs(cls, *, budget_bytes: Optional[float] = None, safety_ratio: float = 0.8,
                    thresholds: Optional[Thresholds] = None, seq_length: Optional[int] = None,
                    apply: Sequence[str] = APPLY_CHOICES, fail_fast: bool = False, loss_weighting: str = "auto",
                    micro_batches: Optional[int] = None, monitor_interval_s: float = 0.5, device: str = "auto",
                    preflight: bool = True, grow: Optional[GrowPolicy] = GrowPolicy(),
                    budget_gib: Optional[float] = None,
                    log_dir: Optional[str] = None, cuda_snapshots: Optional[str] = None,
                    snapshot_steps: Sequence[int] = (), leak_detector: bool = True,
                    eval_micro_batches: int = 1, trim_heap: bool = True,
                    reset_peak_rss: bool = True, preflight_probe: Union[bool, str] = "auto") -> "GuardOptions":
        """Validate and normalise. ``budget_bytes`` takes an int or a float (bytes, rounded down:
        ``8.5e9``); ``budget_gib`` gives the budget in GiB instead (not both).

        Raises:
            ConfigError: naming the first bad field (``MEMGUARD_MICRO_BATCHES`` for a bad environment
                value).
        """
        if budget_gib is not None:
            if budget_bytes is not None:
                raise ConfigError("budget_gib", "not given together with budget_bytes", budget_gib)
            if not _positive_number(budget_gib):
                raise ConfigError("budget_gib", "a finite number of GiB > 0, or None", budget_gib)
            budget_bytes = int(budget_gib * 2**30)
        if budget_bytes is not None:
            if not _positive_number(budget_bytes) or int(budget_bytes) < 1:
                raise ConfigError("budget_bytes", "a finite number of bytes >= 1 (int or float), or None", budget_bytes)
            budget_bytes = int(budget_bytes)
        ratio = require_fraction("safety_ratio", safety_ratio)
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise ConfigError("thresholds", "a memguard_core.monitor.Thresholds", thresholds)
        require_int("seq_length", seq_length, "an integer >= 1", allow_none=True)
        if isinstance(apply, str):
            apply = (apply,)
        if not all(a in APPLY_CHOICES for a in apply):
            raise ConfigError("apply", f"a subset of {APPLY_CHOICES}", list(apply))
        if loss_weighting not in LOSS_WEIGHTINGS:
            raise ConfigError("loss_weighting", "'auto', 'tokens' or 'rows'", loss_weighting)
        if micro_batches is None:
            micro_batches = micro_batches_from_env()
        else:
            require_int("micro_batches", micro_batches, "an integer >= 1")
        require_int("eval_micro_batches", eval_micro_batches, "an integer >= 1")
        require_number("monitor_interval_s", monitor_interval_s, "a number of seconds >= 0", lo=0.0)
        if not isinstance(device, str) or _DEVICE.fullmatch(device) is None:
            raise ConfigError("device", '"auto", "cpu", "cuda", "cuda:<index>", "mps" or "mlx"', device)
        for name, flag in (("fail_fast", fail_fast), ("preflight", preflight)):
            if not isinstance(flag, bool):
                raise ConfigError(name, "True or False", flag)
        if preflight_probe != "auto" and not isinstance(preflight_probe, bool):
            raise ConfigError("preflight_probe", '"auto", True or False', preflight_probe)
        if grow is not None and not isinstance(grow, GrowPolicy):
            raise ConfigError("grow", "a memguard_core.monitor.GrowPolicy, or None", grow)
        for name, folder in (("log_dir", log_dir), ("cuda_snapshots", cuda_snapshots)):
            if folder is not None and (not isinstance(folder, (str, os.PathLike)) or not str(folder)
                                       or (os.path.exists(folder) and not os.path.isdir(folder))):
                raise ConfigError(name, "a folder path (created when missing), or None", folder)
        if isinstance(snapshot_steps, int):
            snapshot_steps = (snapshot_steps,)
        if not all(_positive_int(s) for s in snapshot_steps):
            raise ConfigError("snapshot_steps", "optimizer steps (integers >= 1)", snapshot_steps)
        for name, flag in (("leak_detector", leak_detector), ("trim_heap", trim_heap),
                           ("reset_peak_rss", reset_peak_rss)):
            if not isinstance(flag, bool):
                raise ConfigError(name, "True or False", flag)
        return cls(budget_bytes=budget_bytes, safety_ratio=ratio, thresholds=thresholds or Thresholds(),
                   seq_length=seq_length, apply=tuple(apply), fail_fast=fail_fast, loss_weighting=loss_weighting,
                   micro_batches=micro_batches or 1, monitor_interval_s=float(monitor_interval_s), device=device,
                   preflight=preflight, grow=grow, log_dir=None if log_dir is None else os.fspath(log_dir),
                   cuda_snapshots=None if cuda_snapshots is None else os.fspath(cuda_snapshots),
                   snapshot_steps=tuple(int(s) for s in snapshot_steps), leak_detector=leak_detector,
                   eval_micro_batches=eval_micro_batches, trim_heap=trim_heap, reset_peak_rss=reset_peak_rss,
                   preflight_probe=preflight_probe)


#: The keyword names every adapter takes for its :class:`GuardOptions` (those of
#: :meth:`GuardOptions.from_kwargs`).
GUARD_OPTION_NAMES: Tuple[str, ...] = tuple(inspect.signature(GuardOptions.from_kwargs).parameters)


def option_kwargs(options: Mapping[str, object], own: Sequence[str] = ()) -> Mapping[str, object]:
    """Check that an adapter's ``**options`` are guard options; returns them unchanged for
    ``GuardOptions.from_kwargs(**...)``.

    Args:
        options: the keywords the adapter got beside its own.
        own: the adapter's own keyword names (listed in the error).

    Raises:
        ConfigError: naming the first unknown keyword and the names that are taken.
    """
    unknown = sorted(set(options) - set(GUARD_OPTION_NAMES))
    if unknown:
        names = ", ".join(list(own) + [n for n in GUARD_OPTION_NAMES if n not in own])
        raise ConfigError(unknown[0], f"a memguard option (one of: {names})", options[unknown[0]])
    return options


def with_guard_options(init: Callable) -> Callable:
    """Decorate an adapter's ``__init__(self, *, <own keywords>, **options)``: its signature, as
    ``help()``, ``inspect.signature`` and IDEs show it, lists the guard options by name, with
    their defaults, after the adapter's own keywords. The options themselves are passed to
    :func:`option_kwargs` and :meth:`GuardOptions.from_kwargs` in the body, in one place."""
    sig = inspect.signature(init)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    shared = [p for p in inspect.signature(GuardOptions.from_kwargs).parameters.values()
              if p.name not in sig.parameters]
    init.__signature__ = sig.replace(parameters=own + shared)
    return init
