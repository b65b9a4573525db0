"""An autograd op the estimator's rules do not know, for the in-process measurement's tests: it
keeps ``copies`` copies of its input for the backward, as a custom kernel keeping an unexpected
workspace would. torch is imported here: only tests that have it import this module."""

import torch

__all__ = ["BigSave"]


class BigSave(torch.autograd.Function):
    """``BigSave.apply(x, copies)``: returns a copy of ``x`` and saves ``copies`` copies of it."""

    @staticmethod
    def forward(ctx, x, copies):
        ctx.save_for_backward(x.repeat(*([1] * (x.ndim - 1)), copies))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        (big,) = ctx.saved_tensors
        return g + 0 * big[..., : g.shape[-1]], None
