"""Fused amax + scale + cast, compiled with ``torch.compile``.

The kernel is written once in PyTorch and compiled for the device at hand: C++/OpenMP vector loops
on CPU, Triton on CUDA. Tile shapes that divide the tensor need no padding; the per-tensor case is a
max-reduction pass followed by one multiply-clamp-convert pass. On CPU the compiled graphs return uint8
codes that are viewed as float8 outside the graph, and the FP8 conversions of compiled CPU kernels, both
ways, are chosen by torch's CPU capability (``cpu_cast_kernel``): ``"native"``, torch's float8
conversions (``cast_native``, ``decode_native``), which inductor vectorizes with AVX-512; ``"bits"``,
integer operations on the float32 bits (``cast_bits``, ``decode_bits``, ``round_bits``), since inductor
converts to and from float8 element by element without AVX-512. Both give the same codes and values bit
for bit.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..numerics.formats import E2M1, E4M3, E5M2, Format
from ..numerics.scaling import nvfp4_scales
from .reference import BlockSpec, scale_from_amax, tile_view

_COMPILE = {"enabled": True, "strict": False}
_IN_OWN_KERNEL = [False]  # True while dynamo traces one of fp8kit's own kernels (``_run``)


def choose_cpu_cast(capability: str) -> str:
    """The FP8 conversions (float32 -> FP8 casts and FP8 -> float32 decodes) of compiled CPU kernels for
    torch's CPU ``capability`` (``torch.backends.cpu.get_cpu_capability()``): ``"native"`` with AVX-512
    (2-core AMX Xeon, torch 2.13: 1.1 vs 3.4 ms for a (4096, 1024) bf16 scale-and-cast, 3.5 vs 8.1 ms
    for a decode of (4096, 1024) codes to bf16), ``"bits"`` elsewhere (AVX2: inductor's float8
    conversion runs element by element, about 3x slower than ``cast_bits``)."""
    return "native" if capability.startswith("AVX512") else "bits"


# "name": the FP8 conversions of compiled CPU kernels; "split": whether they may use ``round_split``
_CPU_CAST: dict[str, object] = {"name": choose_cpu_cast(torch.backends.cpu.get_cpu_capability()), "split": False}


def cpu_cast_kernel() -> str:
    """The FP8 conversions compiled CPU kernels use: ``"native"`` (``cast_native``, ``decode_native``) or
    ``"bits"`` (``cast_bits``, ``decode_bits``, ``round_bits``)."""
    return str(_CPU_CAST["name"])


def set_cpu_cast_kernel(name: str) -> None:
    """Override the FP8 conversions of compiled CPU kernels (``"native"`` or ``"bits"``; the same codes
    and values either way;
    dynamo's guard on this setting recompiles the kernels traced with the other one)."""
    if name not in ("native", "bits"):
        raise ValueError(f"CPU cast kernel must be 'native' or 'bits', got {name!r}")
    _CPU_CAST["name"] = name


def set_compile_enabled(enabled: bool) -> None:
    """Turn the compiled kernels on or off process-wide (off: the same math runs eagerly)."""
    _COMPILE["enabled"] = bool(enabled)


def set_compile_strict(strict: bool) -> None:
    """Strict mode: a kernel that fails to compile raises instead of warning and falling back to
    eager (tests turn it on, so that a "compiled" test cannot silently test the eager kernels)."""
    _COMPILE["strict"] = bool(strict)


def cast_to_format(y: torch.Tensor, fmt: Format, codes: bool = False) -> torch.Tensor:
    """Saturating RNE cast of scaled values; ``codes=True`` returns FP8 as its uint8 bit patterns
    (what fp8kit's own compiled kernels return: a float8 view inside an inductor CPU graph makes
    the store element-wise; ``_as_format`` reinterprets the codes outside the graph for free). E2M1
    has no torch dtype: its uint8 codes from ``cast_bits`` on every device."""
    if fmt.kind == "int":
        return torch.round(y).clamp(-fmt.max, fmt.max).to(torch.int8)
    if fmt.sub_byte:
        return cast_bits(y, fmt)
    if y.device.type == "cpu" and torch.compiler.is_compiling():
        if _CPU_CAST["name"] == "native":
            return cast_native(y, fmt, view=not codes)
        return cast_bits(y, fmt, view=not codes)
    out = y.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return out.view(torch.uint8) if codes else out


# float32 bit patterns of each narrow float format's max and min normal (read as constants when compiling).
_LIMIT_BITS = {
    f.name: tuple(torch.tensor([f.max, f.min_normal]).view(torch.int32).tolist()) for f in (E4M3, E5M2, E2M1)
}


def _float_bits(y: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``y`` as float32, its bits (int32), its magnitude's bits, and those clamped to ``fmt.max``'s
    (saturation); read once: each bitcast costs inductor's CPU code a store and a reload."""
    y = y.float()
    bits = y.view(torch.int32)
    mag = bits & 0x7FFFFFFF
    return y, bits, mag, torch.clamp(mag, max=_LIMIT_BITS[fmt.name][0])


def cast_native(y: torch.Tensor, fmt: Format, view: bool = True) -> torch.Tensor:
    """Saturating round-to-nearest-even float32 -> FP8 with torch's own conversion (RNE, subnormals
    exact), after saturating to ``+-fmt.max`` with comparisons (NaN fails both and keeps its sign: a
    compiled ``clamp`` turned some positive NaNs negative); ``view=False``: the uint8 codes."""
    sat = torch.where(y > fmt.max, fmt.max, torch.where(y < -fmt.max, -fmt.max, y))
    out = sat.to(fmt.dtype)
    return out if view else out.view(torch.uint8)


def cast_bits(y: torch.Tensor, fmt: Format, view: bool = True) -> torch.Tensor:
    """Saturating round-to-nearest-even float32 -> FP8 or E2M1 codes written as integer operations on the
    bits (E2M1: uint8 codes; it has no NaN code, and NaN gives the largest magnitude's).

    Inductor turns these into AVX2/AVX-512 vector code, while its float -> float8 conversion on CPU
    runs element by element (about 3x slower for the whole cast). Same codes as the reference cast
    (``formats.cast_reference``), NaN's sign included; tested on every bfloat16 pattern and on ties:

    * normal range: clamp the magnitude's bits to ``fmt.max``'s, move the exponent from bias 127 to
      ``fmt.bias``, add ``half ulp - 1 + lsb`` and shift the mantissa down (round half to even);
    * subnormal range (``|y| < min_normal``): the code is ``round_half_even(|y| / min_subnormal)``,
      exact in float32; ``2**mantissa_bits`` is the smallest normal's code, so round-up into it is right.
    """
    shift = 23 - fmt.mantissa_bits
    y, bits, mag, clamped = _float_bits(y, fmt)
    min_normal_bits = _LIMIT_BITS[fmt.name][1]
    normal = (clamped - ((127 - fmt.bias) << 23) + ((1 << (shift - 1)) - 1) + ((clamped >> shift) & 1)) >> shift
    subnormal = torch.round(y.abs() * (1.0 / fmt.min_subnormal)).to(torch.int32)
    code = torch.where(mag < min_normal_bits, subnormal, normal)
    sign = fmt.exponent_bits + fmt.mantissa_bits  # the sign's bit in the code
    code = torch.where(mag > 0x7F800000, (1 << sign) - 1, code) | ((bits >> (31 - sign)) & (1 << sign))  # NaN: 0x7F
    # int32 -> float32 -> uint8 vectorizes on CPU; a direct int32 -> uint8 conversion does not.
    code = code.float().to(torch.uint8)
    return code.view(fmt.dtype) if view and not fmt.sub_byte else code


def round_bits(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The values ``cast_bits(y, fmt)`` encodes, as exact float32 (``decode_bits(cast_bits(y))``),
    computed from ``y`` directly: saturating round-to-nearest-even to ``fmt``'s grid.

    For a GEMM that runs on the FP8 values in a wider dtype (CPU), this gives the operand in the same
    vector loop as the cast, without reading the codes back: in the normal range the magnitude's bits
    (clamped to ``fmt.max``'s) round to ``fmt.mantissa_bits`` bits (add ``half ulp - 1 + lsb``, clear the
    dropped bits); below ``fmt.min_normal`` the grid is ``fmt.min_subnormal`` (exact float32 math).
    NaN stays NaN, +-inf saturates to +-max, the sign of zero is kept (tested against the codes).
    """
    shift = 23 - fmt.mantissa_bits
    y, bits, mag, clamped = _float_bits(y, fmt)
    min_normal_bits = _LIMIT_BITS[fmt.name][1]
    rounded = (clamped + ((1 << (shift - 1)) - 1) + ((clamped >> shift) & 1)) & -(1 << shift)
    normal = (rounded | (bits & -(1 << 31))).view(torch.float32)
    subnormal = torch.round(y * (1.0 / fmt.min_subnormal)) * fmt.min_subnormal
    v = torch.where(mag < min_normal_bits, subnormal, normal)
    return torch.where(mag > 0x7F800000, y, v)


def decode_bits(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """FP8 codes (uint8 bit patterns or a float8 tensor) as exact float32 values: ``cast_bits``' inverse.

    Integer operations and one multiply, which inductor turns into vector code (a 256-entry table
    gather compiles to a scalar loop with bounds checks, and torch's float8 -> float conversion runs
    element by element on CPU). The code's magnitude bits are placed in a float32's exponent and
    mantissa fields, which reads them with float32's exponent bias; the multiply by
    ``2**(127 - fmt.bias)`` moves the bias. Subnormal codes land on float32 subnormals, which the
    multiply scales to exactly ``m * fmt.min_subnormal`` (no flush-to-zero on CPU by default; tested
    for all 256 codes). E4M3's NaN codes and E5M2's inf/NaN codes are set explicitly.
    """
    c = codes.view(torch.uint8).to(torch.int32)
    shift = 23 - fmt.mantissa_bits  # the code's mantissa field lands at the top of float32's
    mag = c & 0x7F
    v = (((c & 0x80) << 24) | (mag << shift)).view(torch.float32) * float(2.0 ** (127 - fmt.bias))
    if fmt.has_inf:  # E5M2: exponent field all ones is inf (mantissa 0) or NaN
        inf = (((c & 0x80) << 24) | 0x7F800000).view(torch.float32)
        v = torch.where(mag == 0x7C, inf, v)
        return torch.where(mag > 0x7C, float("nan"), v)
    return torch.where(mag == 0x7F, float("nan"), v)


def decode_native(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """FP8 codes (uint8 bit patterns or a float8 tensor) as exact float32 values with torch's own float8
    conversion (vectorized by inductor with AVX-512: 2x ``decode_bits``' speed to bfloat16, 3.5x to
    float32, on the AMX Xeon)."""
    return codes.view(torch.uint8).view(fmt.dtype).to(torch.float32)


def decode_cpu(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """FP8 codes as exact float32 values (the same either way): in fp8kit's own kernels the decode
    ``cpu_cast_kernel`` picks; traced into a model's compiled graph, ``decode_bits`` (see ``cast_values``)."""
    if torch.compiler.is_compiling() and not _IN_OWN_KERNEL[0]:
        return decode_bits(codes, fmt)
    return decode_native(codes, fmt) if _CPU_CAST["name"] == "native" else decode_bits(codes, fmt)


def cast_values(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The float32 values the saturating RNE cast of ``y`` to ``fmt`` encodes: with the native
    conversions (``cpu_cast_kernel``), the native cast read back (2x faster than ``round_bits`` alone on
    the AMX Xeon); ``round_bits`` otherwise, and inside a model's compiled graph. There the native
    conversions, with the native decode, made the MLP step of current scaling 8% faster and that of
    row-wise scaling 15% slower (``benchmarks/linear.py``, AMX Xeon): inductor fuses them differently.
    Traced graphs keep the integer conversions they had (decode and values; the cast itself is native)."""
    if _CPU_CAST["name"] == "native" and (not torch.compiler.is_compiling() or _IN_OWN_KERNEL[0]):
        return cast_native(y.float(), fmt).to(torch.float32)
    return round_bits(y, fmt)


def round_split(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The float32 values the saturating RNE cast of ``y`` to ``fmt`` encodes, in float arithmetic only
    (no FP8 conversion, no bit casts: about 0.6 ms less than the native cast read back for 4M elements).

    After saturating to ``+-fmt.max`` with comparisons (NaN kept), Veltkamp's splitting rounds to
    ``fmt.mantissa_bits + 1`` significant bits: ``t = a * (2**(23 - mantissa_bits) + 1)``, ``hi = t - (t -
    a)``, which in binary floating point is round to nearest, ties to even; below ``fmt.min_normal`` the
    grid is ``fmt.min_subnormal`` (``round``, exact). Exact only if ``t`` is rounded on its own: an FMA
    contraction of ``t - a`` breaks it, so fp8kit uses it only in kernels it compiles with contraction off
    (``_compile_options``); tested against the reference on every bfloat16 pattern, ties and random bits."""
    y = y.float()
    a = torch.where(y > fmt.max, fmt.max, torch.where(y < -fmt.max, -fmt.max, y))
    t = a * float(2 ** (23 - fmt.mantissa_bits) + 1)
    hi = t - (t - a)
    sub = torch.round(a * (1.0 / fmt.min_subnormal)) * fmt.min_subnormal
    return torch.where(a.abs() < fmt.min_normal, sub, hi)


def kernel_values(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``cast_values`` in fp8kit's own compiled kernels: ``round_split`` where their compile options turn
    FMA contraction off (``_CPU_CAST["split"]``, set by ``_compile_options``), else ``cast_values``."""
    return round_split(y, fmt) if _CPU_CAST.get("split") else cast_values(y, fmt)


def _decode_to(codes: torch.Tensor, fmt: Format, dtype: torch.dtype) -> torch.Tensor:
    return decode_cpu(codes, fmt).to(dtype)


def _decode_torch(codes: torch.Tensor, fmt: Format, dtype: torch.dtype) -> torch.Tensor:
    return codes.view(fmt.dtype).to(dtype)


def decode_fp8(codes: torch.Tensor, fmt: Format, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 codes as exact ``dtype`` values (unscaled). CPU: ``decode_cpu``, fused into the caller's
    graph when compiling and compiled on its own in eager mode; elsewhere torch's own conversion."""
    if codes.device.type != "cpu":
        return _decode_torch(codes, fmt, dtype)
    if torch.compiler.is_compiling():
        return _decode_to(codes, fmt, dtype)
    return run_kernel("decode", _decode_torch, codes.view(torch.uint8), fmt, dtype)


def scale_output_eager(
    acc: torch.Tensor,
    s1: torch.Tensor,
    s2: torch.Tensor | None,
    ids: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A GEMM epilogue: ``(acc.float() * s1 * s2[ids]).to(dtype)`` (``s2`` itself where ``ids`` is None;
    no second factor where ``s2`` is None), float32 math in that order, one pass when compiled."""
    out = acc.float() * s1
    if s2 is not None:
        out = out * (s2 if ids is None else s2[ids])
    return out.to(dtype)


def scale_output(
    acc: torch.Tensor,
    s1: torch.Tensor,
    s2: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``scale_output_eager`` as one compiled loop (CPU, eager mode); bit-exact to it: the same float32
    products in the same order. ``s1``/``s2`` broadcast against ``acc`` (``s2[ids]`` gathers per-group rows
    of scales, e.g. an expert's scales for each of its tokens)."""
    if acc.device.type != "cpu":
        return scale_output_eager(acc, s1, s2, ids, dtype)
    return run_kernel("scale_output", scale_output_eager, acc, s1, s2, ids, dtype)


def nvfp4_block_scales(
    amax: torch.Tensor, global_inv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``scaling.nvfp4_scales`` as one compiled kernel on CPU (eager mode): the scales a quantized NVFP4
    tensor stores, from its block amaxes (and a static per-tensor scale ``global_inv``), bit for bit the
    ones its quantize kernel multiplied by."""
    if global_inv is not None:
        return nvfp4_scales(amax, global_inv)
    if amax.device.type != "cpu" or torch.compiler.is_compiling():
        return nvfp4_scales(amax)
    return run_kernel("nvfp4_scales", nvfp4_scales, amax)


def dequantize_tiles_eager(
    codes: torch.Tensor, scale_inv: torch.Tensor, br: int, bc: int, fmt: Format, dtype: torch.dtype
) -> torch.Tensor:
    """``codes`` (``(..., R, C)`` uint8 FP8 bit patterns) times their tile's float32 multiplier
    ``scale_inv[..., i // br, j // bc]`` in float32, returned in ``dtype`` (contiguous)."""
    r, c = codes.shape[-2:]
    ri = torch.arange(r, device=codes.device) // br
    ci = torch.arange(c, device=codes.device) // bc
    return (decode_cpu(codes, fmt) * scale_inv[..., ri[:, None], ci[None, :]]).to(dtype).contiguous()


def dequantize_tiles(
    codes: torch.Tensor, scale_inv: torch.Tensor, br: int, bc: int, fmt: Format, dtype: torch.dtype
) -> torch.Tensor:
    """``dequantize_tiles_eager`` compiled into one loop on CPU (eager mode): the scales are read per tile
    instead of being expanded to the element grid first. Same values bit for bit."""
    if codes.device.type != "cpu":
        return dequantize_tiles_eager(codes, scale_inv, br, bc, fmt, dtype)
    return run_kernel("dequantize_tiles", dequantize_tiles_eager, codes, scale_inv, br, bc, fmt, dtype).contiguous()


def quantize_blocks_eager(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None = None, *, codes: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating round-to-nearest-even tile quantizer (eager). Same contract as the reference."""
    rows, cols = x.shape
    br, bc = spec.block
    tiles = x.reshape(rows // br, br, cols // bc, bc) if rows % br == 0 and cols % bc == 0 else tile_view(x, spec.block)
    amax = tiles.abs().amax(dim=(1, 3)).float()
    if scale is None:
        scale = scale_from_amax(amax, spec)
    y = cast_to_format(tiles.float() * scale[:, None, :, None], spec.fmt, codes).reshape(
        tiles.shape[0] * br, tiles.shape[2] * bc
    )
    if y.shape != (rows, cols):
        y = y[:rows, :cols].contiguous()  # drop the padding of ragged tiles from memory too
    return y, scale, amax


def _codes_and_values(
    y: torch.Tensor, fmt: Format, dtype: torch.dtype, with_codes: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The uint8 codes of the scaled float32 ``y`` (None without ``with_codes``) and their exact values in
    ``dtype``, from the same products in one loop."""
    return (cast_to_format(y, fmt, codes=True) if with_codes else None), kernel_values(y, fmt).to(dtype)


def quantize_values_eager(
    x: torch.Tensor,
    spec: BlockSpec,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    with_codes: bool = True,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blocks_eager`` (codes as uint8) for tiles that span whole rows (``spec.block[1]`` is
    the column count, the rows a multiple of ``spec.block[0]``), plus the codes' unscaled exact values in
    ``dtype`` (``kernel_values``: what a CPU GEMM reads), from the same float32 products in the same loop,
    so that nothing decodes the codes again. ``with_codes=False``: the values only (codes None), for
    operands that only CPU GEMMs read (no cast, no code bytes). ``amax``: each tile's
    amax where the caller has it (delayed scaling reduces before it quantizes), so ``x`` is read once."""
    rows, cols = x.shape
    br = spec.block[0]
    if amax is None:
        amax = x.reshape(rows // br, br * cols).abs().amax(dim=1, keepdim=True).float()
    if scale is None:
        scale = scale_from_amax(amax, spec)
    # each row's scale, and every big tensor in x's own layout: a reshape of a compiled output with
    # symbolic sizes costs inductor a copy
    y = x.float() * (scale if br == 1 else scale[torch.arange(rows, device=x.device) // br])
    codes, values = _codes_and_values(y, spec.fmt, dtype, with_codes)
    return codes, scale, amax, values


def quantize_tensor_values_eager(
    x: torch.Tensor,
    spec: BlockSpec,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    with_codes: bool = True,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_values_eager`` for one scale over all of ``x`` (``spec.block`` is ``x.shape``; not read,
    so that one compiled kernel serves every shape)."""
    amax, scale = _tensor_scale(x, spec, scale, amax)
    codes, values = _codes_and_values(x.float() * scale.reshape(()), spec.fmt, dtype, with_codes)
    return codes, scale, amax, values


def _values_only(x, spec, scale, dtype, amax=None):
    return quantize_values_eager(x, spec, scale, dtype, False, amax)


def _tensor_values_only(x, spec, scale, dtype, amax=None):
    return quantize_tensor_values_eager(x, spec, scale, dtype, False, amax)


def _tensor_scale(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # rows first, then across rows: compiled for symbolic sizes, a single flat max-reduction stays in
    # one Triton program on CUDA; per-row maxima spread over the GPU (max is exact in any order).
    if amax is None:
        amax = torch.abs(x).amax(dim=-1).amax().float().reshape(1, 1)
    return amax, scale_from_amax(amax, spec) if scale is None else scale


def _per_tensor(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None, *, codes: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    amax, scale = _tensor_scale(x, spec, scale)
    return cast_to_format(x.float() * scale.reshape(()), spec.fmt, codes), scale, amax


def quantize_pair_eager(
    x: torch.Tensor, spec: BlockSpec, spec_t: BlockSpec, *, codes: bool = False
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Quantize ``x`` along its rows and ``x.T`` along its rows (the copy a weight-gradient GEMM needs)."""
    return quantize_blocks_eager(x, spec, codes=codes), quantize_blocks_eager(x.t(), spec_t, codes=codes)


def transpose_last_eager(x: torch.Tensor) -> torch.Tensor:
    """``x.transpose(-2, -1).contiguous()``."""
    return x.transpose(-2, -1).contiguous()


def transpose_last(x: torch.Tensor) -> torch.Tensor:
    """``x.transpose(-2, -1).contiguous()`` as one compiled loop on CPU (eager mode): inductor tiles the
    transposing copy, 2-3x faster than ATen's strided copy (and 3x than a 2-D transpose per matrix) for
    (8, 1024, 1024) bf16 expert weights read from memory (AMX Xeon, 2 threads: 5.3 ms against 10.9 and
    16.2 ms; ``benchmarks/moe.py``'s MXFP8 steps quantize one such copy per weight)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return transpose_last_eager(x)
    return run_kernel("transpose", transpose_last_eager, x)


_PLAIN = {
    "transpose": transpose_last_eager,
    "decode": _decode_to,
    "scale_output": scale_output_eager,
    "dequantize_tiles": dequantize_tiles_eager,
    "nvfp4_scales": nvfp4_scales,
    "values": quantize_values_eager,
    "tensor_values": quantize_tensor_values_eager,
    "values_only": _values_only,
    "tensor_values_only": _tensor_values_only,
}  # compiled as they are (the quantize kernels: ``_CODES``)


def register_kernel(kind: str, eager) -> None:
    """Compile ``eager`` as kernel ``kind`` (``run_kernel(kind, eager, ...)``), as fp8kit's own kernels are."""
    _PLAIN[kind] = eager


def _per_tensor_codes(x, spec, scale):
    return _per_tensor(x, spec, scale, codes=True)


def _tiles_codes(x, spec, scale):
    return quantize_blocks_eager(x, spec, scale, codes=True)


def _pair_codes(x, spec, spec_t):
    return quantize_pair_eager(x, spec, spec_t, codes=True)


# The quantize kernels with ``codes=True``, each its own function: dynamo keeps compiled variants (and
# counts them against its recompile limit) per code object, and ``functools.partial``s of them would
# all share one wrapper's.
_CODES = {"tensor": _per_tensor_codes, "tiles": _tiles_codes, "pair": _pair_codes}


@functools.cache
def _compiled(kind: str):
    # One model has many operand shapes (x, x.T, dy, dy.T, W per layer): compile for symbolic sizes,
    # and allow more cached variants (specs, static vs computed scale) than dynamo's default of 8.
    cfg = torch._dynamo.config
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, max(getattr(cfg, attr), 64))
    fn = _PLAIN[kind] if kind in _PLAIN else _CODES[kind]
    # Static compile; ``_dynamic`` marks the tensor sizes symbolic instead. (``dynamic=True`` would
    # also turn the format's and spec's integers into runtime values, 3x slower kernels on CPU.)
    return torch.compile(fn, dynamic=False, options=_compile_options())


def _compile_options() -> dict[str, object]:
    """Inductor options of fp8kit's kernels. ``cpp.dynamic_threads``: OpenMP threads in every loop,
    whatever sizes the kernel was first compiled for (a kernel compiled for symbolic sizes keeps the
    parallel decision of its first, maybe tiny, example: seen single-threaded, 2x slower on 2 cores).
    FMA contraction off where this torch has the setting, which makes ``round_split`` exact (recorded
    in ``_CPU_CAST["split"]``)."""
    from torch._inductor import config as inductor_config

    options: dict[str, object] = {"cpp.dynamic_threads": True}
    if hasattr(inductor_config.cpp, "enable_floating_point_contract_flag"):
        options["cpp.enable_floating_point_contract_flag"] = "off"
        _CPU_CAST["split"] = True
    return options


def _dynamic(a):
    """Detach a tensor argument and mark its sizes dynamic (one compiled kernel for all shapes)."""
    if not isinstance(a, torch.Tensor):
        return a
    a = a.detach()
    for dim in range(a.dim()):
        torch._dynamo.maybe_mark_dynamic(a, dim)
    return a


def run_kernel(kind: str, eager, *args):
    """Run the compiled kernel ``kind``; use ``eager`` when compiling is off, nested or unavailable."""
    if not _COMPILE["enabled"] or torch.compiler.is_compiling():
        return eager(*args)
    try:
        _IN_OWN_KERNEL[0] = True
        try:
            return _compiled(kind)(*(_dynamic(a) for a in args))
        finally:
            _IN_OWN_KERNEL[0] = False
    except Exception as err:  # no C++ compiler, unsupported platform...
        if _COMPILE["strict"]:
            raise RuntimeError(f"fp8kit: compiled quantize kernel {kind!r} failed ({err}); strict mode is on") from err
        warnings.warn(f"fp8kit: compiled quantize kernel unavailable ({err}); using eager kernels", stacklevel=3)
        set_compile_enabled(False)
        return eager(*args)


def _as_format(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], fmt: Format):
    """View the uint8 codes of the compiled CPU cast as ``fmt.dtype`` (a free reinterpretation)."""
    data, scale, amax = out
    if data.dtype == torch.uint8 and fmt.kind == "float":
        data = data.view(fmt.dtype)
    return data, scale, amax


def quantize_blocks_fused(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compiled tile quantizer; bit-exact to ``quantize_blocks_reference`` with saturation and RNE."""
    if tuple(spec.block) == tuple(x.shape):
        return _as_format(run_kernel("tensor", _per_tensor, x, spec, scale), spec.fmt)
    return _as_format(run_kernel("tiles", quantize_blocks_eager, x, spec, scale), spec.fmt)


def quantize_values_fused(
    x: torch.Tensor,
    spec: BlockSpec,
    scale: torch.Tensor | None,
    dtype: torch.dtype,
    with_codes: bool = True,
    amax: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Compiled ``quantize_values_eager`` (``quantize_tensor_values_eager`` for one scale): ``((codes as
    fmt.dtype, scale, amax), values)``; ``with_codes=False``: codes None; ``amax``: known tile amaxes."""
    per_tensor = tuple(spec.block) == tuple(x.shape)
    if with_codes:
        kind, eager = (
            ("tensor_values", quantize_tensor_values_eager) if per_tensor else ("values", quantize_values_eager)
        )
        codes, sc, amax, values = run_kernel(kind, eager, x, spec, scale, dtype, True, amax)
        return _as_format((codes, sc, amax), spec.fmt), values
    kind, eager = ("tensor_values_only", _tensor_values_only) if per_tensor else ("values_only", _values_only)
    _, sc, amax, values = run_kernel(kind, eager, x, spec, scale, dtype, amax)
    return (None, sc, amax), values


def quantize_pair_fused(x: torch.Tensor, spec: BlockSpec, spec_t: BlockSpec):
    """Compiled ``quantize_pair_eager``: both orientations from one graph that reads ``x``."""
    out, out_t = run_kernel("pair", quantize_pair_eager, x, spec, spec_t)
    return _as_format(out, spec.fmt), _as_format(out_t, spec_t.fmt)
