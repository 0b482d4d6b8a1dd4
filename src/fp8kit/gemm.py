"""One FP8 GEMM entry point: ``C = dequant(a) @ dequant(b).T`` with FP32 accumulation.

Both operands are ``QuantizedTensor`` s quantized along their last dim, the reduction dim ``K``:
``a`` is ``(M, K)``, ``b`` is ``(N, K)``.

CPU: exact emulation. Every E4M3/E5M2 value is exactly representable in float32 (and bfloat16), and
the product of two such values has at most 8 significant bits, so an FP32 GEMM over the upcast FP8
values forms every product exactly and accumulates in FP32, as an FP8 tensor core with FP32
accumulation does (up to summation order). FP32 is used rather than bfloat16 because CPUs without
native bfloat16 (AVX2) run bfloat16 GEMMs tens of times slower; the result is the same.

* Per-tensor and per-row scales do not vary along ``K``: the GEMM runs on the raw FP8 values and the
  scales are applied to the FP32 result (``acc * sa[:, None] * sb[None, :]``).
* Block and MX scales vary along ``K``: each operand is dequantized tile by tile first (exact when the
  scales are powers of two, as MX and the default block recipe use) and then multiplied.

CUDA: ``torch._scaled_mm`` for per-tensor and row-wise scales (cuBLASLt FP8 tensor cores); block and
MX scales fall back to the dequantize path in bfloat16 (exact for power-of-two scales).
"""

from __future__ import annotations

import torch

from .tensor import QuantizedTensor

__all__ = ["fp8_gemm", "scales_factor_out"]


def scales_factor_out(q: QuantizedTensor) -> bool:
    """True when every scale of ``q`` covers a whole row (per tensor or per row)."""
    return q.block[1] >= q.data.shape[-1]


def _row_scales(q: QuantizedTensor) -> torch.Tensor:
    """Per-row dequant multipliers as ``(rows, 1)`` or ``(1, 1)`` float32 (tiles of several rows expand)."""
    s = q.scale_inv
    if s.numel() == 1:
        return s.reshape(1, 1)
    rows = q.data.shape[0]
    return s.reshape(-1, 1).repeat_interleave(q.block[0], dim=0)[:rows]


def _try_scaled_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    if not hasattr(torch, "_scaled_mm"):
        return None
    m, k = a.data.shape
    n = b.data.shape[0]
    if k % 16 or n % 16:
        return None
    sa, sb = _row_scales(a), _row_scales(b)
    rowwise = sa.numel() > 1 or sb.numel() > 1
    if rowwise:
        sa = sa.expand(m, 1).contiguous()
        sb = sb.reshape(1, -1).expand(1, n).contiguous()
        dtype = torch.bfloat16
    else:
        sa, sb = sa.reshape(()), sb.reshape(())
        dtype = out_dtype
    try:
        out = torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=dtype)
    except (RuntimeError, TypeError):
        return None
    return out.to(out_dtype)


def fp8_gemm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` for ``a`` ``(M, K)`` and ``b`` ``(N, K)``; result in ``out_dtype``."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"fp8_gemm needs a (M, K) and b (N, K) with the same K; got {tuple(a.data.shape)} and {tuple(b.data.shape)}"
        )
    factor = scales_factor_out(a) and scales_factor_out(b)
    if a.data.is_cuda:
        if factor:
            out = _try_scaled_mm(a, b, out_dtype)
            if out is not None:
                return out
        acc = torch.matmul(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16).t()).float()
        return acc.to(out_dtype)
    if factor:
        acc = torch.matmul(a.data.float(), b.data.float().t())
        acc = acc * _row_scales(a) * _row_scales(b).reshape(1, -1)
    else:
        acc = torch.matmul(a.dequantize(torch.float32), b.dequantize(torch.float32).t())
    return acc.to(out_dtype)
