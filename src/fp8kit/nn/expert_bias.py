"""Per-expert biases of routed rows, with a backward that sums in a fixed order."""

from __future__ import annotations

import torch

__all__ = ["expert_bias"]


class _ExpertBias(torch.autograd.Function):
    """``bias[ids]``; backward ``zeros(E, N).index_add_(0, ids, grad)`` in float32. Autograd's own backward of
    the indexing (``index_put_`` with accumulation) adds with atomics on CPU when more than one thread runs,
    so the bias gradient, and every step after it, changed from run to run."""

    @staticmethod
    def forward(ctx, bias, ids, dtype):  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        return bias[ids].to(dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.bias_shape, dtype=torch.float32).index_add_(0, ids, grad.float())
        return out.to(ctx.bias_dtype), None, None


def expert_bias(bias: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias row of each routed row's expert, ``bias[ids]`` ``(S, N)`` in ``dtype`` (``bias`` ``(E, N)``,
    ``ids`` ``(S,)``), whose gradient is the same bit for bit at a fixed thread count."""
    return _ExpertBias.apply(bias, ids, dtype)
