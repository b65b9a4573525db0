"""Adapter features the CLI reaches by name (the demos, ``estimate --trace``): each adapter
declares them as entry points of the group :data:`GROUP` in its distribution's metadata, so the
core finds them without importing any adapter (docs/design.md, "Layers")."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from .errors import MemGuardError

__all__ = ["GROUP", "FeatureUnavailable", "load"]

#: The entry-point group (``[project.entry-points."memguard.features"]`` in pyproject.toml).
GROUP = "memguard.features"


class FeatureUnavailable(MemGuardError):
    """An adapter feature cannot be loaded: its extra is not installed, or memguard's metadata
    (its entry points) is missing. The message names what to install."""


def load(name: str, extra: str) -> Any:
    """The object the entry point ``name`` of :data:`GROUP` names (e.g. ``demo.hf`` ->
    ``memguard_hf.demo:run_demo``; ``trace`` -> the module ``memguard_hf.trace``), imported now.

    Args:
        name: the feature's entry-point name.
        extra: the extra that brings its dependencies, for the message (``hf``, ``lightning``, ``mlx``).

    Raises:
        FeatureUnavailable: no such entry point (memguard installed without its metadata, e.g. run
            from a bare checkout), or importing it failed for a missing module.
    """
    found = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise FeatureUnavailable(f"memguard's feature {name!r} is not registered: install memguard-train "
                                 f'(pip install "memguard-train[{extra}]", or pip install -e . in a checkout)')
    try:
        return found[0].load()
    except ImportError as exc:
        raise FeatureUnavailable(f'{name} needs the [{extra}] extra: pip install "memguard-train[{extra}]" '
                                 f"({exc})") from None
