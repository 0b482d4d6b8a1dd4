"""Kernels of the MoE experts' grouped operands (``fp8kit.numerics.grouped_tensor``): casts with one scale per
expert (or group) and column, and row-wise quantization of each expert's transposed weight without a
transposed copy. Each runs as one compiled loop on CPU in eager mode (``kernels.fused.run_kernel``), bit for
bit its ``*_eager`` reference.
"""

from __future__ import annotations

import torch

from ..numerics.formats import Format
from .fused import cast_to_format, kernel_values, register_kernel, run_kernel
from .reference import BlockSpec, scale_from_amax

__all__ = ["cast_scaled", "quantize_columns_values", "scaled_values"]


def cast_scaled_eager(x: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, fmt: Format) -> torch.Tensor:
    """``x.float() * scale[ids]`` (``scale`` where ``ids`` is None) cast to ``fmt``, as uint8 codes
    (saturating, round to nearest even)."""
    return cast_to_format(x.float() * (scale if ids is None else scale[ids]), fmt, codes=True)


def cast_scaled(x: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, fmt: Format) -> torch.Tensor:
    """``cast_scaled_eager`` as one compiled loop on CPU (eager mode), viewed as ``fmt.dtype``."""
    if x.device.type != "cpu" or fmt.kind != "float":
        return cast_to_format(x.float() * (scale if ids is None else scale[ids]), fmt)
    return run_kernel("cast_scaled", cast_scaled_eager, x, scale, ids, fmt).view(fmt.dtype)


def scaled_values_eager(
    x: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, fmt: Format, dtype: torch.dtype
) -> torch.Tensor:
    """The exact values of ``cast_scaled_eager``'s codes in ``dtype`` (``kernel_values``), without the codes."""
    return kernel_values(x.float() * (scale if ids is None else scale[ids]), fmt).to(dtype)


def scaled_values(
    x: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor | None, fmt: Format, dtype: torch.dtype
) -> torch.Tensor:
    """``scaled_values_eager`` as one compiled loop on CPU (eager mode)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return scaled_values_eager(x, scale, ids, fmt, dtype)
    return run_kernel("scaled_values", scaled_values_eager, x, scale, ids, fmt, dtype)


def quantize_columns_values_eager(
    w: torch.Tensor, spec: BlockSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-wise quantization of each ``w[e].T`` without a transposed copy: ``w`` ``(E, N, K)``, one scale per
    expert and column (the amax over N), returned as ``(scale (E, 1, K), amax (E, 1, K), values (E, N, K))``
    with the unscaled exact FP8 values in ``dtype`` (``kernel_values``), laid out as ``w``: their
    ``transpose(1, 2)`` is the row-quantized ``w.transpose(1, 2)``, bit for bit."""
    amax = w.abs().amax(dim=1, keepdim=True).float()
    scale = scale_from_amax(amax, spec)
    return scale, amax, kernel_values(w.float() * scale, spec.fmt).to(dtype)


def quantize_columns_values(
    w: torch.Tensor, spec: BlockSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_columns_values_eager`` compiled into one kernel (CPU, eager mode)."""
    if w.device.type != "cpu" or torch.compiler.is_compiling():
        return quantize_columns_values_eager(w, spec, dtype)
    return run_kernel("column_values", quantize_columns_values_eager, w, spec, dtype)


register_kernel("cast_scaled", cast_scaled_eager)
register_kernel("scaled_values", scaled_values_eager)
register_kernel("column_values", quantize_columns_values_eager)
