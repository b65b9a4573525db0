"""Load a script of the repository's ``bench/`` folder as a module, for tests of its functions
(the scripts are run by path, not installed as a package)."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

__all__ = ["load_bench_script"]

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load_bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` executed as a fresh module named ``name``.

    Raises:
        FileNotFoundError: no such script.
    """
    spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
