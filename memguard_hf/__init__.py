"""memguard for Hugging Face ``Trainer`` (and TRL / Unsloth, which subclass it).

    from memguard_hf import MemGuardCallback
    trainer.add_callback(MemGuardCallback())
"""

from .callback import MemGuardCallback, is_oom_error
from .plan_args import plan_training_arguments
from .resume import RESUME_ENV, resume_checkpoint

__all__ = ["MemGuardCallback", "is_oom_error", "plan_training_arguments", "resume_checkpoint", "RESUME_ENV"]
