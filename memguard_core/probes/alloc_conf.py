"""The CUDA caching allocator's settings (``PYTORCH_CUDA_ALLOC_CONF`` and its other names): where
they are read from and whether they turn expandable segments on. Framework-free: the settings
torch parsed come from the registered CUDA probe. See docs/monitor.md, "CUDA: expandable segments".
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional

from . import registry
from .common import log

__all__ = ["ALLOC_CONF_NAMES", "allocator_settings", "expandable_segments"]

#: The environment variables the CUDA caching allocator reads its settings from, in the order
#: torch 2.13 reads them (c10/cuda/CUDAAllocatorConfig.h: ``PYTORCH_CUDA_ALLOC_CONF``, on ROCm
#: ``PYTORCH_HIP_ALLOC_CONF``, then ``PYTORCH_ALLOC_CONF``, the device-generic name of torch >= 2.9).
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings(environ: Optional[Mapping[str, str]] = None, *,
                       reader: Optional[Callable[[], Optional[str]]] = None) -> str:
    """The caching allocator's settings string (``key:value,...``): what the framework parsed last
    (``reader``, default the registered CUDA probe's: torch >= 2.9's
    ``torch._C._accelerator_getAllocatorSettings()``, the environment variable at start or a later
    ``_accelerator_setAllocatorSettings``), else the first of :data:`ALLOC_CONF_NAMES` set in
    ``environ`` (default ``os.environ``); ``""`` when none. Loads no framework. Never raises."""
    if reader is None:
        p = registry.device_probe("cuda", load=False)
        reader = None if p is None else p.settings
    if reader is not None:
        try:
            got = reader()
            if got is not None:
                return str(got)
        except Exception as exc:
            log.debug("memguard: allocator settings not read from the framework: %r", exc)
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_NAMES:
        if name in env:
            return str(env[name])
    return ""


def expandable_segments(settings: str) -> Optional[bool]:
    """Whether an allocator settings string (:func:`allocator_settings`) turns the caching
    allocator's expandable segments on: the last ``expandable_segments:`` entry (``True`` / ``true``
    on, anything else off; absent: off, torch's default). None where they do not apply: the
    ``backend:cudaMallocAsync`` allocator (the driver's pool, no segments of torch's)."""
    on = False
    for part in str(settings).split(","):
        key, _, value = part.strip().partition(":")
        key, value = key.strip(), value.strip()
        if key == "backend" and value == "cudaMallocAsync":
            return None
        if key == "expandable_segments":
            on = value.lower() == "true"
    return on
