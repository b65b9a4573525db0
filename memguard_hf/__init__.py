"""memguard for Hugging Face ``Trainer`` (and TRL / Unsloth, which subclass it).

    from memguard_hf import MemGuardCallback
    trainer.add_callback(MemGuardCallback())
"""

from memguard_core.extras import require as _require

_require("memguard_hf", ['torch', 'transformers', 'accelerate'], "hf")

from .callback import MemGuardCallback, is_oom_error
from .plan_args import plan_training_arguments
from .resume import RESUME_ENV, resume_checkpoint

__all__ = ["MemGuardCallback", "is_oom_error", "plan_training_arguments", "resume_checkpoint", "RESUME_ENV"]
