"""Fakes shared by several test files (the root conftest offers them as fixtures).

Each is the thinnest stand-in for a platform the test machines lack: only what memguard calls,
with the values a real one reports.
"""

from __future__ import annotations

import types
from typing import List, Optional

#: The device UUID :class:`FakeTorchCuda` reports unless told otherwise (NVML's form adds "GPU-").
FAKE_GPU_UUID = "0b1c2d3e-aaaa-bbbb-cccc-1234567890ab"


class FakeTorchCuda:
    """Thin fake of the ``torch.cuda`` counter functions (the test machines have no CUDA device).

    ``reset_peak_memory_stats`` records the device and lowers the allocated peak to what is
    allocated now, as torch's does; ``mem_get_info`` counts its calls (the driver call the cheap
    probe path must avoid). ``alloc_retries`` / ``ooms`` are the allocator's ``num_alloc_retries``
    / ``num_ooms``; ``memory_stats_as_nested_dict`` and ``memory_stats`` give torch's key layout
    built from the counter functions above (so replacing one of them reaches every read);
    ``empty_cache`` counts its calls."""

    def __init__(self, allocated: int, reserved: int, peak_alloc: int, peak_res: int, free: int, total: int,
                 uuid: Optional[str] = FAKE_GPU_UUID):
        self.allocated, self.reserved = allocated, reserved
        self.peak_alloc, self.peak_res = peak_alloc, peak_res
        self.free, self.total = free, total
        self.uuid = uuid
        self.mem_get_info_calls = 0
        self.resets: List[int] = []
        self.alloc_retries = 0
        self.ooms = 0
        self.empty_cache_calls = 0

    def is_available(self): return True
    def is_initialized(self): return True
    def current_device(self): return 0
    def memory_allocated(self, i): return self.allocated
    def memory_reserved(self, i): return self.reserved
    def max_memory_allocated(self, i): return self.peak_alloc
    def max_memory_reserved(self, i): return self.peak_res

    def reset_peak_memory_stats(self, i):
        self.resets.append(i)
        self.peak_alloc = self.allocated

    def memory_stats_as_nested_dict(self, i=None):
        i = 0 if i is None else i
        return {"allocated_bytes": {"all": {"current": self.memory_allocated(i), "peak": self.max_memory_allocated(i)}},
                "reserved_bytes": {"all": {"current": self.memory_reserved(i), "peak": self.max_memory_reserved(i)}},
                "num_alloc_retries": self.alloc_retries, "num_ooms": self.ooms}

    def memory_stats(self, i=None):
        nested = self.memory_stats_as_nested_dict(i)
        flat = {f"{k}.all.{w}": v for k in ("allocated_bytes", "reserved_bytes") for w, v in nested[k]["all"].items()}
        return dict(flat, num_alloc_retries=self.alloc_retries, num_ooms=self.ooms)

    def empty_cache(self):
        self.empty_cache_calls += 1

    def mem_get_info(self, i):
        self.mem_get_info_calls += 1
        return self.free, self.total

    def get_device_properties(self, i):
        return types.SimpleNamespace(uuid=self.uuid, total_memory=self.total)


def use_fake_torch(monkeypatch, fake) -> None:
    """Make ``fake`` (e.g. ``SimpleNamespace(cuda=FakeTorchCuda(...))``) the ``torch`` memguard
    reads for the rest of the test: the torch device probes' module (``memguard_torch.probes_cuda``
    / ``probes_mps``, registered by importing them) and ``sys.modules["torch"]`` (what a
    function-level ``import torch`` finds)."""
    import sys

    import memguard_torch  # noqa: F401  (registers the cuda / mps probes with the core)
    from memguard_torch import probes_cuda, probes_mps

    monkeypatch.setattr(probes_cuda, "torch", fake)
    monkeypatch.setattr(probes_mps, "torch", fake)
    monkeypatch.setitem(sys.modules, "torch", fake)
