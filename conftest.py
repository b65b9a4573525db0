"""The one conftest of the test suites (``tests/``, ``integration_tests/``): the data-dir setup
and the fixtures both share. The helpers themselves live in :mod:`memguard_testing`.

Cgroup fixtures: tests that need a real memory limit take ``memory_cgroup`` (a factory) or
``require_cgroups``; where the machine cannot create child memory cgroups they are skipped with
the reason from :func:`memguard_testing.cgroup_harness.cgroups_writable` (never passed silently).

Fakes: ``fake_torch_cuda`` builds a :class:`memguard_testing.fakes.FakeTorchCuda` from its counters.
"""

from __future__ import annotations

import os
import tempfile

# Guarded runs in the tests record into the calibration store: keep that out of the user's data dir
# (also for code that runs before the per-test fixture below, such as collection).
os.environ.setdefault("MEMGUARD_DATA_DIR", tempfile.mkdtemp(prefix="memguard-test-data-"))
# Idle OpenMP threads sleep instead of spinning. ``make test`` runs two workers, each training with 2
# torch threads (in process or in the child processes of the integration tests, which inherit this)
# on a 2-core machine: with libgomp's default (spin ~300k rounds before sleeping; each process sees
# only its own 2 threads, so it never backs off), a waiting thread burns the core the other worker's
# thread needs. It changes no allocation and no thread count (address-space limits and peaks stay
# as they were), only how fast the suite runs: docs/ci_time.md. Set before torch loads libgomp,
# which reads it once; an explicit setting of the user's wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from contextlib import ExitStack  # noqa: E402
from typing import Callable, Iterator, Optional  # noqa: E402

import pytest  # noqa: E402

from memguard_testing import forkserver  # noqa: E402
from memguard_testing.cgroup_harness import MemoryCgroup, cgroups_writable  # noqa: E402
from memguard_testing.fakes import FakeTorchCuda  # noqa: E402


#: test files that take minutes, the longest first (a full run's worker-seconds per file,
#: docs/ci_time.md): collected first, in this order, so that under ``make test``'s two workers none
#: starts last and runs alone at the end (the Makefile passes ``--no-loadscope-reorder``: pytest-xdist
#: otherwise queues the files with the most tests first, which puts the slow one-test files last)
_LONG_FILES = ("test_rlimit_oom.py", "test_torch_loop.py", "test_lightning_window_redo.py", "test_lightning_fsdp.py",
               "test_hf_fsdp.py", "test_lightning_eval_split.py", "test_full_depth_preflight.py", "test_wheel_install.py",
               "test_hf_microbatch.py", "test_resume_state.py", "test_hf_eval_split.py", "test_split_equivalence.py",
               "test_model_sources.py", "test_trace.py", "test_litgpt_code.py", "test_lightning_preflight.py")


def _long_rank(item) -> int:
    name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
    return _LONG_FILES.index(name) if name in _LONG_FILES else len(_LONG_FILES)


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=_long_rank)  # stable: the other files keep their collection order


@pytest.fixture(autouse=True)
def _own_calibration_store(tmp_path_factory, monkeypatch) -> None:
    """Each test records into a calibration store of its own: with one store for the session, the
    3 comparable runs of earlier tests would give a correction factor that changes later tests' plans
    (the tests' outcome would depend on their order). Subprocesses inherit the variable."""
    monkeypatch.setenv("MEMGUARD_DATA_DIR", str(tmp_path_factory.mktemp("memguard-data")))


@pytest.fixture(autouse=True, scope="module")
def _fork_servers_end_with_the_file() -> Iterator[None]:
    """The fork servers a test file started (``memguard_testing.forkserver``, each holding a
    framework's imports) end with the file, not with the worker."""
    yield
    forkserver.close_all()


@pytest.fixture(scope="session")
def cgroup_support() -> tuple[bool, str]:
    """(writable, reason) of :func:`cgroups_writable`, checked once a session."""
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


@pytest.fixture
def fake_torch_cuda() -> Callable[..., FakeTorchCuda]:
    """Factory ``make(allocated, reserved, peak_alloc, peak_res, free, total, uuid=...)`` of a fake
    ``torch.cuda`` (:class:`memguard_testing.fakes.FakeTorchCuda`)."""
    return FakeTorchCuda
