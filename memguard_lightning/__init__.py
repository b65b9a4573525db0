"""Lightning adapter of memguard: ``L.Trainer(callbacks=[MemGuardCallback()])``.

See :mod:`memguard_lightning.callback` for what it does and how the in-place micro-batch split
runs inside Lightning's automatic optimization.
"""

from memguard_core.extras import require as _require

_require("memguard_lightning", ['torch', 'lightning'], "lightning")

from .callback import MemGuardCallback
from .resume import resume_checkpoint

__all__ = ["MemGuardCallback", "resume_checkpoint"]
