"""The quantized tensor type and ``quantize``: narrow data plus float32 inverse scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import (
    BlockSpec,
    cast_values,
    quantize_blocks_eager,
    quantize_blocks_fused,
    quantize_blocks_reference,
    quantize_pair_eager,
    quantize_pair_fused,
)
from ..kernels.fused import nvfp4_block_scales, quantize_values_fused
from ..kernels.opaque import dequantize_tiles, dequantize_tiles_opaque, is_ragged, quantize_tiles_opaque
from ..kernels.reference import tile_amax
from .formats import E4M3, Format, check_float_input, e2m1_decode, e8m0_decode, e8m0_encode, get_format
from .scaling import Granularity, named_element_bits, nvfp4_scales, parse_granularity

__all__ = [
    "CodesFromValues",
    "QuantizedTensor",
    "encode_values",
    "leading_amax",
    "quantize",
    "quantize_with_transpose",
    "tensor_amax",
]


class CodesFromValues:
    """Mixin of the quantized operands (``codes``, ``values``, ``fmt`` fields): ``data`` is the codes,
    encoded from ``values`` on first read where the kernel wrote only those (``lazy_codes``)."""

    @property
    def data(self) -> torch.Tensor:
        if self.codes is None:  # type: ignore[attr-defined]
            self.codes = encode_values(self.values, self.fmt)  # type: ignore[attr-defined]
        return self.codes  # type: ignore[attr-defined]

    def _stored(self) -> torch.Tensor:
        """The codes where stored, else the values (same shape and device), encoding nothing."""
        codes = self.codes  # type: ignore[attr-defined]
        return codes if codes is not None else self.data if self.values is None else self.values  # type: ignore[attr-defined]

    @property
    def shape(self) -> torch.Size:
        return self._stored().shape

    @property
    def device(self) -> torch.device:
        return self._stored().device


@dataclass
class QuantizedTensor(CodesFromValues):
    """Quantized values of a tensor and the scales to recover it.

    Attributes:
        codes: values in ``fmt.dtype`` (float8_e4m3fn / float8_e5m2 / int8; E2M1: uint8 codes, one per
            element, ``formats.e2m1_decode``), the original shape; None
            where ``quantize(..., lazy_codes=True)`` had the kernel write only ``values``: ``data`` then
            encodes them when first read (read ``data``; ``codes`` is what is stored).
        scales: per-tile dequantization multipliers, shape ``(nbr, nbc)`` over the 2-D view
            ``(prod(shape[:-1]), shape[-1])``: float32, uint8 E8M0 codes for MX, or float8_e4m3fn block
            scales for NVFP4 (relative to ``global_scale``).
        fmt: element format.
        granularity: how tiles were chosen.
        block: the tile shape ``(br, bc)`` used.
        orig_dtype: dtype of the tensor that was quantized (default for ``dequantize``).
        amax: per-tile absolute maximum of the input (float32, shape of ``scales``), when known.
        values: the unscaled FP8 values (exact; float32, or the GEMM's dtype), shape of ``data``; inside
            compiled CPU graphs (per-tensor and per-row scales), where computing them beside the cast lets
            a GEMM read its operand without decoding the codes, and where one decode feeds two grouped
            GEMMs (``gemm.grouped.with_values``). Never saved for backward or stored.
        global_scale: NVFP4's per-tensor dequantization multiplier (0-d float32, ``amax / 2688``); a
            tile's multiplier is ``scales * global_scale``. None for the other granularities.
    """

    codes: torch.Tensor | None
    scales: torch.Tensor
    fmt: Format
    granularity: Granularity
    block: tuple[int, int]
    orig_dtype: torch.dtype
    amax: torch.Tensor | None = None
    values: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def scale_inv(self) -> torch.Tensor:
        """Per-tile dequantization multipliers as float32 (``x ~= data * scale_inv``)."""
        if self.scales.dtype == torch.uint8:
            return e8m0_decode(self.scales)
        if self.global_scale is not None:
            return self.scales.float() * self.global_scale
        return self.scales

    @property
    def nbytes(self) -> int:
        """Memory footprint in bytes: data plus scales as held (E2M1 codes one per byte; ``state_dict.pack_fp4``
        stores two per byte)."""
        extra = 0 if self.global_scale is None else self.global_scale.numel() * 4
        return self.shape.numel() * self.fmt.dtype.itemsize + self.scales.numel() * self.scales.element_size() + extra

    def _code_values(self, data: torch.Tensor) -> torch.Tensor:
        """The codes' exact unscaled values as float32."""
        return e2m1_decode(data) if self.fmt.sub_byte else data.float()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """High-precision tensor ``data * scale_inv`` (float32 math, returned in ``dtype``)."""
        data2d = self.data.reshape(1, -1) if self.data.dim() < 2 else self.data.reshape(-1, self.data.shape[-1])
        rows, cols = data2d.shape
        br, bc = self.block
        dtype = dtype or self.orig_dtype
        if not is_ragged((rows, cols), (br, bc)):
            tiles = self._code_values(data2d).reshape(rows // br, br, cols // bc, bc)
            out = (tiles * self.scale_inv[:, None, :, None]).reshape(rows, cols)
        elif torch.compiler.is_compiling():  # ragged tiles: out of inductor's reach (kernels.opaque)
            out = dequantize_tiles_opaque(data2d, self.scale_inv, self.block, torch.float32)
        else:
            out = dequantize_tiles(data2d, self.scale_inv, self.block, torch.float32)
        return out.reshape(self.data.shape).to(dtype)

    def t(self) -> QuantizedTensor:
        """Transpose of a 2-D quantized tensor (no requantization; tiles transpose with it)."""
        if len(self.shape) != 2:
            raise ValueError(f"t() needs a 2-D quantized tensor, got shape {tuple(self.shape)}")
        return QuantizedTensor(
            None if self.codes is None else self.codes.t(),
            self.scales.t(),
            self.fmt,
            self.granularity.transposed(),
            self.block[::-1],
            self.orig_dtype,
            None if self.amax is None else self.amax.t(),
            None if self.values is None else self.values.t(),
            self.global_scale,
        )

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, fmt={self.fmt}, granularity={self.granularity}, "
            f"scales={tuple(self.scales.shape)}, nbytes={self.nbytes})"
        )


def encode_values(values: torch.Tensor | None, fmt: Format) -> torch.Tensor:
    """The ``fmt.dtype`` codes of exact unscaled FP8 values (any float dtype, e.g. the GEMM operand
    ``quantize(..., values=...)`` wrote): the conversion is exact, they lie on ``fmt``'s grid within
    ``+-fmt.max``."""
    if values is None:
        raise ValueError("this quantized operand holds neither codes nor values")
    return values.to(fmt.dtype)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """Absolute maximum of a whole tensor as a float32 scalar tensor (NaN if ``x`` holds NaN).

    Compiled: rows first, then across rows, the same reduction the per-tensor kernels use, so a graph
    that needs the amax before the cast (delayed scaling's first step) computes it once. Eager: one
    ``aminmax`` pass, which reads ``x`` without writing ``|x|`` (about 10x faster on CPU)."""
    x2 = _as_2d(x)
    if torch.compiler.is_compiling():
        return torch.abs(x2).amax(dim=-1).amax().float()
    lo, hi = torch.aminmax(x2)
    return torch.maximum(hi.float(), -lo.float()).abs()  # NaN propagates; abs: -0.0 -> 0.0


def leading_amax(x: torch.Tensor) -> torch.Tensor:
    """Absolute maximum of each ``x[i]`` (over all other dims) as float32 ``(x.shape[0],)``, NaN where
    ``x[i]`` holds NaN; e.g. each expert's weight amax of ``(E, N, K)`` expert weights. Eager, few large
    ``x[i]``: one whole-tensor ``aminmax`` per ``x[i]``, which reads it without writing ``|x|`` (CPU, 2
    threads, (8, 1024, 1024) bf16: 0.67 ms, against 2.5 ms for ``abs().amax(-1)`` and 6.6 ms for
    ``aminmax(dim=-1)``, whose per-row reduction is slow); otherwise ``abs().amax(-1)``."""
    x2 = x.reshape(x.shape[0], -1)
    if torch.compiler.is_compiling() or x2.shape[0] > 64 or x2.shape[1] < (1 << 16):
        return torch.abs(x2).amax(dim=-1).float()
    lo, hi = torch.stack([torch.stack(torch.aminmax(row)) for row in x2]).float().unbind(1)
    return torch.maximum(hi, -lo).abs()


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.reshape(1, -1)
    return x.reshape(-1, x.shape[-1])


def _validate(
    x: torch.Tensor, fmt: Format | str, granularity: Granularity | str | tuple[int, int], nonfinite: str
) -> tuple[Format, Granularity]:
    """The checks every quantize entry point makes; returns the parsed format and granularity."""
    check_float_input(x)
    fmt = get_format(fmt)
    if fmt.kind not in ("float", "int"):
        raise ValueError(f"quantize() takes an element format (e4m3, e5m2, e2m1, int8), not {fmt.name}")
    gran = parse_granularity(granularity)
    if nonfinite not in ("raise", "propagate"):
        raise ValueError(f"nonfinite must be 'raise' or 'propagate', got {nonfinite!r}")
    if x.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    if gran.is_mx and fmt.kind != "float":
        raise ValueError("MX granularity needs an FP8 element format (e4m3 or e5m2) or e2m1 (MXFP4)")
    _check_fp4(x, fmt, gran, granularity)
    return fmt, gran


def _check_fp4(x: torch.Tensor, fmt: Format, gran: Granularity, spec) -> None:
    """E2M1 goes with the FP4 granularities (``"nvfp4"``, ``"mxfp4"``) and they with it; their blocks must
    divide the tensor (the GPU kernels' layout; pad the last dim otherwise)."""
    bits = named_element_bits(spec)
    if (gran.is_nvfp4 or bits == 4) and not fmt.sub_byte:
        raise ValueError(f"granularity {spec!r} quantizes to FP4: pass fmt='e2m1', not {fmt.name}")
    if not fmt.sub_byte:
        return
    if bits == 8 or not (gran.is_nvfp4 or gran.is_mx):
        raise ValueError(f"e2m1 is quantized with granularity 'nvfp4' or 'mxfp4', not {spec!r}")
    x2 = _as_2d(x)
    if is_ragged(tuple(x2.shape), gran.block_shape(*x2.shape)):
        raise ValueError(
            f"{gran} blocks of {gran.block_shape(*x2.shape)} do not divide the tensor's 2-D view "
            f"{tuple(x2.shape)}; pad its last dim to a multiple of the block"
        )


def quantize(
    x: torch.Tensor,
    fmt: Format | str = E4M3,
    granularity: Granularity | str | tuple[int, int] = "tensor",
    *,
    margin: float = 0,
    power_of_two: bool = False,
    mx_rounding: str = "rceil",
    scale: torch.Tensor | float | None = None,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
    nonfinite: str = "raise",
    backend: str = "eager",
    check_scale: bool = True,
    values: torch.dtype | None = None,
    lazy_codes: bool = False,
    amax: torch.Tensor | None = None,
    global_scale: torch.Tensor | float | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` with scales shared per tensor, row, column, tile or MX block.

    Args:
        x: float32/bfloat16/float16/float64 tensor; more than 2-D is viewed as ``(-1, shape[-1])``.
        fmt: ``E4M3``, ``E5M2``, ``INT8``, or ``E2M1`` (FP4, with the two FP4 granularities).
        granularity: ``"tensor"``, ``"row"``, ``"column"``, ``(1, 128)``, ``(128, 128)``, any
            ``(br, bc)``, or ``"mx"`` (1x32 blocks, E8M0 power-of-two scales). Ragged edge tiles are
            allowed (their amax covers only the real elements). E2M1 takes ``"nvfp4"`` (1x16 blocks, E4M3
            block scales under an FP32 per-tensor scale, ``scaling.nvfp4_scales``) or ``"mxfp4"`` (MX
            blocks of E2M1), whose blocks must divide the tensor; its non-finite input always raises.
        margin / power_of_two: see ``compute_scale`` (ignored for MX, whose scales are powers of two, and
            NVFP4).
        mx_rounding: MX scale rule, ``"rceil"`` (never clips) or ``"floor"`` (OCP).
        scale: static scale multiplier(s), scalar or one per tile, instead of computing from amax.
        rounding: ``"nearest"`` (even) or ``"stochastic"``.
        nonfinite: ``"raise"`` (default) raises ``ValueError`` if a tile holds NaN/inf; ``"propagate"``
            quantizes anyway: that tile gets scale 1.0, NaN stays NaN and +-inf saturates to +-max.
        backend: ``"eager"``, ``"compiled"`` (torch.compile fused kernel) or ``"reference"``.
        check_scale: validate a static ``scale`` (finite, positive); callers that maintain the scale
            themselves turn it off to avoid a device sync.
        values: CPU GEMM dtype (bfloat16 or float32): also return the unscaled FP8 values in it
            (``QuantizedTensor.values``) where the compiled kernel can write them beside the codes in the
            same loop (FP8, eager mode, ``backend="compiled"``, scales that span whole rows: per tensor,
            per row, per expert); elsewhere ignored (the GEMM decodes the codes).
        lazy_codes: where ``values`` come from the kernel, it writes only them (no cast, no code bytes)
            and ``data`` encodes them on first read (``QuantizedTensor.codes`` stays None
            until then): for operands that only CPU GEMMs read, e.g. an output gradient.
        amax: ``x``'s absolute maximum per tile (shape of the scales, float32), where the caller already
            reduced it (delayed scaling records it): the kernel that writes ``values`` then reads ``x``
            once instead of twice. Trusted as given (it becomes ``QuantizedTensor.amax``).
        global_scale: NVFP4 only: a static per-tensor dequant multiplier (e.g. calibrated activations,
            ``scaling.nvfp4_tensor_scale(amax)``) instead of the tensor's own ``amax / 2688``; the block
            scales are still computed from ``x`` (``scaling.nvfp4_scales``).
    """
    fmt, gran = _validate(x, fmt, granularity, nonfinite)
    if gran.kind in ("block", "column") and x.dim() < 2 and gran.block_shape(1, 1)[0] != 1:
        raise ValueError(
            f"granularity {gran} tiles rows and columns, but the tensor has shape {tuple(x.shape)}; "
            "give a 2-D tensor or use 'tensor', 'row', 'mx' or (1, n) blocks"
        )
    x2 = _as_2d(x)
    rows, cols = x2.shape
    block = gran.block_shape(rows, cols)
    spec = BlockSpec(fmt, block, margin, power_of_two, mx_rounding if gran.is_mx else None, gran.is_nvfp4)
    static = None
    if scale is not None and gran.is_nvfp4:
        raise ValueError(
            "granularity nvfp4 computes its block scales from the tensor; drop scale= (a static per-tensor "
            "scale is global_scale=)"
        )
    if global_scale is not None:
        if not gran.is_nvfp4:
            raise ValueError(f"global_scale= is NVFP4's static per-tensor scale; granularity {gran} has none")
        global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
        if check_scale and not bool(torch.isfinite(global_scale) & (global_scale > 0)):
            raise ValueError("global_scale must be finite and positive")
        scale = nvfp4_scales(tile_amax(x2, block), global_scale)[2]  # the blocks' multipliers, then as static
    if scale is not None:
        static = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        nb = (-(-rows // block[0]), -(-cols // block[1]))
        if static.numel() == 1:
            static = static.reshape(1, 1).expand(*nb).contiguous()
        if tuple(static.shape) != nb:
            raise ValueError(f"static scale has shape {tuple(static.shape)}; granularity {gran} needs {nb} or a scalar")
        if check_scale and not bool(torch.isfinite(static).all() & (static > 0).all()):
            raise ValueError("static scale must be finite and positive")
    vals = None
    known_amax = None
    if amax is not None:
        nb = (-(-rows // block[0]), -(-cols // block[1]))
        known_amax = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(-1, 1)
        if nb[1] != 1 or known_amax.numel() != nb[0]:
            raise ValueError(
                f"amax= takes one value per tile of scales that span whole rows ({nb[0]} here); granularity "
                f"{gran} gives {nb} tiles and it got {known_amax.numel()}: drop amax= for it"
            )
    if rounding != "nearest" or backend == "reference":
        data, sc, amax = quantize_blocks_reference(x2, spec, static, rounding=rounding, generator=generator)
    elif backend in ("compiled", "eager") and torch.compiler.is_compiling() and is_ragged((rows, cols), block):
        data, sc, amax = quantize_tiles_opaque(x2, spec, static, fused=backend == "compiled")  # kernels.opaque
    elif backend == "compiled" and _values_in_kernel(values, x2, fmt, gran, block):
        (data, sc, amax), vals = quantize_values_fused(
            x2, spec, static, values, with_codes=not lazy_codes, amax=known_amax
        )
    elif backend == "compiled":
        data, sc, amax = quantize_blocks_fused(x2, spec, static)
    elif backend == "eager":
        data, sc, amax = quantize_blocks_eager(x2, spec, static)
    else:
        raise ValueError(f"unknown backend {backend!r}; accepted: 'eager', 'compiled', 'reference'")
    q = _finish(data, sc, amax, x.shape, fmt, gran, block, x.dtype, nonfinite, vals, global_scale)
    per_row = block[1] == cols and block[0] in (1, rows) and not gran.is_mx and not fmt.sub_byte
    if fmt.kind == "float" and per_row and x.device.type == "cpu" and torch.compiler.is_compiling():
        # the same float32 products the cast rounded, so inductor computes both in one loop
        q.values = cast_values(x2.float() * sc.reshape(-1, 1), fmt).reshape(x.shape)
    return q


def _values_in_kernel(values: torch.dtype | None, x2: torch.Tensor, fmt: Format, gran: Granularity, block) -> bool:
    """Whether ``quantize(values=...)`` gets the values from the compiled CPU kernel (see there)."""
    if values is not None and values not in (torch.bfloat16, torch.float32):
        raise ValueError(f"values must be torch.bfloat16 or torch.float32 (a CPU GEMM dtype), got {values}")
    if values is None or fmt.kind != "float" or fmt.sub_byte or gran.is_mx or x2.device.type != "cpu":
        return False
    rows, cols = x2.shape
    return not torch.compiler.is_compiling() and block[1] == cols and rows % block[0] == 0


def _finish(
    data, sc, amax, shape, fmt, gran, block, dtype, nonfinite, values=None, static_global=None
) -> QuantizedTensor:
    # FP4 raises on non-finite input, except inside compiled graphs (a host read there would break the graph)
    fp4_check = fmt.sub_byte and not torch.compiler.is_compiling()
    if (nonfinite == "raise" or fp4_check) and not bool(torch.isfinite(amax).all()):
        if fmt.sub_byte:
            raise ValueError(
                f"tensor to quantize holds NaN or inf, which {fmt} cannot encode; fix the producer of the values, "
                "or replace them first (e.g. torch.nan_to_num)"
            )
        raise ValueError(
            "tensor to quantize holds NaN or inf; fix the producer of the values, or pass "
            "nonfinite='propagate' to quantize anyway (NaN stays NaN, inf saturates)"
        )
    global_scale = None
    if gran.is_nvfp4:
        scales, global_scale, _ = nvfp4_block_scales(amax, static_global)  # those ``sc`` were made from
    else:
        scale_inv = (1.0 / sc).float()
        scales = e8m0_encode(scale_inv) if gran.is_mx else scale_inv
    return QuantizedTensor(
        None if data is None else data.reshape(shape),
        scales,
        fmt,
        gran,
        block,
        dtype,
        amax,
        None if values is None else values.reshape(shape),
        global_scale,
    )


def quantize_with_transpose(
    x: torch.Tensor,
    fmt: Format | str = E4M3,
    granularity: Granularity | str | tuple[int, int] = "row",
    *,
    margin: float = 0,
    power_of_two: bool = False,
    mx_rounding: str = "rceil",
    nonfinite: str = "raise",
    backend: str = "eager",
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``(quantize(x), quantize(x.T))`` for a 2-D ``x``, both with ``granularity`` along their rows.

    The second is the copy that a weight-gradient GEMM needs (``x`` reduced over its first dim). With
    ``backend="compiled"`` both come from one fused kernel that reads ``x`` once, without materialising
    ``x.T`` in high precision; except for tiles (blocks, MX) on CPU in eager mode, which run two
    row-ordered quantizes, of ``x`` and of a contiguous copy of ``x.T`` (torch's blocked 2-D transpose):
    the pair kernel's strided tile reads cost 2.1-3.4x as much there (``benchmarks/quantize.py
    --pair``; for row scales it is 0.8-1.1x, so it stays). Results equal two ``quantize`` calls bit for
    bit.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_with_transpose needs a 2-D tensor, got shape {tuple(x.shape)}")
    tiles = parse_granularity(granularity).kind in ("block", "mx", "nvfp4")
    two_passes = tiles and x.device.type == "cpu" and not torch.compiler.is_compiling()
    if backend not in ("compiled", "eager") or two_passes:
        kw = {"margin": margin, "power_of_two": power_of_two, "mx_rounding": mx_rounding, "nonfinite": nonfinite}
        return (
            quantize(x, fmt, granularity, backend=backend, **kw),
            quantize(x.t().contiguous(), fmt, granularity, backend=backend, **kw),
        )
    fmt, gran = _validate(x, fmt, granularity, nonfinite)
    rows, cols = x.shape
    mx = mx_rounding if gran.is_mx else None
    _check_fp4(x.t(), fmt, gran, granularity)
    spec = BlockSpec(fmt, gran.block_shape(rows, cols), margin, power_of_two, mx, gran.is_nvfp4)
    spec_t = BlockSpec(fmt, gran.block_shape(cols, rows), margin, power_of_two, mx, gran.is_nvfp4)
    if torch.compiler.is_compiling() and (is_ragged(x.shape, spec.block) or is_ragged((cols, rows), spec_t.block)):
        # ragged tiles: each orientation in the opaque op (kernels.opaque); the same codes as the pair
        fused = backend == "compiled"
        d1, s1, a1 = quantize_tiles_opaque(x, spec, fused=fused)
        d2, s2, a2 = quantize_tiles_opaque(x.t(), spec_t, fused=fused)
    else:
        pair = quantize_pair_fused if backend == "compiled" else quantize_pair_eager
        (d1, s1, a1), (d2, s2, a2) = pair(x, spec, spec_t)
    return (
        _finish(d1, s1, a1, x.shape, fmt, gran, spec.block, x.dtype, nonfinite),
        _finish(d2, s2, a2, (cols, rows), fmt, gran, spec_t.block, x.dtype, nonfinite),
    )
