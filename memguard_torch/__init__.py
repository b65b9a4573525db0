"""Memory guard for plain PyTorch and accelerate training loops: ``TorchGuard``.

See :mod:`memguard_torch.guard` for the loop and docs/torch_loop.md for the design (chunks, DDP,
FSDP2, the sync points that let every rank survive one rank's out-of-memory error).
"""

from memguard_core.extras import require as _require

_require("memguard_torch", ['torch'], "torch")

from .framework import register as _register

_register()   # the core's cache clean, rank agreement and CUDA counters go through torch from here on

from .probes import register as _register_probes

_register_probes()   # the core's probes and device="auto" see cuda and mps from here on

from .guard import TorchGuard
from .oom import is_oom_error
from .sync import PeerOutOfMemoryError

__all__ = ["TorchGuard", "PeerOutOfMemoryError", "is_oom_error"]
