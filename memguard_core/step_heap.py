"""The CPU heap of a guarded run between steps (``GuardOptions.trim_heap``): glibc's mmap threshold
fixed for a mixture-of-experts run in half precision, and the free heap handed back to the kernel
after each optimizer step. A mixin of :class:`memguard_core.guard.Guard` (it uses ``options``,
``log`` and ``_specs``); why: docs/monitor.md, "The CPU heap between steps".
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["StepHeap", "fix_mmap_threshold"]

#: glibc's mmap threshold was fixed in this process (:func:`fix_mmap_threshold`): it cannot be
#: undone, so a second start (Lightning's second ``fit``) neither sets nor logs it again.
_MMAP_THRESHOLD_PINNED = False


def fix_mmap_threshold(model_spec: Any, train_spec: Any) -> bool:
    """For a run :func:`memguard_core.estimator.trainable.routed_half_precision_on_cpu` names (a mixture-of-experts
    model computing in bf16 / fp16 on a CPU), fix glibc's mmap threshold at
    ``probes.MOE_MMAP_THRESHOLD_BYTES`` for the rest of the process (``probes.pin_mmap_threshold``),
    once per process. What the guard does at train start under ``GuardOptions.trim_heap``; the
    bench's training children call it to measure a guarded run.

    Returns:
        True when this call fixed it; False for other runs, when it was fixed before, or where
        the C library cannot (``probes.pin_mmap_threshold`` never raises).
    """
    global _MMAP_THRESHOLD_PINNED
    from .probes import pin_mmap_threshold
    from .estimator.trainable import routed_half_precision_on_cpu

    if _MMAP_THRESHOLD_PINNED or not routed_half_precision_on_cpu(model_spec, train_spec):
        return False
    _MMAP_THRESHOLD_PINNED = pin_mmap_threshold()
    return _MMAP_THRESHOLD_PINNED


class StepHeap:
    """The heap moments of :class:`memguard_core.guard.Guard` (see the module doc)."""

    _trim_device: Optional[bool] = None   # trim_heap applies here (resolved at the first step end)

    def _pin_mmap_threshold(self) -> None:
        """``trim_heap``: :func:`fix_mmap_threshold` for the specs the preflight read (whether or
        not a plan fitted), before the first forward, logged when it fixes the threshold. The
        step-end trim returns what a step left; within a step, a bf16 MoE run's freed tensors would
        otherwise stay resident beside oneDNN's cache entries (docs/monitor.md, "The CPU heap
        between steps"). Without a preflight (``preflight=False``, or specs that could not be read)
        nothing is fixed. Never raises."""
        try:
            if not (self.options.trim_heap and self._specs is not None):
                return
            if fix_mmap_threshold(*self._specs):
                from .probes import MOE_MMAP_THRESHOLD_BYTES

                mib = MOE_MMAP_THRESHOLD_BYTES / 2**20
                self.log.info("memguard: glibc's mmap threshold fixed at %g MiB for this process (a mixture-of-"
                              "experts model in %s on the CPU: tensors of %g MiB and more go back to the kernel "
                              "when freed instead of staying in the heap as holes; GuardOptions(trim_heap=False) "
                              "leaves malloc alone)", mib, self._specs[1].dtype, mib)
        except Exception:
            self.log.debug("memguard: mmap threshold left alone", exc_info=True)

    def _trim_step_heap(self) -> None:
        """``trim_heap``: after the step's peak was read, glibc's free heap goes back to the kernel
        on a CPU device (``probes.trim_heap``). The sizes a step allocates change from step to step
        (mixture-of-experts routing, ragged batches): new sizes do not fit the holes the last step
        left, the heap grows, and the holes stay resident and count in RSS until trimmed
        (docs/monitor.md, "The CPU heap between steps"). Never raises."""
        try:
            if self._trim_device is None:
                from .probes import resolve_device

                # probes.trim_heap itself does nothing off glibc / Linux
                self._trim_device = bool(self.options.trim_heap and resolve_device(self.options.device) == "cpu")
            if self._trim_device:
                from .probes import trim_heap

                trim_heap()
        except Exception:
            self._trim_device = False
            self.log.debug("memguard: heap trim off", exc_info=True)
