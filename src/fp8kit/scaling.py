"""Scale math: amax -> scale, and the granularities at which scales are shared.

Conventions (as in Transformer Engine and torchao):

* ``scale`` multiplies high-precision values before the cast: ``q = cast(x * scale)``.
* ``scale_inv = 1 / scale`` is the dequantization multiplier: ``x ~= q * scale_inv``. Quantized
  tensors and exported checkpoints store ``scale_inv`` (for E4M3 per tensor it equals ``amax / 448``).

Rule for degenerate amax (documented, tested): ``compute_scale`` never returns inf or NaN.

* ``amax == 0`` (an all-zero tensor or block): the scale is ``previous`` if given, else 1.0. Any scale
  quantizes zeros exactly.
* non-finite amax (the tensor holds NaN or inf): the scale is ``previous`` if given, else 1.0. Callers
  that can name the tensor report it (``quantize`` raises by default; FP8 modules name the layer).
* tiny or huge amax: the scale is clamped to ``[2**-120, 2**120]`` so that it and its inverse stay
  normal float32 numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import E4M3, Format, get_format

__all__ = [
    "MAX_SCALE",
    "MIN_SCALE",
    "Granularity",
    "amax_to_scale",
    "compute_scale",
    "dequant_scale",
    "mx_scale",
    "parse_granularity",
]

MAX_SCALE = 2.0**120
MIN_SCALE = 2.0**-120


def compute_scale(
    amax: torch.Tensor | float,
    fmt: Format | str = E4M3,
    margin: int | float = 0,
    power_of_two: bool = False,
    previous: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``scale = fmt.max / amax / 2**margin`` (float32), optionally rounded down to a power of two.

    Args:
        amax: absolute maximum (scalar or tensor of per-block maxima), any float dtype.
        fmt: target format of the cast that the scale prepares.
        margin: extra headroom in binades (Transformer Engine's ``margin``).
        power_of_two: round the scale down to ``2**floor(log2(scale))`` (exact dequantization).
        previous: scale to keep where amax is zero or non-finite (else 1.0).
    """
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32).float()
    # Divide in float64 and round once to float32: the correctly rounded float32 quotient (53 >= 2*24+2
    # bits make the double rounding innocuous), on every backend. Triton's float32 division is
    # approximate, so a compiled CUDA kernel would otherwise be an ulp off eager scales.
    wide = torch.float32 if amax.device.type == "mps" else torch.float64  # MPS has no float64
    scale = (fmt.max / amax.to(wide) / 2.0**margin).float()
    scale = torch.clamp(scale, MIN_SCALE, MAX_SCALE)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fallback = (
        torch.ones_like(scale) if previous is None else torch.as_tensor(previous, dtype=torch.float32).expand_as(scale)
    )
    bad = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(bad, fallback, scale)


amax_to_scale = compute_scale


def dequant_scale(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Stored dequant multipliers for ``amax`` (any shape), as PTQ exports them: ``amax / fmt.max`` in float32, correctly
    rounded (the compressed-tensors and vLLM convention, as fp8kit always stored it).

    ``fp8kit.quantize`` makes the codes with ``compute_scale(amax)``, whose inverse can be one ulp away
    from ``amax / fmt.max``. Where ``amax / fmt.max`` is not the scale the codes were made with (amax
    zero, so an all-zero row; non-finite; or below ``fmt.max / 2**120``) the quantizer's own inverse
    ``1 / compute_scale(amax)`` is stored instead: finite and positive (1.0 for an all-zero row, whose
    codes are all zero)."""
    amax = amax.float()
    own = (1.0 / compute_scale(amax, fmt)).float()
    usable = (amax > 0) & torch.isfinite(amax) & (fmt.max / amax.double() <= MAX_SCALE)
    return torch.where(usable, amax / fmt.max, own)


def mx_scale(amax: torch.Tensor, fmt: Format | str = E4M3, rounding: str = "rceil") -> torch.Tensor:
    """Power-of-two MX block scale (float32) for elements of ``fmt``.

    * ``"floor"`` (OCP MX v1.0): ``scale_inv = 2**(floor(log2(amax)) - emax)`` where ``emax`` is the
      exponent of ``fmt``'s largest binade (8 for E4M3, 15 for E5M2). Values above ``fmt.max`` in the
      block are clipped by the saturating cast.
    * ``"rceil"`` (NVIDIA Blackwell): ``scale_inv = 2**ceil(log2(amax / fmt.max))``: never clips.

    Returns the multiplier ``scale`` (``1 / scale_inv``), within E8M0's range ``2**[-127, 127]``.
    Zero or non-finite amax gives scale 1.0.
    """
    fmt = get_format(fmt)
    amax = amax.float()
    bad = (amax == 0) | ~torch.isfinite(amax)
    safe = torch.where(bad, torch.ones_like(amax), amax)
    if rounding == "floor":
        emax = math.floor(math.log2(fmt.max))
        _, exp = torch.frexp(safe)
        e = (exp - 1 - emax).float()
    elif rounding == "rceil":
        ratio = safe / fmt.max
        mant, exp = torch.frexp(ratio)
        # ceil(log2(ratio)) computed exactly: ratio = mant * 2**exp with mant in [0.5, 1)
        e = torch.where(mant == 0.5, exp - 1, exp).float()
    else:
        raise ValueError(f"unknown MX scale rounding {rounding!r}; accepted: 'rceil', 'floor'")
    e = e.clamp(-127, 127)
    scale = torch.exp2(-e)
    return torch.where(bad, torch.ones_like(scale), scale)


@dataclass(frozen=True)
class Granularity:
    """How scales are shared over a 2-D tensor ``(rows, cols)``.

    ``kind`` is one of ``"tensor"``, ``"row"`` (one scale per row, e.g. per token), ``"column"`` (one per
    column, e.g. per output channel of a ``(in, out)`` matrix), ``"block"`` (``block = (br, bc)`` tiles,
    ragged last tiles allowed) or ``"mx"`` (1x32 blocks along rows with power-of-two E8M0 scales).
    Tensors with more than two dimensions are viewed as ``(prod(leading dims), last dim)``.
    """

    kind: str
    block: tuple[int, int] | None = None

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """Tile shape ``(br, bc)`` for a ``(rows, cols)`` tensor."""
        if self.kind == "tensor":
            return max(rows, 1), max(cols, 1)
        if self.kind == "row":
            return 1, max(cols, 1)
        if self.kind == "column":
            return max(rows, 1), 1
        assert self.block is not None
        return self.block

    @property
    def is_mx(self) -> bool:
        return self.kind == "mx"

    def transposed(self) -> Granularity:
        """The granularity that describes the transposed tensor."""
        swap = {"row": "column", "column": "row"}
        if self.kind in swap:
            return Granularity(swap[self.kind])
        if self.block is not None:
            return Granularity(self.kind, (self.block[1], self.block[0]))
        return self

    def __str__(self) -> str:
        if self.kind in ("block", "mx") and self.block is not None:
            return f"{self.kind}{self.block[0]}x{self.block[1]}"
        return self.kind


_SPELLINGS = "'tensor', 'row', 'column', 'mx', (1, 128), (128, 128), (br, bc) or a Granularity"


def parse_granularity(spec: Granularity | str | tuple[int, int] | list[int]) -> Granularity:
    """Accept ``"tensor"``, ``"row"``, ``"column"``, ``"mx"``, ``(br, bc)`` tuples or a ``Granularity``."""
    if isinstance(spec, Granularity):
        return spec
    if isinstance(spec, str):
        key = spec.lower().replace("-", "").replace("_", "")
        table = {
            "tensor": Granularity("tensor"),
            "pertensor": Granularity("tensor"),
            "row": Granularity("row"),
            "rowwise": Granularity("row"),
            "token": Granularity("row"),
            "column": Granularity("column"),
            "channel": Granularity("column"),
            "mx": Granularity("mx", (1, 32)),
            "mxfp8": Granularity("mx", (1, 32)),
        }
        if key in table:
            return table[key]
        raise ValueError(f"unknown granularity {spec!r}; accepted: {_SPELLINGS}")
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and all(isinstance(v, int) and v > 0 for v in spec):
        return Granularity("block", (int(spec[0]), int(spec[1])))
    raise ValueError(f"unknown granularity {spec!r}; accepted: {_SPELLINGS}")
