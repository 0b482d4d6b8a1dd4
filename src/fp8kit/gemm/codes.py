"""GEMMs on stored 8-bit codes: ``x @ values(w).T`` for a weight ``w`` of FP8 or INT8 codes.

Every FP8 and INT8 value is exact in bfloat16 and float32, so a GEMM in either dtype on the decoded
codes forms the products of the 8-bit values exactly (FP32 accumulation); only the summation order is
the BLAS's. Two ways to hold the weight operand:

* lean (``cached=None``, the default of ``QuantLinear`` on CPU): only the codes stay resident. Each call
  decodes ``w`` in tiles of whole rows, at most ``TILE_ELEMENTS`` weights each, and multiplies every
  tile into its column slice of the output: the transient is one decoded tile (2 MiB in bfloat16,
  4 MiB in float32; an FP8 tile passes through float32, 6 MiB for a bfloat16 GEMM), whatever the layer's
  size. Each output element is one dot product over the whole of K, as in one GEMM.
* cached: the caller keeps the decoded copy (``cached``, 2 or 4 bytes per weight beside the 1-byte
  codes) and the GEMM reads it directly, saving the decode on every call.
"""

from __future__ import annotations

import torch

from ..kernels import decode_fp8
from ..kernels.fused import cpu_cast_kernel
from ..numerics.formats import get_format

__all__ = ["TILE_ELEMENTS", "codes_mm", "decode_codes", "tile_rows"]

TILE_ELEMENTS = 1 << 20  # weights decoded per tile on the lean path (bounds the transient, see above)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def decode_codes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 or INT8 codes as exact ``dtype`` values (unscaled). FP8 on CPU decodes in one compiled loop
    (``kernels.decode_fp8``) with the native conversion (``cpu_cast_kernel() == "native"``); with the
    integer decode it decodes to float32 (a direct bfloat16 output vectorizes worse in inductor's CPU
    code) and converts the exact values to ``dtype``."""
    if codes.dtype not in _FP8:
        return codes.to(dtype)
    fmt = get_format(codes.dtype)
    if codes.device.type != "cpu" or dtype == torch.float32 or cpu_cast_kernel() == "native":
        return decode_fp8(codes, fmt, dtype)
    return decode_fp8(codes, fmt, torch.float32).to(dtype)


def tile_rows(n: int, k: int) -> int:
    """Rows of an ``(n, k)`` weight decoded per tile on the lean path: ``TILE_ELEMENTS // k``, at least 1."""
    return max(1, min(n, TILE_ELEMENTS // max(k, 1)))


def codes_mm(x: torch.Tensor, w: torch.Tensor, cached: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ values(w).T`` in ``x.dtype`` (bfloat16 or float32): ``x`` ``(M, K)`` exact values, ``w``
    ``(N, K)`` FP8/INT8 codes; ``cached``: ``w``'s values in ``x.dtype`` (the cached path), else ``w`` is
    decoded tile by tile (lean). Unscaled: the caller applies the scales to the result."""
    if cached is not None:
        return x @ cached.t()
    n, k = w.shape
    rows = tile_rows(n, k)
    if rows >= n:
        return x @ decode_codes(w, x.dtype).t()
    starts = range(0, n, rows)
    if torch.compiler.is_compiling():  # no writes into views inside a graph: concatenate the tiles
        return torch.cat([x @ decode_codes(w[i : i + rows], x.dtype).t() for i in starts], dim=1)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    for i in starts:  # mm writes into the column slice directly (leading-dimension stride)
        torch.mm(x, decode_codes(w[i : i + rows], x.dtype).t(), out=out[:, i : i + rows])
    return out
