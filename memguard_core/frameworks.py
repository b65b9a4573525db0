"""What a framework package lends the framework-free core: its cache cleaner, its rank agreement,
its CUDA allocator readers. ``memguard_torch`` and ``memguard_mlx`` register theirs when they are
imported (every guard is built by an adapter, so they are registered before a guard runs); the core
asks here and never imports a framework (docs/design.md, "Layers").

Each lookup answers the framework-free default when nothing is registered: no cache to clean, one
rank, no CUDA counters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

logger = logging.getLogger("memguard.frameworks")

__all__ = ["Framework", "register", "registered", "clean_caches", "agree_max", "rank",
           "cuda_memory_stats", "cuda_snapshots", "cuda_available"]


@dataclass(frozen=True)
class Framework:
    """One framework's services to the core; any may be None (the framework has no such thing).

    Attributes:
        name: the framework (``torch``, ``mlx``).
        clean_caches: hands the framework's cached device blocks back (``torch.cuda.empty_cache``,
            ``mx.clear_cache``); must not raise.
        agree_max: ``k -> the MAX of k over the data-parallel ranks`` (``k`` itself with one rank);
            may raise what the collective raises.
        rank: this process's data-parallel rank, or None outside a process group.
        cuda_memory_stats: a callable returning the CUDA caching allocator's counters
            (``torch.cuda.memory_stats()`` keys), or None when CUDA is not in use.
        cuda_snapshots: ``(folder, rank, at_steps) -> recorder`` of allocator snapshots with
            ``start() -> bool``, ``step_end(step, level)``, ``oom(step, peer=...)``, ``stop()``.
        cuda_available: whether this process can train on CUDA (``torch.cuda.is_available()``).
    """

    name: str
    clean_caches: Optional[Callable[[], None]] = None
    agree_max: Optional[Callable[[int], int]] = None
    rank: Optional[Callable[[], Optional[int]]] = None
    cuda_memory_stats: Optional[Callable[[], Dict[str, Any]]] = None
    cuda_snapshots: Optional[Callable[..., Any]] = None
    cuda_available: Optional[Callable[[], bool]] = None


_REGISTERED: Dict[str, Framework] = {}


def register(framework: Framework) -> None:
    """Register (or replace, by name) a framework's services."""
    _REGISTERED[framework.name] = framework


def registered() -> List[Framework]:
    """The registered frameworks, in registration order."""
    return list(_REGISTERED.values())


def _first(attr: str) -> Optional[Callable]:
    return next((getattr(f, attr) for f in _REGISTERED.values() if getattr(f, attr) is not None), None)


def clean_caches() -> None:
    """Every registered framework's cache cleaner (a failing one is logged at DEBUG; never raises)."""
    for f in list(_REGISTERED.values()):
        if f.clean_caches is None:
            continue
        try:
            f.clean_caches()
        except Exception as exc:  # a broken device must not stop the clean of the others
            logger.debug("memguard: %s cache clean failed: %r", f.name, exc)


def agree_max(k: int) -> int:
    """The MAX of ``k`` over the data-parallel ranks through the registered collective; ``k`` itself
    when none is registered.

    Raises:
        whatever the collective raises (a dead peer, a timeout): callers log it and keep ``k``.
    """
    fn = _first("agree_max")
    return int(k) if fn is None else int(fn(int(k)))


def rank() -> Optional[int]:
    """This process's data-parallel rank from the registered framework, or None (never raises)."""
    fn = _first("rank")
    try:
        return None if fn is None else fn()
    except Exception:
        return None


def cuda_memory_stats() -> Optional[Callable[[], Dict[str, Any]]]:
    """The registered reader of the CUDA allocator's counters, or None."""
    return _first("cuda_memory_stats")


def cuda_snapshots() -> Optional[Callable[..., Any]]:
    """The registered factory of allocator-snapshot recorders, or None."""
    return _first("cuda_snapshots")


def cuda_available() -> Optional[bool]:
    """Whether a registered framework can train on CUDA here; None when none can tell (never raises)."""
    fn = _first("cuda_available")
    try:
        return None if fn is None else bool(fn())
    except Exception:
        return None
