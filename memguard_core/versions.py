"""Version ranges that the adapters' uses of framework-private names were checked on: each
adapter's ``_compat`` module names its private names and the range, and calls :func:`warn_outside`
once, so a user on another version reads which names may have moved (memguard then falls back as
each ``_compat`` function documents, or the guard switches the affected feature off).
"""

from __future__ import annotations

import logging
import re
from typing import Iterable, Optional, Set, Tuple

_warned: Set[str] = set()


def _release(version: str) -> Tuple[int, ...]:
    """``(major, minor)`` of a version string (``"5.24.0.dev0"`` -> ``(5, 24)``)."""
    parts = re.findall(r"\d+", version)[:2]
    return tuple(int(p) for p in parts) + (0,) * (2 - len(parts))


def installed_version(dist: str) -> Optional[str]:
    """The installed version of distribution ``dist``, None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def in_range(version: str, checked: Tuple[str, str]) -> bool:
    """``version``'s major.minor lies within ``checked = (lowest, highest)`` (major.minor, inclusive)."""
    return _release(checked[0]) <= _release(version) <= _release(checked[1])


def warn_outside(dist: str, checked: Tuple[str, str], names: Iterable[str], log: logging.Logger) -> bool:
    """Log a warning, once per process and distribution, when the installed ``dist`` lies outside
    ``checked`` (major.minor, inclusive): ``names`` are the private names memguard relies on there.
    Returns True when the version is inside the range (or unknown). Never raises."""
    try:
        ver = installed_version(dist)
        if ver is None or in_range(ver, checked):
            return True
        if dist not in _warned:
            _warned.add(dist)
            log.warning("memguard: %s %s is outside the versions memguard's use of its internals was checked on "
                        "(%s to %s): %s. If one of them moved, memguard falls back or switches that feature off "
                        "with a message.", dist, ver, checked[0], checked[1], ", ".join(names))
        return False
    except Exception:
        return True
