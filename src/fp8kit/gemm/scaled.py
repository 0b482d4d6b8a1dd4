"""The inference GEMM on 8-bit codes with per-tensor / per-row scales: ``choose_kernel`` and ``scaled_mm``.

``out = (x_codes @ w_codes^T) * x_scale * w_scale (+ bias)`` for FP8 W8A8 (per-tensor static or per-token
dynamic activations, per-tensor or per-channel weights) and INT8 W8A8; weight-only (``x_scale=None``):
``out = (x @ w_codes^T) * w_scale (+ bias)``. The GEMM runs on the exact codes and applies the scales to
the high-precision accumulator. Which kernel runs is chosen per call from the device, the formats, the
layer's shape and the input dtype (``choose_kernel``); on CPU from the one feature probe (``gemm.probe``):

* CUDA: FP8 W8A8 through ``torch._scaled_mm`` (per-tensor scales, or per-token x per-channel scales
  with a bfloat16 output), INT8 W8A8 through ``torch._int_mm`` (int32 accumulation; ``M <= 16`` is
  zero-padded), weight-only INT8 through a ``torch.compile``-generated dequant GEMM.
* CPU: INT8 W8A8 through ``torch._int_mm`` (exact int32 accumulation) on CPUs with 8-bit dot products
  (VNNI, AMX); everything else through ``codes_mm``: a bfloat16 GEMM for bfloat16 inputs on CPUs with
  native bfloat16 (AVX512-BF16, AMX), else float32, on the codes decoded tile by tile (lean) or on a
  copy the caller caches (``gemm.codes``). CPU ``torch._scaled_mm`` on float8 was measured slower than
  both (``BENCHMARKS.md``).

Operands of at least ``COMPILE_MIN_ELEMENTS`` elements use one compiled scale-bias-cast loop after the
GEMM. ``use_fast_accum`` on CUDA keeps the FP8 tensor cores' partial sums in reduced precision between
cuBLAS's FP32 promotions (inference forward GEMMs only).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..numerics.formats import get_format
from ..numerics.tensor import QuantizedTensor
from .codes import TILE_ELEMENTS, codes_mm
from .probe import cpu_gemm_backend, cpu_int8_backend

if TYPE_CHECKING:
    from ..numerics.grouped_tensor import GroupedWeight

__all__ = [
    "COMPILE_MIN_ELEMENTS",
    "KERNELS",
    "KernelChoice",
    "block_scaled_mm",
    "choose_kernel",
    "scaled_mm",
    "use_compiled",
]

log = logging.getLogger("fp8kit.ptq")

KERNELS = ("reference", "scaled_mm", "scaled_mm_rowwise", "int_mm", "codes_mm", "dequant_mm_compiled")


@dataclass(frozen=True)
class KernelChoice:
    """The GEMM a call runs and why (``name`` is one of ``KERNELS``; ``gemm_dtype`` for ``codes_mm``)."""

    name: str
    reason: str
    gemm_dtype: torch.dtype | None = None


def choose_kernel(
    weight_dtype: torch.dtype,
    weight_per_row: bool,
    act_strategy: str | None,
    device: torch.device | str,
    x_dtype: torch.dtype,
    in_features: int,
    out_features: int,
) -> KernelChoice:
    """The GEMM for inputs of ``x_dtype`` into an ``(out_features, in_features)`` weight of
    ``weight_dtype`` codes (``float8_e4m3fn`` / ``int8``; ``weight_per_row``: per-channel scales) with
    activations quantized per ``"tensor"``, per ``"token"`` or not at all (``None``: weight-only).
    Pure: the CPU's capabilities come from the import-time feature probe."""
    dev = torch.device(device).type
    k, n = in_features, out_features
    fp8 = weight_dtype.is_floating_point
    if dev == "cuda":
        if act_strategy is None:
            return KernelChoice("dequant_mm_compiled", "weight-only INT8: torch.compile dequant GEMM")
        if fp8:
            if not hasattr(torch, "_scaled_mm"):
                return KernelChoice("reference", "this torch has no torch._scaled_mm")
            if k % 16 or n % 16:
                return KernelChoice("reference", f"torch._scaled_mm needs K, N multiples of 16 (got {k}, {n})")
            if not (act_strategy == "token" or weight_per_row):
                return KernelChoice("scaled_mm", "FP8 W8A8 per-tensor scales: torch._scaled_mm (fast accumulation)")
            if x_dtype != torch.bfloat16:
                return KernelChoice("reference", f"row-wise torch._scaled_mm writes bfloat16 only (input is {x_dtype})")
            return KernelChoice("scaled_mm_rowwise", "FP8 W8A8 per-token x per-channel: row-wise torch._scaled_mm")
        if not hasattr(torch, "_int_mm"):
            return KernelChoice("reference", "this torch has no torch._int_mm")
        if k % 8 or n % 8:
            return KernelChoice("reference", f"torch._int_mm needs K, N multiples of 8 (got {k}, {n})")
        return KernelChoice("int_mm", "INT8 W8A8: torch._int_mm, int32 accumulation (M <= 16 zero-padded)")
    if dev != "cpu":
        return KernelChoice("reference", f"no 8-bit kernel wired for device {dev!r}")
    bf16 = x_dtype == torch.bfloat16 and cpu_gemm_backend() == "bf16"
    gemm_dtype = torch.bfloat16 if bf16 else torch.float32
    what = "bfloat16 (native bfloat16 on this CPU)" if bf16 else "float32"
    if act_strategy is not None and not fp8 and cpu_int8_backend() == "int_mm":
        return KernelChoice("int_mm", "INT8 W8A8: torch._int_mm (exact int32 accumulation; 8-bit dot products)")
    if act_strategy is None:
        return KernelChoice("codes_mm", f"weight-only INT8: {what} GEMM on the exact codes, scales after", gemm_dtype)
    name = get_format(weight_dtype).name
    return KernelChoice("codes_mm", f"{name} W8A8: {what} GEMM on the exact codes, scales after", gemm_dtype)


def _dequant_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x @ w.to(x.dtype).t()).float() * s


def _convert(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype)


def _finish(
    acc: torch.Tensor, sx: torch.Tensor | None, ws: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``acc * sx * ws (+ bias)`` in float32, in the reference's order, returned in ``dtype``."""
    out = acc.float() * sx * ws if sx is not None else acc.float() * ws
    if bias is not None:
        out = out + bias
    return out.to(dtype)


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return (out.float() + bias if bias is not None else out).to(dtype)


COMPILE_MIN_ELEMENTS = 1 << 16  # smaller operands run eagerly: no compile time, no compiled-call overhead
_COMPILE = {"enabled": True}
_EAGER = {"dequant_mm": _dequant_mm, "convert": _convert, "finish": _finish}


def use_compiled(numel: int) -> bool:
    """True when operands of ``numel`` elements run compiled kernels: at least ``COMPILE_MIN_ELEMENTS``,
    and compilation has not failed in this process."""
    return _COMPILE["enabled"] and numel >= COMPILE_MIN_ELEMENTS


@functools.cache
def _compiled(name: str):
    return torch.compile(_EAGER[name], dynamic=True)


def _run(name: str, *args):
    """``name``'s function compiled (one fused loop on CPU, one Triton kernel on CUDA) for large operands,
    eager otherwise; a compile failure is logged once and the eager function used from then on."""
    if use_compiled(args[0].numel()) and not torch.compiler.is_compiling():
        try:
            return _compiled(name)(*args)
        except Exception as err:  # no C++ compiler / Triton: same math, eagerly
            _COMPILE["enabled"] = False
            log.warning("fp8kit.ptq: torch.compile unavailable for the GEMM epilogue (%s); running eagerly", err)
    return _EAGER[name](*args)


def scaled_mm(
    kernel: KernelChoice,
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    cached: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x @ w^T) * x_scale * w_scale + bias`` with ``kernel`` (from ``choose_kernel``), shape ``(M, N)``.

    ``x``: ``(M, K)`` FP8/INT8 codes with dequant multipliers ``x_scale`` ``(1,)`` or ``(M, 1)`` float32,
    or, weight-only (``x_scale=None``), high-precision activations. ``w``: ``(N, K)`` codes with
    ``w_scale`` ``(1,)`` or ``(N, 1)`` float32. ``bias``: ``(N,)`` float32. ``cached``: ``w``'s values in
    ``kernel.gemm_dtype`` for ``codes_mm`` (else decoded tile by tile). Result in ``out_dtype``."""
    ws = w_scale.reshape(1, -1)
    name = kernel.name
    if name == "dequant_mm_compiled":
        return _add_bias(_compiled("dequant_mm")(x, w, ws), bias, out_dtype)
    if name == "codes_mm":
        if x_scale is None:
            return _run("finish", codes_mm(x.to(kernel.gemm_dtype), w, cached), None, ws, bias, out_dtype)
        acc = codes_mm(_run("convert", x, kernel.gemm_dtype), w, cached)
        return _run("finish", acc, x_scale.reshape(-1, 1), ws, bias, out_dtype)
    if x_scale is None:
        raise ValueError(f"kernel {name!r} multiplies 8-bit activations: pass their x_scale")
    if name == "int_mm":
        m = x.shape[0]
        pad = 32 - m if (m <= 16 and x.is_cuda) else 0
        xq = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        acc = torch._int_mm(xq, w.t())
        return _run("finish", acc[:m] if pad else acc, x_scale.reshape(-1, 1), ws, bias, out_dtype)
    if name == "scaled_mm":
        fp_out = out_dtype if out_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
        out = torch._scaled_mm(
            x,
            w.t(),
            scale_a=x_scale.float().reshape(()),
            scale_b=w_scale.float().reshape(()),
            out_dtype=fp_out,
            use_fast_accum=True,
        )
    elif name == "scaled_mm_rowwise":
        m, n = x.shape[0], w.shape[0]
        out = torch._scaled_mm(
            x,
            w.t(),
            scale_a=x_scale.float().reshape(-1, 1).expand(m, 1).contiguous(),
            scale_b=w_scale.float().reshape(1, -1).expand(1, n).contiguous(),
            out_dtype=torch.bfloat16,
            use_fast_accum=True,
        )
    else:
        raise ValueError(f"unknown 8-bit GEMM kernel {name!r}; accepted: {', '.join(KERNELS[1:])}")
    return _add_bias(out, bias, out_dtype)


def _tiled_dequant_mm(xd: torch.Tensor, w: QuantizedTensor) -> torch.Tensor:
    """``xd @ w.dequantize().T`` (float32) with ``w`` dequantized a tile row at a time (``block_scaled_mm``)."""
    n, k = w.shape
    br = w.block[0]
    rows = max(br, TILE_ELEMENTS // max(k, 1) // br * br)
    if rows >= n:
        return xd @ w.dequantize(torch.float32).t()
    out = xd.new_empty(xd.shape[0], n)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        tile = replace(w, codes=w.data[r0:r1], scales=w.scales[r0 // br : -(-r1 // br)], amax=None, values=None)
        out[:, r0:r1] = xd @ tile.dequantize(torch.float32).t()
    return out


def block_scaled_mm(
    x: QuantizedTensor | torch.Tensor,
    w: QuantizedTensor | GroupedWeight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    *,
    offs: torch.Tensor | None = None,
    cached: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inference GEMM on tile-scaled codes (block FP8): ``dequant(x) @ dequant(w).T (+ bias)`` on the
    exact dequantized values in float32 (FP32 accumulation of exact products).

    ``x``: ``(M, K)`` quantized per ``1 x b`` group, or high-precision activations (weight-only). ``w``:
    ``(N, K)`` tiles, or per-expert tiles ``(E, N, K)`` (``GroupedWeight``) with ``offs`` the experts' row
    ends of ``x`` (one grouped GEMM). ``cached``: ``w`` dequantized to float32 (a copy the caller keeps);
    without it an ``(N, K)`` ``w`` is dequantized in whole tile rows of at most ``TILE_ELEMENTS`` weights,
    each multiplied into its columns of the output (the transient is one such tile). ``bias`` ``(N,)``
    float32. Result in ``out_dtype``."""
    xd = x.dequantize(torch.float32) if isinstance(x, QuantizedTensor) else x.float()
    if offs is None and cached is None and isinstance(w, QuantizedTensor):
        out = _tiled_dequant_mm(xd, w)
    elif offs is None:
        out = xd @ (w.dequantize(torch.float32) if cached is None else cached).t()
    else:
        from .grouped import grouped_mm

        wd = w.dequantize(torch.float32) if cached is None else cached
        out = grouped_mm(xd, wd.transpose(1, 2), offs)
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)
