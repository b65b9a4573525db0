"""memguard for mlx_lm: ``memguard_mlx.train`` (a guarded drop-in for ``mlx_lm.tuner.trainer.train``),
MLX memory controls, a leak detector and memory utilities (peak profile, timeline, batch-size search).

Importing this package imports mlx and mlx_lm (install the ``[mlx]`` extra).
"""

from memguard_core.extras import require as _require

_require("memguard_mlx", ['mlx', 'mlx_lm'], "mlx")

from .framework import register as _register

_register()   # the core's cache clean reaches mx.clear_cache() from here on

from .probes import register as _register_probes

_register_probes()   # the core's probes and device="auto" see mlx from here on

from .memory import (LeakDetector, LeakReport, MemoryControls, MemoryTimeline, PeakProfile,
                     find_max_batch_size, is_allocation_error, profile_peak)
from .specs import model_spec_from_mlx_module, train_spec
from .trainer import MlxGuard, MlxPreflight, default_budget, run_preflight, train
from .resume import resume_adapter_file
from .eval import GuardedEval, evaluate

__all__ = ["train", "MlxGuard", "MlxPreflight", "run_preflight", "default_budget", "MemoryControls",
           "LeakDetector", "LeakReport", "profile_peak", "PeakProfile", "MemoryTimeline",
           "find_max_batch_size", "is_allocation_error", "model_spec_from_mlx_module",
           "train_spec", "evaluate", "GuardedEval", "resume_adapter_file"]
