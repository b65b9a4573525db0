"""The kernel files of one memory cgroup, v1 or v2: limit, swap, usage, peak, OOM kills, members.

Part of the real-memory-limit harness (``memguard_testing.cgroup_harness``, docs/design.md,
"Real cgroup limits"). Kernel files used (Documentation/admin-guide/cgroup-v1/memory.rst and
cgroup-v2.rst):

==================  ===================================  ==========================
what                v1                                   v2
==================  ===================================  ==========================
limit               memory.limit_in_bytes                memory.max
swap off            memory.memsw.limit_in_bytes (=limit) memory.swap.max = 0
                    + memory.swappiness = 0
usage               memory.usage_in_bytes                memory.current
peak usage          memory.max_usage_in_bytes            memory.peak (kernel >= 5.19)
OOM kills           memory.oom_control ``oom_kill``      memory.events ``oom_kill``
members             cgroup.procs                         cgroup.procs
==================  ===================================  ==========================

Lowering the limit below the current usage (:meth:`CgroupFiles.set_limit`) differs by version:
- v1: the kernel reclaims (mm/memcontrol-v1.c ``mem_cgroup_resize_max``); anonymous memory
  cannot be reclaimed without swap, so after its retries the write fails with ``EBUSY``, the
  limit stays as it was and no process is killed. The harness raises
  :class:`CgroupLimitBusyError` (``integration_tests/test_cgroup_harness.py`` lowers a limit below a
  child's resident memory and checks exactly that).
- v2: the kernel reclaims and then invokes the OOM killer until usage fits
  (mm/memcontrol.c ``memory_max_write``): the write succeeds and processes are killed.

With no swap (``free`` shows ``Swap: 0`` here) the limit is a hard wall: a process that
touches more than the limit is OOM-killed, reliably.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Optional

from memguard_core.errors import require_positive_int
from memguard_testing.cgroup_errors import CgroupError, CgroupLimitBusyError
from memguard_testing.cgroup_locate import read_text

logger = logging.getLogger("memguard.integration.cgroup_harness")

__all__ = ["CgroupFiles"]


class CgroupFiles:
    """Reads and writes the memory files of the cgroup at ``path`` (an existing directory).

    Args:
        path: absolute directory of the cgroup.
        version: 1 or 2 (cgroup version of the memory controller).
    """

    def __init__(self, path: str, version: int):
        self.path = path
        self.version = version

    def file(self, name: str) -> str:
        """Absolute path of the cgroup's file ``name``."""
        return os.path.join(self.path, name)

    def write(self, name: str, value: str) -> None:
        """Write ``value`` to the cgroup's file ``name``. Raises OSError as the kernel refuses."""
        with open(self.file(name), "w") as f:
            f.write(value)

    def read_int(self, name: str) -> int:
        """The first number in the cgroup's file ``name``."""
        return int(read_text(self.file(name)).split()[0])

    def read_keyed(self, name: str, key: str) -> int:
        """The value of the ``key value`` line ``key`` of the cgroup's file ``name``.

        Raises:
            CgroupError: no such line (kernel too old?).
        """
        for line in read_text(self.file(name)).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == key:
                return int(parts[1])
        raise CgroupError(f"{name} of {self.path} has no {key!r} line (kernel too old?)")

    def disable_swap(self) -> None:
        """Keep swap out of the cgroup: v1 swappiness 0 (where writable), v2 memory.swap.max 0
        (where present). v1's memsw limit is kept equal to the limit by :meth:`set_limit`."""
        if self.version == 1:
            try:
                self.write("memory.swappiness", "0")
            except OSError as e:  # not fatal: with memsw = limit swap cannot extend the limit
                logger.info("memory.swappiness not writable in %s: %s", self.path, e)
        elif os.path.exists(self.file("memory.swap.max")):
            self.write("memory.swap.max", "0")

    def set_limit(self, limit_bytes: int) -> None:
        """Set the memory limit (bytes), also while processes run inside.

        v1 writes memory.limit_in_bytes and memory.memsw.limit_in_bytes (where the kernel has
        it) in the order the kernel requires (memsw >= limit at all times: memory first when
        lowering, memsw first when raising). v2 writes memory.max.

        Lowering below the current usage: v1 -> :class:`CgroupLimitBusyError` (the kernel could
        not reclaim; the old limit stays, nobody is killed); v2 -> the write succeeds and the
        kernel OOM-kills processes in the cgroup until usage fits.

        Raises:
            ConfigError: not a positive int.
            CgroupLimitBusyError: v1 EBUSY, see above.
            CgroupError: any other write failure.
        """
        limit_bytes = require_positive_int("limit_bytes", limit_bytes)
        try:
            if self.version == 2:
                self.write("memory.max", str(limit_bytes))
                return
            has_memsw = os.path.exists(self.file("memory.memsw.limit_in_bytes"))
            lowering = limit_bytes < self.limit_bytes()
            order = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            if not lowering:
                order.reverse()
            for f in order:
                if f == "memory.memsw.limit_in_bytes" and not has_memsw:
                    continue
                try:
                    self.write(f, str(limit_bytes))
                except OSError as e:
                    if e.errno == errno.EBUSY:
                        raise CgroupLimitBusyError(limit_bytes, self.limit_bytes(),
                                                   self.usage_bytes()) from e
                    raise
        except CgroupError:
            raise
        except OSError as e:
            raise CgroupError(f"cannot set memory limit {limit_bytes} on {self.path}: {e}") from e

    def limit_bytes(self) -> Optional[int]:
        """The limit in force (bytes; page-rounded by the kernel); None when v2 says ``max``."""
        if self.version == 1:
            return self.read_int("memory.limit_in_bytes")
        raw = read_text(self.file("memory.max")).strip()
        return None if raw == "max" else int(raw)

    def usage_bytes(self) -> int:
        """Current charged memory (bytes): v1 memory.usage_in_bytes, v2 memory.current."""
        return self.read_int("memory.usage_in_bytes" if self.version == 1 else "memory.current")

    def max_usage_bytes(self) -> Optional[int]:
        """Peak charged memory (bytes): v1 memory.max_usage_in_bytes (since creation or the
        last :meth:`reset_max_usage`), v2 memory.peak (since creation; None if absent)."""
        if self.version == 1:
            return self.read_int("memory.max_usage_in_bytes")
        try:
            return self.read_int("memory.peak")
        except FileNotFoundError:
            return None

    def reset_max_usage(self) -> None:
        """Reset the peak to the current usage (v1: write to memory.max_usage_in_bytes).

        v2's memory.peak can only be reset per open file (kernel >= 6.12), so this is a no-op
        there and :meth:`max_usage_bytes` stays the peak since creation.
        """
        if self.version == 1:
            self.write("memory.max_usage_in_bytes", "0")

    def oom_kill_count(self) -> int:
        """Processes the OOM killer killed in this cgroup (v1: memory.oom_control ``oom_kill``,
        kernel >= 4.13; v2: memory.events ``oom_kill``)."""
        if self.version == 1:
            return self.read_keyed("memory.oom_control", "oom_kill")
        return self.read_keyed("memory.events", "oom_kill")

    def pids(self) -> list[int]:
        """Pids of the processes now in the cgroup (cgroup.procs)."""
        return [int(x) for x in read_text(self.file("cgroup.procs")).split()]
