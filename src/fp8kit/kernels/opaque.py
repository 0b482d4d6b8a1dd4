"""Tile quantize, dequantize and per-row scale expansion as custom ops opaque to ``torch.compile``.

Inductor's CPU code (torch 2.13; ``aot_eager`` is right, and so are sizes that the tiles divide)
miscompiles element-wise kernels over ragged tiles, tensors whose dims are not multiples of the tile:
``CppScheduling.try_loop_split`` (``torch/_inductor/codegen/cpp.py``) removes an index ``i // d``
(``d > 8``: a 1x128 tile, a 128x128 weight tile, an MX 1x32 block) by splitting that loop of size ``S``
into ``S // d`` tiles of ``d``, without checking ``S % d == 0``. The last ``S % d`` elements are never
computed (uninitialised or unscaled values: wrong outputs and gradients, silently), and two fused
kernels whose sizes floor differently trip its ``assert extra_indexing_ranges == ...`` (an
``InductorError``). Minimal repro (K = 192, two 1x128 tiles per row, the second ragged)::

    def f(x):  # x = torch.randn(48, 192); wrong under backend="inductor"
        t = F.pad(x, (0, 64)).reshape(48, 1, 2, 128)
        s = 1.0 / t.abs().amax(dim=(1, 3))
        return (t * s[:, None, :, None]).reshape(48, 256)[:, :192].contiguous()

fp8kit's graphs hold such a kernel wherever a per-tile value meets the element grid of a ragged
tensor: the cast of a tile quantizer (1x128 tiles on K = 192, MX blocks on K = 48, a weight gradient's
tiles along a token count of 200), the dequantization before a block or MX GEMM, and the per-row
weight scales of a GEMM whose K fits in one tile (``gemm.fp8``, ``gemm.grouped``: a 192-row weight in
128-row tiles). They run here inside custom ops (``fp8kit::quantize_tiles``, ``fp8kit::dequantize_tiles``,
``fp8kit::repeat_tiles``) whose bodies are the kernels eager mode runs, so a compiled graph gives
eager's codes, scales and values bit for bit. The callers use them only when compiling and only for
ragged tiles (``is_ragged``): tiles that divide the tensor stay fused in the graph. The MoE grouped
GEMMs dequantize through the op always (inductor's loop-split pass also fails on the 1x128
dequantizations of one tensor in both orientations that a weight gradient has).
"""

from __future__ import annotations

import torch

from ..numerics.formats import get_format
from .fused import dequantize_tiles as fused_dequantize_tiles
from .fused import quantize_blocks_eager, quantize_blocks_fused
from .reference import BlockSpec, expand_tiles, repeat_tiles_eager

__all__ = ["dequantize_tiles", "dequantize_tiles_opaque", "is_ragged", "quantize_tiles_opaque", "repeat_tiles"]


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_ragged(shape: tuple[int, int], block: tuple[int, int]) -> bool:
    """True when the tile ``block`` does not divide the 2-D ``shape`` (edge tiles are partial)."""
    return bool(shape[0] % block[0] or shape[1] % block[1])


def dequantize_tiles(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``codes * scale_inv`` tile by tile (float32 math, result in ``dtype``): ``codes`` ``(..., R, C)``,
    ``scale_inv`` ``(..., ceil(R/br), ceil(C/bc))`` float32, any tile shape (ragged edges included)."""
    return (codes.float() * expand_tiles(scale_inv, block, tuple(codes.shape[-2:]))).to(dtype)


def _dequantize_impl(
    codes: torch.Tensor, scale_inv: torch.Tensor, br: int, bc: int, dtype: torch.dtype
) -> torch.Tensor:
    if codes.dtype in _FP8_DTYPES:  # one loop on CPU: codes decoded and scaled per tile, no scale grid
        return fused_dequantize_tiles(codes.view(torch.uint8), scale_inv, br, bc, get_format(codes.dtype), dtype)
    return dequantize_tiles(codes, scale_inv, (br, bc), dtype).contiguous()


def _dequantize_fake(
    codes: torch.Tensor, scale_inv: torch.Tensor, br: int, bc: int, dtype: torch.dtype
) -> torch.Tensor:
    return codes.new_empty(codes.shape, dtype=dtype)


_DEQ = torch.library.custom_op("fp8kit::dequantize_tiles", _dequantize_impl, mutates_args=())
_DEQ.register_fake(_dequantize_fake)


def dequantize_tiles_opaque(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``dequantize_tiles`` inside the custom op ``fp8kit::dequantize_tiles`` (contiguous result)."""
    return _DEQ(codes, scale_inv.float(), block[0], block[1], dtype)


def _quantize_impl(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    fmt: str,
    br: int,
    bc: int,
    margin: float,
    power_of_two: bool,
    mx_rounding: str,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    spec = BlockSpec(get_format(fmt), (br, bc), margin, power_of_two, mx_rounding or None)
    kernel = quantize_blocks_fused if fused else quantize_blocks_eager
    data, sc, amax = kernel(x, spec, scale)
    data = data.view(torch.uint8) if data.dtype.is_floating_point else data
    return data.contiguous().clone(), sc.float().contiguous().clone(), amax.float().contiguous().clone()


def _quantize_fake(
    x: torch.Tensor, scale: torch.Tensor | None, fmt: str, br: int, bc: int, *_options: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes and dtypes of ``_quantize_impl``'s results (the remaining options do not change them)."""
    rows, cols = x.shape
    tiles = (-(-rows // br), -(-cols // bc))
    code_dtype = torch.int8 if get_format(fmt).kind == "int" else torch.uint8
    return (
        x.new_empty(rows, cols, dtype=code_dtype),
        x.new_empty(tiles, dtype=torch.float32),
        x.new_empty(tiles, dtype=torch.float32),
    )


_QUANTIZE = torch.library.custom_op("fp8kit::quantize_tiles", _quantize_impl, mutates_args=())
_QUANTIZE.register_fake(_quantize_fake)


def quantize_tiles_opaque(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None = None, *, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blocks_fused`` (``fused=False``: ``quantize_blocks_eager``) of the 2-D ``x`` inside the
    custom op ``fp8kit::quantize_tiles``: ``(data in spec.fmt.dtype, scale, amax)``, the kernels' contract."""
    fmt = spec.fmt
    data, sc, amax = _QUANTIZE(
        x,
        scale,
        fmt.name,
        spec.block[0],
        spec.block[1],
        float(spec.margin),
        bool(spec.power_of_two),
        spec.mx_rounding or "",
        fused,
    )
    return (data.view(fmt.dtype) if fmt.kind == "float" else data), sc, amax


def _repeat_impl(s: torch.Tensor, block: int, dim: int, size: int) -> torch.Tensor:
    return repeat_tiles_eager(s, block, dim, size).contiguous()


def _repeat_fake(s: torch.Tensor, block: int, dim: int, size: int) -> torch.Tensor:
    shape = list(s.shape)
    shape[dim] = size
    return s.new_empty(shape)


_REPEAT = torch.library.custom_op("fp8kit::repeat_tiles", _repeat_impl, mutates_args=())
_REPEAT.register_fake(_repeat_fake)


def repeat_tiles(s: torch.Tensor, block: int, dim: int, size: int) -> torch.Tensor:
    """Per-tile values ``s`` repeated ``block`` times along ``dim``, the first ``size`` kept (a ragged
    last tile); in the op ``fp8kit::repeat_tiles`` when compiling a ragged case."""
    if size % block and torch.compiler.is_compiling():
        return _REPEAT(s, block, dim, size)
    return repeat_tiles_eager(s, block, dim, size)
