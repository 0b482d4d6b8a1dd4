"""BF16 GEMMs with FP32 accumulation, emulated exactly on CPUs without native bfloat16.

The baseline of an FP8 comparison: each ``nn.Linear``, and each expert GEMM of a ``transformers`` MoE
experts module (3-D expert weights, ``nn.experts.is_experts_module``; ``torch._grouped_mm`` ignores
bf16 autocast on CPU, so without this they ran in FP32), rounds its operands (input, weight, and the
output gradient in backward) to bfloat16 and multiplies them in FP32. Products of bfloat16 values are
exact in FP32, so this equals a bfloat16 tensor-core GEMM with FP32 accumulation (up to summation
order) while running at FP32 GEMM speed (CPUs without AVX512-BF16/AMX run bf16 GEMMs tens of times
slower). Master weights stay FP32, as under ``torch.autocast``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .class_swap import swap_class
from .routing import routing_plan

__all__ = ["BF16Experts", "BF16Linear", "bf16_grouped_linear", "to_bf16_gemms"]


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


class _BF16GroupedFn(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] @ w[e].T`` (``x`` ``(P, K)`` sorted by expert, ``w`` ``(E, N, K)``,
    ``offs`` int32 group ends) on bf16-rounded operands, FP32 products and output; the saved input in bf16."""

    @staticmethod
    def forward(ctx, x, weight, offs):  # type: ignore[override]
        from ..gemm.grouped import grouped_mm

        xb, wb = _bf16(x.float()), _bf16(weight.float())
        ctx.save_for_backward(xb.to(torch.bfloat16), wb.to(torch.bfloat16), offs)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return grouped_mm(xb, wb.transpose(1, 2), offs).to(x.dtype)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        from ..gemm.grouped import grouped_mm

        xb, wb, offs = ctx.saved_tensors
        xb, wb = xb.float(), wb.float()
        gb = _bf16(g.float()).contiguous()
        dx = grouped_mm(gb, wb, offs).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = grouped_mm(gb.t(), xb, offs).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def bf16_grouped_linear(x: torch.Tensor, weight: torch.Tensor, expert_ids_sorted: torch.Tensor) -> torch.Tensor:
    """``out[j] = x[j] @ weight[e_j].T`` for rows ``x`` ``(S, K)`` sorted by expert (``expert_ids_sorted``
    ``(S,)``), ``weight`` ``(E, N, K)``: one grouped GEMM each way, bf16 operands, FP32 accumulation."""
    return _BF16GroupedFn.apply(x, weight, routing_plan(expert_ids_sorted, weight.shape[0], 1).offs)


class BF16Experts:
    """Mixin put in front of a ``transformers`` experts module's class by ``to_bf16_gemms``: the experts
    forward of ``grouped_mm`` with both projections as BF16 grouped GEMMs (``bf16_grouped_linear``)."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from .experts import routed_experts_forward

        def project(x: torch.Tensor, p: int, expert_ids_sorted: torch.Tensor) -> torch.Tensor:
            w = self.down_proj if p == 1 else self.gate_up_proj if self.has_gate else self.up_proj
            w = w.transpose(1, 2) if self.is_transposed else w
            return bf16_grouped_linear(x, w, expert_ids_sorted)

        return routed_experts_forward(self, hidden_states, top_k_index, top_k_weights, project)


def to_bf16_gemms(model: nn.Module) -> nn.Module:
    """Turn every plain ``nn.Linear`` of ``model`` into a ``BF16Linear`` and every ``transformers`` experts
    module not converted to FP8 into a ``BF16Experts``, in place (same parameters)."""
    from .experts import FP8Experts, is_experts_module

    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BF16Linear
        elif is_experts_module(module) and not isinstance(module, (FP8Experts, BF16Experts)):
            swap_class(module, BF16Experts, "BF16")
    return model
