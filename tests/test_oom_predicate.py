"""The one torch out-of-memory predicate (memguard_torch.oom.is_oom_error) that HF, Lightning and
TorchGuard share: the exception's type first, the allocator's message as the fallback. The
exceptions are built here as torch raises them (no CUDA needed to construct them)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from memguard_core.errors import WindowOOMError  # noqa: E402
from memguard_torch.oom import is_oom_error  # noqa: E402
from memguard_torch.sync import PeerOutOfMemoryError  # noqa: E402


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    torch.cuda.OutOfMemoryError("anything: the type decides"),
    MemoryError(),
    PeerOutOfMemoryError("at the end of the micro-batch"),
    # a kernel launch / cuBLAS handle that could not allocate: not the caching allocator's type
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("MPS backend out of memory (MPS allocated: 17.9 GB, other allocations: 1.2 GB)"),
    RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8589934592 bytes"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                 "non-contiguous input."),
], ids=["OutOfMemoryError", "cuda.OutOfMemoryError", "MemoryError", "peer", "launch", "cublas", "mps", "cpu",
        "cudnn"])
def test_out_of_memory(exc):
    assert is_oom_error(exc)


def test_accelerator_error_with_an_oom_message():
    cls = getattr(torch, "AcceleratorError", None)
    if cls is None:
        pytest.skip("this torch has no AcceleratorError")
    try:
        exc = cls("CUDA error: out of memory")
    except TypeError:
        pytest.skip("AcceleratorError is not constructible from Python here")
    assert is_oom_error(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("The size of tensor a (3) must match the size of tensor b (4)"),
    ValueError("out of memory"),                       # not a RuntimeError: a user's own
    KeyboardInterrupt(),
], ids=["shape", "value-error", "interrupt"])
def test_not_out_of_memory(exc):
    assert not is_oom_error(exc)


def test_memguards_own_window_error_is_not_retried():
    exc = WindowOOMError.__new__(WindowOOMError)
    Exception.__init__(exc, "out of memory in a backward at one row per forward")
    assert not is_oom_error(exc)


def test_every_torch_adapter_uses_the_same_predicate():
    import memguard_hf
    import memguard_lightning.eval as lightning_eval
    import memguard_lightning.step as lightning_step
    import memguard_torch

    assert memguard_hf.is_oom_error is memguard_torch.is_oom_error is is_oom_error
    assert lightning_step.is_oom_error is lightning_eval.is_oom_error is is_oom_error
