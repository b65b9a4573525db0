"""NVML (``pynvml`` from nvidia-ml-py): this process's whole footprint on a GPU, context and other
libraries included, which the CUDA probe of ``memguard_torch`` reads on its full path. No
framework here: the device is named by its UUID or index. See docs/monitor.md, "Probes".
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Optional

from .common import log, warn_once

__all__ = ["nvml_module", "process_bytes"]

_state: Dict[str, object] = {"init": None}
_lock = threading.Lock()


def nvml_module(nvml=None):
    """The initialised ``pynvml`` module (``nvml`` itself where given: tests), or None (not
    installed / no driver). Initialised once per process."""
    if nvml is not None:
        return nvml
    with _lock:
        if _state["init"] is False:
            return None
        if _state["init"] is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _state["init"] = pynvml
            except Exception as exc:
                log.debug("memguard: NVML unavailable: %r", exc)
                _state["init"] = False
                return None
        return _state["init"]


def _handle(nv, index: int, uuid: Optional[str]):
    """NVML handle of the device: by UUID first (so ``CUDA_VISIBLE_DEVICES`` holds), else by index."""
    if uuid is not None:
        try:
            s = str(uuid)
            return nv.nvmlDeviceGetHandleByUUID(s if s.startswith("GPU-") else "GPU-" + s)
        except Exception:
            pass
    return nv.nvmlDeviceGetHandleByIndex(index)


def process_bytes(index: int, *, uuid: Optional[str] = None, pid: Optional[int] = None,
                  nvml=None) -> Optional[int]:
    """This process's memory on a GPU per NVML (``usedGpuMemory`` summed over its entries), bytes.

    Args:
        index: the device's index, used where ``uuid`` is None or unknown to NVML.
        uuid: the device's UUID (``GPU-...``; the prefix is added where missing).
        pid: the process (default this one).
        nvml: an initialised pynvml-like module (tests); default :func:`nvml_module`.

    Returns:
        None if NVML is not installed, the process is not listed (e.g. a container's PID
        namespace hides it) or the driver does not report per-process usage. Never raises.
    """
    nv = nvml_module(nvml)
    if nv is None:
        return None
    pid = os.getpid() if pid is None else pid
    try:
        handle = _handle(nv, index, uuid)
        used = None
        for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):
            if getattr(p, "pid", None) == pid and getattr(p, "usedGpuMemory", None) is not None:
                used = (used or 0) + int(p.usedGpuMemory)
        return used
    except Exception as exc:
        warn_once(f"nvml:{index}", "memguard: NVML per-process query failed: %r", exc)
        return None
