"""What an adapter needs installed, checked before it imports anything of its framework, so a
missing optional dependency is one line naming the extra to install (README, "Install")."""

from __future__ import annotations

import importlib.util
import sys
from typing import Sequence

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency of a memguard adapter is not installed; the message names the extra."""


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None     # None: the import was blocked
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(adapter: str, modules: Sequence[str], extra: str) -> None:
    """Raise :class:`MissingExtraError` when any of ``modules`` (top-level import names) is not
    installed: ``"<adapter> needs <missing>: pip install "memguard-train[<extra>]""``. Imports nothing.

    Raises:
        MissingExtraError: a module is missing (its ``name`` is the first missing one).
    """
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise MissingExtraError(f"{adapter} needs {', '.join(missing)}, not installed here: "
                                f'pip install "memguard-train[{extra}]"', name=missing[0])
