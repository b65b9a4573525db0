"""The cuBLAS workspaces a training step holds on this process's GPU, as torch sizes them.

torch gives every cuBLAS handle (one per thread that runs matmuls: the forward's and autograd's
backward thread) a workspace per stream, allocated through the caching allocator, and a cuBLASLt
workspace beside it (ATen ``cuda/CublasHandlePool.cpp``: ``parseChosenWorkspaceSize``,
``parseCUDABlasLtWorkspaceSize``, ``getCUDABlasLtWorkspace``). The estimator counts two of what
:func:`workspace_bytes` returns (``TrainSpec.cublas_workspace_bytes``).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Mapping, Optional

from memguard_core.estimator.cuda import CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACE_SM90_BYTES, CUBLASLT_WORKSPACE_BYTES

__all__ = ["workspace_bytes", "workspace_bytes_for"]

log = logging.getLogger("memguard.torch")


def workspace_bytes_for(capability: tuple, env: Mapping[str, str]) -> int:
    """One thread's cuBLAS + cuBLASLt workspaces, bytes, on a GPU of compute ``capability``
    (``(major, minor)``) in the environment ``env``, as ``CublasHandlePool.cpp`` sizes them:

    * cuBLAS: ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KIB:COUNT`` pairs summed (``:4096:8`` = 32 MiB,
      what deterministic runs set); unset or unparsable, 32 MiB on compute capability 9.0 (Hopper)
      and 8 MiB + 128 KiB (``:4096:2:16:8``) elsewhere;
    * cuBLASLt: ``CUBLASLT_WORKSPACE_SIZE`` KiB, read as ``std::stoi`` reads it (the leading
      integer: ``"4096k"`` is 4096; none, the default 1024; a negative size, which torch's own
      arithmetic turns into an impossible one, 0), none of its own with
      ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` (it then uses cuBLAS's).
    """
    default = CUBLAS_WORKSPACE_SM90_BYTES if tuple(capability)[:2] == (9, 0) else CUBLAS_WORKSPACE_BYTES
    pairs = re.findall(r":([0-9]+):([0-9]+)", env.get("CUBLAS_WORKSPACE_CONFIG") or "")
    cublas = sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1":
        return cublas
    lt = CUBLASLT_WORKSPACE_BYTES
    leading = re.match(r"\s*([+-]?[0-9]+)", env.get("CUBLASLT_WORKSPACE_SIZE") or "")
    if leading:
        lt = int(leading.group(1)) * 1024
    return cublas + max(lt, 0)


def workspace_bytes(device: Any = None, env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """:func:`workspace_bytes_for` the CUDA ``device`` (a ``torch.device`` or index; ``None`` = the
    current one, read only once CUDA is initialised in this process, so that a plan made before
    the model moves does not initialise it) and environment (``env``, default ``os.environ``);
    ``None`` without a CUDA device, on ROCm (hipBLAS sizes its own) or when the capability cannot
    be read (logged at debug level): the estimator then counts Hopper's."""
    import torch

    try:
        if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
            return None
        if device is None and not torch.cuda.is_initialized():
            return None
        capability = torch.cuda.get_device_capability(device)
    except Exception as e:   # a broken driver or device index: the modelled default stands
        log.debug("memguard: the GPU's compute capability could not be read (%s: %s)", type(e).__name__, e)
        return None
    return workspace_bytes_for(capability, os.environ if env is None else env)
