"""BF16 GEMMs with FP32 accumulation, emulated exactly on CPUs without native bfloat16.

The baseline of an FP8 comparison: each ``nn.Linear`` rounds its operands (input, weight, and the
output gradient in backward) to bfloat16 and multiplies them in FP32. Products of bfloat16 values are
exact in FP32, so this equals a bfloat16 tensor-core GEMM with FP32 accumulation (up to summation
order) while running at FP32 GEMM speed (CPUs without AVX512-BF16/AMX run bf16 GEMMs tens of times
slower). Master weights stay FP32, as under ``torch.autocast``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["BF16Linear", "to_bf16_gemms"]


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


class _BF16LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[override]
        xb, wb = _bf16(x), _bf16(weight)
        ctx.save_for_backward(xb.to(torch.bfloat16), wb.to(torch.bfloat16))
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        out = xb @ wb.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        # FP32 products of bf16-rounded operands whatever the parameters' dtype (bf16 master weights too)
        xb, wb = (t.float() for t in ctx.saved_tensors)
        gb = _bf16(g).float()
        dx = (gb @ wb).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = (gb.t() @ xb).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        db = g.sum(0).to(ctx.w_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class BF16Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs use bfloat16 operands and FP32 accumulation (saved input in bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        out = _BF16LinearFn.apply(x2, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def to_bf16_gemms(model: nn.Module) -> nn.Module:
    """Turn every plain ``nn.Linear`` of ``model`` into a ``BF16Linear`` in place (same parameters)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BF16Linear
    return model
