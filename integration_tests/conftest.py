"""Shared fixtures of the integration tests (real runs on this machine).

Cgroup fixtures: tests that need a real memory limit take ``memory_cgroup`` (a factory) or
``cgroup_support``; where the machine cannot create child memory cgroups they are skipped with
the reason from :func:`cgroup_harness.cgroups_writable` (never passed silently).
"""

from __future__ import annotations

import os
import sys
import tempfile

# Guarded runs in the tests record into the calibration store: keep that out of the user's data dir,
# or after 3 repeated runs a correction factor would start changing the tests' own plans.
os.environ.setdefault("MEMGUARD_DATA_DIR", tempfile.mkdtemp(prefix="memguard-test-data-"))
from contextlib import ExitStack
from typing import Callable, Iterator, Optional

import pytest

# The repository root (for memguard_core when it is not installed) and this folder (for the
# harness modules), whatever pytest's import mode.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from cgroup_harness import MemoryCgroup, cgroups_writable  # noqa: E402


@pytest.fixture(scope="session")
def cgroup_support() -> tuple[bool, str]:
    """(writable, reason) of :func:`cgroup_harness.cgroups_writable`, checked once a session."""
    return cgroups_writable()


@pytest.fixture
def require_cgroups(cgroup_support: tuple[bool, str]) -> None:
    """Skip the test, with the reason, where child memory cgroups cannot be created."""
    ok, reason = cgroup_support
    if not ok:
        pytest.skip(reason)


@pytest.fixture
def memory_cgroup(require_cgroups) -> Iterator[Callable[..., MemoryCgroup]]:
    """Factory ``make(limit_bytes, name=None) -> MemoryCgroup`` (already entered).

    Every cgroup made is removed at teardown (processes left inside are killed first).
    """
    with ExitStack() as stack:
        def make(limit_bytes: int, name: Optional[str] = None) -> MemoryCgroup:
            return stack.enter_context(MemoryCgroup(limit_bytes, name=name))
        yield make
