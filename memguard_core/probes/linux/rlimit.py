"""Limits on this process's virtual memory for the Linux probe: the soft ``RLIMIT_AS`` /
``RLIMIT_DATA`` (getrlimit(2); ``ulimit -v``, ``prlimit --as``) and the room left under them. See
docs/monitor.md, "Address-space limits".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Tuple

from ..common import warn_once
from . import files
from .files import UNLIMITED_THRESHOLD
from .proc import read_status

try:
    import resource as _resource
except ImportError:   # not on Windows; this module is only used on Linux, but must import anywhere
    _resource = None

__all__ = ["AddressLimit", "read_rlimits", "cached_rlimits", "address_limit", "address_limit_now",
           "VM_KEYS"]


@dataclass(frozen=True)
class AddressLimit:
    """A limit on this process's virtual memory and the room left under it. Sizes in bytes.

    Attributes:
        source: ``"RLIMIT_AS"`` or ``"RLIMIT_DATA"``.
        limit: the soft limit (the one the kernel enforces; the hard one only caps raising it).
        counted: what the kernel counts against it now: ``VmSize`` (``total_vm``) for
            ``RLIMIT_AS``; ``VmData + VmStk`` for ``RLIMIT_DATA`` (the kernel counts ``data_vm`` =
            ``VmData``; the main stack is added so the full probe agrees with /proc/self/statm's
            ``data`` field, which the per-step path can read; it errs towards less room).
        headroom: ``max(0, limit - counted)``: the room left for new mappings.
    """

    source: str
    limit: int
    counted: int
    headroom: int


def _rlimit_bytes(which: int) -> Optional[int]:
    """The soft limit ``which`` in bytes, None when unlimited or unreadable."""
    try:
        soft, _hard = _resource.getrlimit(which)
    except Exception as exc:  # defensive: a probe never raises
        warn_once(f"getrlimit:{which}", "memguard: getrlimit(%r) failed: %r", which, exc)
        return None
    if soft is None or soft < 0 or soft == _resource.RLIM_INFINITY or soft >= UNLIMITED_THRESHOLD:
        return None
    return int(soft)


def read_rlimits() -> Tuple[Optional[int], Optional[int]]:
    """The soft ``(RLIMIT_AS, RLIMIT_DATA)`` of this process in bytes (getrlimit(2)); None for one
    that is unlimited (``RLIM_INFINITY``) or cannot be read. Never raises."""
    if _resource is None:
        return None, None
    return (_rlimit_bytes(_resource.RLIMIT_AS),
            _rlimit_bytes(getattr(_resource, "RLIMIT_DATA", _resource.RLIMIT_AS)))


#: ``(monotonic s, (RLIMIT_AS, RLIMIT_DATA))`` of the last :func:`read_rlimits`: a limit changes when
#: someone calls setrlimit / prlimit, not per step, so the per-step path re-reads it at most every
#: :data:`.files.SLOW_FIGURES_MAX_AGE_S`.
_rlimits_seen: Optional[Tuple[float, Tuple[Optional[int], Optional[int]]]] = None


def cached_rlimits(max_age: float = None) -> Tuple[Optional[int], Optional[int]]:
    """:func:`read_rlimits`, reused while younger than ``max_age`` seconds (default
    :data:`.files.SLOW_FIGURES_MAX_AGE_S`)."""
    global _rlimits_seen
    now = time.monotonic()
    hit = _rlimits_seen
    age = files.SLOW_FIGURES_MAX_AGE_S if max_age is None else max_age
    if hit is not None and now - hit[0] < age:
        return hit[1]
    limits = read_rlimits()
    _rlimits_seen = (now, limits)
    return limits


def address_limit(vm_size: Optional[int], vm_data: Optional[int],
                  limits: Tuple[Optional[int], Optional[int]]) -> Optional[AddressLimit]:
    """The virtual-memory limit with the least room left, from the process's counters.

    Args:
        vm_size: ``VmSize`` (bytes; counted by ``RLIMIT_AS``).
        vm_data: ``VmData + VmStk`` (bytes; counted by ``RLIMIT_DATA``).
        limits: soft ``(RLIMIT_AS, RLIMIT_DATA)`` in bytes, None for unlimited
            (:func:`read_rlimits`).

    Returns:
        :class:`AddressLimit`, or None when no limit is set or its counter is unknown.

    How it becomes a budget: the headroom is virtual address space, not resident memory. The
    probe caps ``available_bytes`` at it and ``total_bytes`` at the limit; the monitor's effective
    budget is ``(process RSS + available) x safety_ratio``, i.e. RSS + headroom at most. That is
    the conservative translation to the resident figures the monitor compares: a fresh allocation
    (torch's CPU tensors above glibc's mmap threshold are fresh mappings, unmapped again when
    freed) needs as much new mapping as it will make resident, while mapped-but-untouched
    memory (reserved arenas, thread stacks) counts against the limit without being resident.
    """
    cands = []
    as_lim, data_lim = limits
    if as_lim is not None and vm_size is not None:
        cands.append(AddressLimit("RLIMIT_AS", as_lim, int(vm_size), max(0, as_lim - int(vm_size))))
    if data_lim is not None and vm_data is not None:
        cands.append(AddressLimit("RLIMIT_DATA", data_lim, int(vm_data), max(0, data_lim - int(vm_data))))
    if not cands:
        return None
    return min(cands, key=lambda c: c.headroom)


#: The /proc/self/status lines the limits count: ``VmSize`` (``RLIMIT_AS``), ``VmData + VmStk``
#: (``RLIMIT_DATA``).
VM_KEYS = frozenset(("VmSize", "VmData", "VmStk"))


def address_limit_now(proc_root: str) -> Optional[AddressLimit]:
    """This process's :func:`address_limit` now (only for the real /proc: the limits read are this
    process's own). Never raises."""
    if proc_root != "/proc":
        return None
    try:
        limits = cached_rlimits()
        if limits == (None, None):
            return None
        vm = read_status(proc_root, keys=VM_KEYS)
        data = vm.get("VmData")
        if data is not None:
            data += vm.get("VmStk", 0)
        return address_limit(vm.get("VmSize"), data, limits)
    except Exception as exc:  # defensive: a probe never raises
        warn_once("linux.address_limit", "memguard: reading the address-space limits failed: %r", exc)
        return None
