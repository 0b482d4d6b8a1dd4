"""Number formats and bit-exact casts (no scaling).

Formats follow the OCP 8-bit floating point specification (OFP8, "FP8 Formats for Deep Learning"):

* ``E4M3`` (``float8_e4m3fn``): bias 7, max 448, no infinities, one NaN pattern per sign.
* ``E5M2`` (``float8_e5m2``): bias 15, max 57344, IEEE-like infinities and NaNs.
* ``E8M0``: the power-of-two block scale of the OCP MX formats, stored as a biased exponent byte
  (value ``2**(code - 127)``, code 255 is NaN).
* ``E2M1`` (FP4, OCP MX ``FP4``): bias 1, values ``+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, no inf or NaN (casts
  saturate). Held one code per ``uint8`` in ml_dtypes' ``float4_e2m1fn`` bit layout (sign bit 3, exponent
  bits 2-1, mantissa bit 0); ``state_dict.pack_fp4`` packs two per byte for storage.
* ``INT8``: symmetric signed integers in ``[-127, 127]`` (used for the FP8-vs-INT8 comparison).

``cast`` rounds high-precision values to the nearest representable value of a format and returns a
tensor of the format's torch dtype (E2M1: its ``uint8`` codes). Round-to-nearest-even is bit-exact (tested
against ``ml_dtypes`` for every bfloat16 pattern); stochastic rounding is unbiased.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "INT8",
    "FORMATS",
    "Format",
    "cast",
    "cast_reference",
    "get_format",
    "check_float_input",
    "e2m1_decode",
    "e2m1_encode",
]

HIGH_PRECISION_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Format:
    """A narrow number format.

    Attributes:
        name: short name, e.g. ``"e4m3"``.
        kind: ``"float"``, ``"int"`` or ``"scale"`` (E8M0).
        exponent_bits / mantissa_bits: field widths (mantissa bits exclude the implicit one).
        bias: exponent bias.
        max: largest finite magnitude.
        min_normal: smallest positive normal magnitude.
        min_subnormal: smallest positive magnitude (subnormal for floats, 1 for INT8).
        dtype: the torch dtype that holds the values (``torch.uint8`` codes for E8M0 and E2M1).
        has_inf: whether the format encodes infinities.
    """

    name: str
    kind: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    dtype: torch.dtype
    has_inf: bool

    @property
    def binades(self) -> float:
        """Dynamic range in binades: ``log2(max / min_subnormal)``."""
        return math.log2(self.max / self.min_subnormal)

    @property
    def sub_byte(self) -> bool:
        """Whether the format is a float narrower than 8 bits (E2M1), held as ``uint8`` codes."""
        return self.kind == "float" and 1 + self.exponent_bits + self.mantissa_bits < 8

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        return 1 - self.bias

    @property
    def overflow_threshold(self) -> float:
        """Magnitude at or above which round-to-nearest-even leaves the finite range.

        It is the midpoint between ``max`` and the next value of an unbounded format. A value exactly on
        it rounds to ``max`` when ``max`` has an even mantissa (E4M3: 464 -> 448) and overflows otherwise
        (E5M2: 61440 -> inf).
        """
        half_ulp = 2.0 ** (math.floor(math.log2(self.max)) - self.mantissa_bits - 1)
        return self.max + half_ulp

    @property
    def max_mantissa_is_even(self) -> bool:
        top = math.floor(math.log2(self.max))
        mantissa = round(self.max / 2.0**top * 2**self.mantissa_bits) - 2**self.mantissa_bits
        return mantissa % 2 == 0

    def __str__(self) -> str:
        return self.name.upper()


E4M3 = Format("e4m3", "float", 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, torch.float8_e4m3fn, False)
E5M2 = Format("e5m2", "float", 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, torch.float8_e5m2, True)
E8M0 = Format("e8m0", "scale", 8, 0, 127, 2.0**127, 2.0**-127, 2.0**-127, torch.uint8, False)
INT8 = Format("int8", "int", 0, 7, 0, 127.0, 1.0, 1.0, torch.int8, False)
E2M1 = Format("e2m1", "float", 2, 1, 1, 6.0, 1.0, 0.5, torch.uint8, False)

FORMATS: dict[str, Format] = {f.name: f for f in (E4M3, E5M2, E8M0, INT8, E2M1)}
_ALIASES = {
    "float8_e4m3fn": "e4m3",
    "fp8_e4m3": "e4m3",
    "float8_e5m2": "e5m2",
    "fp8_e5m2": "e5m2",
    "e8m0fnu": "e8m0",
    "float4_e2m1fn": "e2m1",
    "fp4_e2m1": "e2m1",
}


def get_format(fmt: Format | str | torch.dtype) -> Format:
    """Return the ``Format`` for a format object, a name (``"e4m3"``, ``"E5M2"``...) or a torch dtype."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        for f in FORMATS.values():
            if f.dtype == fmt and f.kind != "scale" and not f.sub_byte:
                return f
        raise ValueError(f"no fp8kit format holds torch dtype {fmt}; accepted: float8_e4m3fn, float8_e5m2, int8")
    if isinstance(fmt, str):
        key = fmt.lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise ValueError(f"unknown format {fmt!r}; accepted: {', '.join(sorted(FORMATS))}")


def check_float_input(x: torch.Tensor, what: str = "input") -> None:
    """Raise ``TypeError`` unless ``x`` is a high-precision floating tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{what} has dtype {x.dtype}; fp8kit needs a high-precision float tensor "
            "(float32, float64, bfloat16 or float16). Convert it first, e.g. x.float()."
        )


def _quantum(mag: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Spacing of ``fmt``'s representable values around each magnitude (unbounded exponent range)."""
    _, exp = torch.frexp(mag)  # mag = m * 2**exp with m in [0.5, 1)
    binade = torch.clamp(exp - 1, min=fmt.min_exponent)
    return torch.ldexp(torch.ones_like(mag), binade - fmt.mantissa_bits)


def _apply_range(rounded: torch.Tensor, fmt: Format, saturate: bool) -> torch.Tensor:
    """Clip or overflow values that were rounded without an upper bound."""
    if saturate:
        return rounded.clamp(-fmt.max, fmt.max)
    overflow = rounded.abs() > fmt.max
    special = math.inf if fmt.has_inf else math.nan
    return torch.where(overflow, torch.copysign(torch.full_like(rounded, special), rounded), rounded)


def cast_reference(
    x: torch.Tensor,
    fmt: Format | str,
    *,
    saturate: bool = True,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Plainly written cast: returns the rounded values in ``x``'s dtype (float32 or float64).

    Rounds ``|x| / quantum`` to an integer (half to even, or stochastically), where ``quantum`` is the
    spacing of the format's values in the binade of ``x``; then applies saturation or overflow.
    All steps are exact in binary floating point, so this is a mathematically exact reference.
    """
    fmt = get_format(fmt)
    check_float_input(x)
    work = x if x.dtype == torch.float64 else x.float()
    if fmt.kind == "int":
        rounded = _round(work, torch.ones_like(work), rounding, generator)
        out = rounded.clamp(-fmt.max, fmt.max)
        return torch.where(torch.isnan(work), torch.zeros_like(out), out)
    if fmt.kind != "float":
        raise ValueError(f"cast() takes an element format (e4m3, e5m2, e2m1, int8), not {fmt.name}")
    mag = work.abs()
    finite = torch.isfinite(mag)
    q = _quantum(torch.where(finite, mag, torch.ones_like(mag)), fmt)
    rounded = torch.copysign(_round(mag, q, rounding, generator), work)
    rounded = torch.where(finite, rounded, work)  # NaN stays NaN, +-inf is handled as overflow
    return _apply_range(rounded, fmt, saturate)


def _round(mag: torch.Tensor, q: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    scaled = mag / q  # exact: q is a power of two
    if rounding == "nearest":
        return torch.round(scaled) * q  # torch.round rounds half to even
    if rounding == "stochastic":
        u = torch.rand(mag.shape, generator=generator, dtype=mag.dtype, device=mag.device)
        return torch.floor(scaled.abs() + u).copysign(scaled) * q
    raise ValueError(f"unknown rounding {rounding!r}; accepted: 'nearest', 'stochastic'")


def cast(
    x: torch.Tensor,
    fmt: Format | str,
    *,
    saturate: bool = True,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Round ``x`` to the nearest values of ``fmt`` and return them in the format's torch dtype.

    Args:
        x: float32/float64/bfloat16/float16 tensor. Values are not scaled.
        fmt: ``E4M3``, ``E5M2``, ``E2M1`` or ``INT8`` (or their names). E2M1 returns its ``uint8`` codes,
            one per element (``e2m1_decode`` reads them back).
        saturate: ``True`` maps overflow and +-inf to +-max (NaN stays NaN). ``False`` follows the OCP
            non-saturating rule: E4M3 overflow -> NaN, E5M2 overflow -> +-inf. INT8 always saturates
            (and maps NaN to 0). E2M1 has no inf or NaN: it always saturates, and NaN input raises.
        rounding: ``"nearest"`` (round half to even) or ``"stochastic"`` (unbiased: rounds up with
            probability equal to the distance to the lower neighbour over the spacing).
        generator: random generator for stochastic rounding (reproducible when seeded).
    """
    fmt = get_format(fmt)
    check_float_input(x)
    if fmt.kind != "float" and fmt.kind != "int":
        raise ValueError(f"cast() takes an element format (e4m3, e5m2, e2m1, int8), not {fmt.name}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"unknown rounding {rounding!r}; accepted: 'nearest', 'stochastic'")
    if fmt.kind == "int":
        return cast_reference(x, fmt, rounding=rounding, generator=generator).to(torch.int8)
    if fmt.sub_byte:
        check_sub_byte_input(x, fmt, saturate)
        return e2m1_encode(cast_reference(x, fmt, rounding=rounding, generator=generator))
    if rounding == "stochastic" or x.dtype == torch.float64:
        # float64 goes through the exact path: torch converts float64 -> float32 -> fp8, which
        # rounds twice and can be off by one code at ties.
        return cast_reference(x, fmt, saturate=saturate, rounding=rounding, generator=generator).to(fmt.dtype)
    return cast_nearest_fast(x, fmt, saturate)


def check_sub_byte_input(x: torch.Tensor, fmt: Format, saturate: bool = True) -> None:
    """Raise ``ValueError`` where ``x`` cannot be cast to ``fmt`` (E2M1): NaN input, or ``saturate=False``."""
    if not saturate:
        raise ValueError(f"{fmt} has no inf or NaN, so it always saturates: pass saturate=True")
    if bool(torch.isnan(x).any()):
        raise ValueError(
            f"input holds NaN, which {fmt} cannot encode; fix the producer of the values, or replace them "
            "first (e.g. torch.nan_to_num)"
        )


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, ml_dtypes' ``float4_e2m1fn`` layout) of exact E2M1 values (any float dtype).

    ``|v| < 1`` is subnormal (code ``2 |v|``); otherwise the code is ``(exponent + 1) << 1 | mantissa``
    with ``|v| = (1 + mantissa / 2) * 2**exponent``; the sign goes to bit 3 (-0.0 keeps it)."""
    mag = values.float().abs()
    mant, exp = torch.frexp(mag)  # mag = mant * 2**exp, mant in [0.5, 1)
    normal = (exp << 1) | (mant >= 0.75).to(torch.int32)  # (exp - 1 + bias) << 1 | mantissa bit, bias 1
    code = torch.where(mag < E2M1.min_normal, (mag * 2).to(torch.int32), normal)
    return (code | (torch.signbit(values).to(torch.int32) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) as their exact float32 values."""
    c = codes.to(torch.int32)
    exp_field, mant = (c >> 1) & 0x3, (c & 1).float()
    normal = torch.ldexp(1.0 + mant / 2, exp_field - E2M1.bias)
    mag = torch.where(exp_field == 0, mant * E2M1.min_subnormal, normal)
    return torch.where((c & 0x8) != 0, -mag, mag)


def cast_nearest_fast(x: torch.Tensor, fmt: Format, saturate: bool) -> torch.Tensor:
    """Round-to-nearest-even through torch's native conversion (one pass when saturating).

    torch's conversion rounds to nearest even but clips E4M3 overflow to 448; the OCP non-saturating
    rule is applied here on top.
    """
    if saturate:
        return x.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    y = x.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    mag = x.abs()
    over = (mag > fmt.overflow_threshold) if fmt.max_mantissa_is_even else (mag >= fmt.overflow_threshold)
    if not bool(over.any()):
        return y
    special = math.inf if fmt.has_inf else math.nan
    fill = torch.copysign(torch.full_like(x, special, dtype=torch.float32), x.float())
    return torch.where(over, fill.to(fmt.dtype), y)


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Encode positive power-of-two float32 scales as E8M0 codes (uint8, value ``2**(code-127)``)."""
    _, exp = torch.frexp(scale.float())
    code = (exp - 1 + 127).clamp(0, 254)
    code = torch.where(torch.isfinite(scale) & (scale > 0), code, torch.full_like(code, 255))
    return code.to(torch.uint8)


def e8m0_decode(code: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 codes to float32 (code 255 -> NaN)."""
    c = code.to(torch.int32)
    val = torch.ldexp(torch.ones(c.shape, dtype=torch.float32, device=c.device), c - 127)
    return torch.where(c == 255, torch.full_like(val, math.nan), val)
