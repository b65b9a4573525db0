"""Test helpers of memguard: tiny models and data per framework, the real-memory-limit harness,
the training scripts that tests and benchmarks run as child processes, and shared fakes.

Not shipped to users (pyproject's ``packages.find`` leaves it out); importable from a checkout
after ``pip install -e .`` (the editable install puts the repository root on ``sys.path``), and in
child processes through :func:`script_env`. Nothing here imports torch, transformers, lightning or
mlx at package level: each helper module imports only its own framework.
"""

from __future__ import annotations

import os
from typing import Dict

#: The repository root (``tests/``, ``integration_tests/``, ``bench/`` sit under it).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The folder of the scripts tests and benchmarks launch by path (:func:`script`).
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def script(name: str) -> str:
    """The path of the child-process script ``name`` (e.g. ``"container_train.py"``)."""
    return os.path.join(SCRIPTS, name)


def with_root_on_pythonpath(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` with the repository root first on ``PYTHONPATH`` (memguard and these helpers
    importable in a child process whether or not the checkout is installed)."""
    env = dict(env)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def script_env(**extra: str) -> Dict[str, str]:
    """This process's environment, the repository root first on ``PYTHONPATH``, then ``extra``."""
    return with_root_on_pythonpath(dict(os.environ, **extra))
