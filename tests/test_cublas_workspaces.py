"""The cuBLAS workspaces the torch adapter reads for the estimate (``memguard_torch.cublas``): one
matmul thread's cuBLAS + cuBLASLt workspaces as ATen's ``CublasHandlePool.cpp`` sizes them, from the
GPU's compute capability and the environment. This machine has no GPU: the sizing is a function of
the capability (given here as the tuple ``torch.cuda.get_device_capability`` returns), and the
device read is faked only at ``torch.cuda`` itself, said in the test that does it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memguard_torch import cublas  # noqa: E402
from memguard_torch.train_reading import process_held_kwargs  # noqa: E402

MiB = 1 << 20
HOPPER, AMPERE, ADA, BLACKWELL = (9, 0), (8, 0), (8, 9), (10, 0)


def test_the_defaults_per_architecture():
    # CublasHandlePool.cpp: 32 MiB on sm90, else :4096:2:16:8; cuBLASLt's 1024 KiB beside it
    assert cublas.workspace_bytes_for(HOPPER, {}) == 32 * MiB + MiB
    for cap in (AMPERE, ADA, BLACKWELL):
        assert cublas.workspace_bytes_for(cap, {}) == (2 * 4096 + 8 * 16) * 1024 + MiB


def test_the_environment_torch_reads():
    # the deterministic setting PyTorch's docs give, and the small one
    assert cublas.workspace_bytes_for(AMPERE, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MiB + MiB
    assert cublas.workspace_bytes_for(HOPPER, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024 + MiB
    # unparsable: torch warns and keeps its default
    assert cublas.workspace_bytes_for(HOPPER, {"CUBLAS_WORKSPACE_CONFIG": "large"}) == 33 * MiB
    assert cublas.workspace_bytes_for(AMPERE, {"CUBLASLT_WORKSPACE_SIZE": "4096"}) == (8 * 1024 + 128) * 1024 + 4 * MiB
    # read as std::stoi reads it: the leading integer, else the default; a negative size counts 0
    assert cublas.workspace_bytes_for(AMPERE, {"CUBLASLT_WORKSPACE_SIZE": "4096k"}) == (8 * 1024 + 128) * 1024 + 4 * MiB
    assert cublas.workspace_bytes_for(AMPERE, {"CUBLASLT_WORKSPACE_SIZE": "lots"}) == (8 * 1024 + 128) * 1024 + MiB
    assert cublas.workspace_bytes_for(AMPERE, {"CUBLASLT_WORKSPACE_SIZE": "-8"}) == (8 * 1024 + 128) * 1024
    # a unified workspace: cuBLASLt uses cuBLAS's, nothing of its own; only "1" turns it on
    assert cublas.workspace_bytes_for(HOPPER, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}) == 32 * MiB
    assert cublas.workspace_bytes_for(HOPPER, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "true"}) == 33 * MiB


def test_no_gpu_here_reads_none_and_the_cpu_counter_is_untouched():
    if torch.cuda.is_available():
        pytest.skip("this test is for a machine without CUDA")
    assert cublas.workspace_bytes() is None
    assert process_held_kwargs("cuda", {}) == {"cublas_workspace_bytes": None}
    assert "cublas_workspace_bytes" not in process_held_kwargs("cpu", {"resident_file_bytes": 0})
    # a value the caller gave is kept
    assert process_held_kwargs("cuda", {"cublas_workspace_bytes": 5})["cublas_workspace_bytes"] == 5


def test_the_current_gpu_is_read(monkeypatch):
    # fake at the thinnest boundary (this machine has no CUDA): torch.cuda's availability and the
    # device's capability, as an H200 reports them
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or HOPPER)
    # the current device is not read before CUDA is initialised (a plan made before the model moves)
    assert cublas.workspace_bytes() is None and asked == []
    # the model's device is: a run on cuda:1 reads cuda:1
    assert cublas.workspace_bytes(torch.device("cuda", 1)) == 33 * MiB and asked == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    monkeypatch.delenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", raising=False)
    assert cublas.workspace_bytes() == 33 * MiB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    assert process_held_kwargs("cuda", {})["cublas_workspace_bytes"] == 32 * MiB

    def broken(device=None):
        raise RuntimeError("CUDA driver initialization failed")
    monkeypatch.setattr(torch.cuda, "get_device_capability", broken)
    assert cublas.workspace_bytes() is None   # the modelled default stands
