"""Opt-in CUDA allocator snapshots for pytorch.org/memory_viz, taken when they explain something:
at chosen steps, on entering critical pressure, and when an out-of-memory error is caught.

It uses torch's private snapshot API (``torch.cuda.memory._record_memory_history`` and
``_dump_snapshot``, checked on torch 2.4-2.13; documented in "Understanding CUDA Memory Usage",
docs.pytorch.org/docs/stable/torch_cuda_memory.html). Cost: while recording, every allocation and
free stores an event with its stack trace (Python and C++ frames), which slows allocation-heavy
steps and keeps up to ``max_entries`` events in host memory; a dump writes a pickle of every live
block plus that history (tens to hundreds of MB on large runs). Off by default for that reason.
A failure here is logged and never reaches the training loop. torch is imported only when used.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable, Optional

__all__ = ["CudaSnapshots", "TORCH_CHECKED"]

_log = logging.getLogger("memguard.snapshots")

#: torch versions the private names were checked on.
TORCH_CHECKED = ">=2.4,<=2.13"


class CudaSnapshots:
    """Record CUDA allocator history and dump snapshots named ``rank{r}_step{n}_{reason}.pickle``.

    Args:
        out_dir: folder for the pickles (created when the first one is written).
        rank: this process's rank.
        max_entries: allocation / free events kept (the history's bound; torch's argument).
        at_steps: optimizer steps at which to dump (e.g. ``(3,)``).
        on_critical: dump once per episode of critical pressure (the monitor's level) or of a rise
            in ``num_alloc_retries`` (the caching allocator freeing its cache and retrying a
            ``cudaMalloc``: the step before an OOM).
        on_oom: dump when an out-of-memory error is caught (before the guard frees anything and
            retries).
        cuda_memory: stands in for ``torch.cuda.memory`` (tests).

    Raises:
        ConfigError: ``max_entries`` not a positive integer.
    """

    def __init__(self, out_dir: str, *, rank: int = 0, max_entries: int = 100_000,
                 at_steps: Iterable[int] = (), on_critical: bool = True, on_oom: bool = True,
                 cuda_memory: Any = None):
        from memguard_core.errors import require_positive_int

        self.out_dir = str(out_dir)
        self.rank = int(rank)
        self.max_entries = require_positive_int("snapshot_max_entries", max_entries)
        self.at_steps = frozenset(int(s) for s in at_steps)
        self.on_critical = bool(on_critical)
        self.on_oom = bool(on_oom)
        self._mem = cuda_memory
        self.recording = False
        self.written: list = []
        self._in_episode = False
        self._retries: Optional[int] = None

    def _memory(self) -> Any:
        if self._mem is None:
            import torch

            self._mem = torch.cuda.memory
        return self._mem

    def start(self) -> bool:
        """Start recording the allocator history; False (logged) when it cannot."""
        try:
            self._memory()._record_memory_history(max_entries=self.max_entries)
            self.recording = True
        except Exception as exc:
            _log.warning("memguard: CUDA snapshots off: cannot record the allocator history (%s)", exc)
        return self.recording

    def stop(self) -> None:
        """Stop recording (``enabled=None``)."""
        if self.recording:
            try:
                self._memory()._record_memory_history(enabled=None)
            except Exception as exc:
                _log.debug("memguard: stopping the allocator history failed: %s", exc)
            self.recording = False

    def dump(self, step: Optional[int], reason: str) -> Optional[str]:
        """Write ``rank{r}_step{n}_{reason}.pickle`` (``_{reason}-2``, ``-3``, ... for a second dump
        of the same step and reason, e.g. a window that fails again: none overwrites another); its
        path, or None (logged) on failure."""
        if not self.recording:
            return None
        stem = os.path.join(self.out_dir, f"rank{self.rank}_step{'x' if step is None else int(step)}_{reason}")
        path, n = stem + ".pickle", 1
        while path in self.written or os.path.exists(path):
            n += 1
            path = f"{stem}-{n}.pickle"
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self._memory()._dump_snapshot(path)
        except Exception as exc:
            _log.warning("memguard: CUDA snapshot %s not written (%s)", path, exc)
            return None
        self.written.append(path)
        _log.warning("memguard: CUDA allocator snapshot (%s, step %s): %s -- open it at pytorch.org/memory_viz",
                     reason, step, path)
        return path

    def step_end(self, step: int, level: Optional[str] = None) -> Optional[str]:
        """Call at each optimizer step end with the monitor's level (``ok`` / ``warn`` /
        ``critical`` / ``emergency``); dumps at a chosen step or at the start of an episode of
        critical pressure (a rise in ``num_alloc_retries`` counts as one)."""
        out = None
        if step in self.at_steps:
            out = self.dump(step, "step")
        pressed = str(level) in ("critical", "emergency") or self._retries_rose()
        if pressed and self.on_critical and not self._in_episode:
            out = self.dump(step, "critical") or out
        self._in_episode = pressed
        return out

    def oom(self, step: Optional[int], *, peer: bool = False) -> Optional[str]:
        """Call when an out-of-memory error is caught, before anything is freed (the guard does:
        ``Guard.snapshot_oom``): ``rank{r}_step{n}_oom.pickle``, ``n`` the optimizer steps completed
        (the event log's ``step`` of the ``oom_retry`` record); ``peer``: another rank failed and
        this one redoes with it (``_peer-oom``)."""
        return self.dump(step, "peer-oom" if peer else "oom") if self.on_oom else None

    def _retries_rose(self) -> bool:
        try:
            n = int(self._memory().memory_stats().get("num_alloc_retries", 0))
        except Exception:
            return False
        rose = self._retries is not None and n > self._retries
        self._retries = n
        return rose
