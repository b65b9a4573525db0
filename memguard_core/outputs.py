"""Output paths a command will write, checked before it does any work (``memguard report``,
``memguard run --report``): a path that cannot be written is a one-line error naming its flag, and
nothing is written first."""

from __future__ import annotations

import os

from .errors import ConfigError

__all__ = ["check_output"]


def check_output(path: str, flag: str) -> None:
    """Raise ``ConfigError`` naming ``flag`` unless ``path`` can be written as a file: not a folder,
    in an existing folder this process may write to (an existing file: writable).

    Raises:
        ConfigError: ``path`` is a folder, its folder is missing, or either is not writable.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(flag, "a file path, not a folder", path)
    if not os.path.isdir(folder):
        raise ConfigError(flag, "a path in an existing folder", f"{path} (no folder {folder})")
    if (os.path.exists(path) and not os.access(path, os.W_OK)) or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(flag, "a writable path", path)
