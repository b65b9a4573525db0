"""The errors of the real-memory-limit harness (``memguard_testing.cgroup_harness``).

See docs/design.md ("Real cgroup limits") for what the harness is for.
"""

from __future__ import annotations

__all__ = ["CgroupError", "CgroupLimitBusyError"]


class CgroupError(RuntimeError):
    """A cgroup operation of the harness failed (create, join, write, remove)."""


class CgroupLimitBusyError(CgroupError):
    """The kernel refused to lower a v1 limit below the current usage (``EBUSY``).

    cgroup v1 reclaims before it accepts a lower ``memory.limit_in_bytes``; when it cannot
    reclaim enough (anonymous memory, no swap) the write fails with EBUSY and the old limit
    stays (Documentation/admin-guide/cgroup-v1/memory.rst, section 2.5 / mm/memcontrol-v1.c).

    Attributes:
        requested_bytes: the limit that was asked for.
        limit_bytes: the limit still in force (bytes).
        usage_bytes: the cgroup's usage when the write failed (bytes).
    """

    def __init__(self, requested_bytes: int, limit_bytes: int, usage_bytes: int):
        self.requested_bytes = requested_bytes
        self.limit_bytes = limit_bytes
        self.usage_bytes = usage_bytes
        super().__init__(
            f"kernel refused to lower the memory limit to {requested_bytes} bytes (EBUSY): "
            f"usage {usage_bytes} bytes could not be reclaimed; the limit stays {limit_bytes} bytes"
        )
