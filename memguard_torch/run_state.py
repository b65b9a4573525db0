"""The state of a live training run that one extra forward + backward would change, kept and put
back exactly: every ``.grad``, the random number generators (torch's CPU, CUDA and MPS ones,
Python's ``random``, NumPy's global one), every buffer (BatchNorm's running statistics and
``num_batches_tracked``) and each module's ``training`` flag. Used by the in-process measurement
(:mod:`memguard_torch.preflight_probe`).
"""

from __future__ import annotations

import logging
import random
from typing import Any, List, Optional, Tuple

import torch

__all__ = ["RunState"]

log = logging.getLogger("memguard.preflight")


class RunState:
    """What :meth:`save` kept of ``model`` and the process; :meth:`restore` puts it back.

    Gradients are kept by reference, not copied: the probe sets every ``.grad`` to None, so its
    backward makes new tensors and never writes into the kept ones, which go back unchanged (the
    same tensor objects, so an optimizer or hook holding them sees no change). Buffers are copied
    (a forward in train mode updates them in place) and all written back: BatchNorm's kernel
    updates its running statistics without moving their version counter, so it cannot tell which
    changed.
    """

    def __init__(self, model: Any):
        self.model = model
        self.params: List[torch.nn.Parameter] = []
        self.grads: List[Optional[torch.Tensor]] = []
        self.buffers: List[Tuple[Any, str, torch.Tensor, torch.Tensor]] = []
        self.flags: List[Tuple[Any, bool]] = []
        self.rng: dict = {}

    @classmethod
    def save(cls, model: Any) -> "RunState":
        """Keep the run's state (see the module doc) and set every ``.grad`` of ``model`` to None.

        Raises:
            what torch raises copying a buffer (e.g. out of memory); nothing is changed then.
        """
        st = cls(model)
        st.rng = _rng_states()
        st.flags = [(m, m.training) for m in model.modules()]
        for m in model.modules():
            for name, buf in m.named_buffers(recurse=False):
                if buf is not None:
                    st.buffers.append((m, name, buf, buf.detach().clone()))
        st.params = list(model.parameters())
        st.grads = [p.grad for p in st.params]
        for p in st.params:
            p.grad = None
        return st

    def drop_grads(self) -> None:
        """Set every ``.grad`` to None (what a probe step's backward made goes)."""
        for p in self.params:
            p.grad = None

    def buffer_bytes(self) -> int:
        """Bytes of the buffer copies held."""
        return sum(c.numel() * c.element_size() for *_, c in self.buffers)

    def restore(self) -> List[str]:
        """Put everything back; each part separately, so one that fails leaves the others restored.

        Returns:
            what could not be restored, one phrase each (empty when all was). Never raises.
        """
        failed = []
        for what, fn in (("gradients", self._grads), ("buffers", self._buffers), ("train flags", self._flags),
                         ("random states", lambda: _set_rng_states(self.rng))):
            try:
                fn()
            except Exception as exc:  # the rest must still go back
                log.debug("memguard: %s not restored", what, exc_info=True)
                failed.append(f"{what} ({type(exc).__name__}: {exc})")
        return failed

    def _grads(self) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def _buffers(self) -> None:
        with torch.no_grad():
            for m, name, buf, copy in self.buffers:
                if getattr(m, name, None) is not buf:   # a forward that re-registered it
                    setattr(m, name, buf)
                buf.copy_(copy)

    def _flags(self) -> None:
        for m, flag in self.flags:
            m.training = flag


def _rng_states() -> dict:
    """Every generator a forward can draw from, by name."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():   # reading them would initialise CUDA otherwise
        states["cuda"] = torch.cuda.get_rng_state_all()
    mps = getattr(torch, "mps", None)
    if mps is not None and getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        states["mps"] = mps.get_rng_state()
    try:
        import numpy

        states["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
    if "mps" in states:
        torch.mps.set_rng_state(states["mps"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])
