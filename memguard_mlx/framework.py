"""MLX's services to the framework-free core (``memguard_core.frameworks``): emptying MLX's buffer
cache (``mx.clear_cache()``). Registered when ``memguard_mlx`` is imported.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from memguard_core import frameworks

logger = logging.getLogger("memguard.frameworks")

__all__ = ["empty_caches", "register"]


def empty_caches() -> None:
    """``mx.clear_cache()``: MLX's cached buffers back to the system. Never raises."""
    try:
        mx.clear_cache()
    except Exception as exc:
        logger.debug("memguard: mx.clear_cache() failed: %r", exc)


def register() -> None:
    """Register MLX with the core (idempotent). MLX runs one process: no rank agreement."""
    frameworks.register(frameworks.Framework(name="mlx", clean_caches=empty_caches))
