"""memguard for Hugging Face ``Trainer`` (and TRL / Unsloth, which subclass it).

    from memguard_hf import MemGuardCallback
    trainer.add_callback(MemGuardCallback())
"""

from .callback import MemGuardCallback, is_oom_error
from .resume import RESUME_ENV, resume_checkpoint

__all__ = ["MemGuardCallback", "is_oom_error", "resume_checkpoint", "RESUME_ENV"]
