"""Old public names kept working after a rename: a ``DeprecationWarning`` names the new one.

Used by the options (``split`` -> ``micro_batches``, ``MEMGUARD_SPLIT`` -> ``MEMGUARD_MICRO_BATCHES``)
and by the adapters' attributes (``forward_rows`` / ``chunk_rows`` -> ``micro_batch_rows``,
``alloc_retries`` -> ``oom_retries``, ...). See docs/lifecycle.md for the list.
"""

from __future__ import annotations

import warnings
from typing import Any


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Emit a ``DeprecationWarning``: ``old`` is now called ``new``."""
    warnings.warn(f"memguard: {old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=stacklevel)


def renamed_attribute(old: str, new: str) -> Any:
    """A property under the old name ``old`` that reads and writes attribute ``new`` (a dotted path
    such as ``guard.oom_retries`` follows attributes), warning at each use."""
    path = new.split(".")

    def _owner(obj: Any) -> Any:
        for name in path[:-1]:
            obj = getattr(obj, name)
        return obj

    def fget(self: Any) -> Any:
        warn_renamed(old, path[-1])
        return getattr(_owner(self), path[-1])

    def fset(self: Any, value: Any) -> None:
        warn_renamed(old, path[-1])
        setattr(_owner(self), path[-1], value)

    return property(fget, fset, doc=f"Deprecated alias of ``{path[-1]}``.")
