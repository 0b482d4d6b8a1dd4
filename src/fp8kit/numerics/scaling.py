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

NVFP4 (``nvfp4_scales``) follows the same rule for its per-tensor scale; its E4M3 block scales are
clamped to ``[2**-6, 448]`` as the GPU kernels do, so an all-zero block gets ``2**-6`` and zero codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import E2M1, E4M3, Format, get_format

__all__ = [
    "MAX_SCALE",
    "MIN_SCALE",
    "NVFP4_TENSOR_MAX",
    "Granularity",
    "amax_to_scale",
    "compute_scale",
    "dequant_scale",
    "mx_scale",
    "named_element_bits",
    "nvfp4_scales",
    "nvfp4_tensor_scale",
    "parse_granularity",
]

MAX_SCALE = 2.0**120
MIN_SCALE = 2.0**-120
NVFP4_TENSOR_MAX = E4M3.max * E2M1.max  # 2688: the per-tensor scale lets block scales use E4M3's range


def _wide(t: torch.Tensor) -> torch.dtype:
    """The dtype for a correctly rounded float32 quotient (float64; MPS has none)."""
    return torch.float32 if t.device.type == "mps" else torch.float64


def _div32(a: torch.Tensor | float, b: torch.Tensor) -> torch.Tensor:
    """``a / b`` correctly rounded to float32 on every backend (see ``compute_scale``): float32 IEEE
    division's result, where Triton's float32 division is approximate."""
    wide = _wide(b)
    return (torch.as_tensor(a, device=b.device).to(wide) / b.to(wide)).float()


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
    scale = (fmt.max / amax.to(_wide(amax)) / 2.0**margin).float()
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


def nvfp4_tensor_scale(tensor_amax: torch.Tensor | float) -> torch.Tensor:
    """NVFP4's per-tensor dequantization multiplier for a tensor amax: ``amax / 2688`` in float32 (0-d),
    clamped to ``[2**-120, 2**120]``; 1.0 for a zero or non-finite amax."""
    tensor_amax = torch.as_tensor(tensor_amax, dtype=torch.float32).reshape(())
    global_inv = torch.clamp(_div32(tensor_amax, tensor_amax.new_tensor(NVFP4_TENSOR_MAX)), MIN_SCALE, MAX_SCALE)
    usable = (tensor_amax > 0) & torch.isfinite(tensor_amax)
    return torch.where(usable, global_inv, torch.ones_like(global_inv))


def nvfp4_scales(
    amax: torch.Tensor, global_inv: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4's two-level scales from the 1x16 block amaxes ``amax`` (float32, any shape) of one tensor.

    The numerics of torchao's ``nvfp4_quantize`` with ``per_tensor_scale = amax / (448 * 6)`` and of the
    GPU kernels it matches, each step rounded to float32 as there:

    * ``global_inv = tensor_amax / 2688`` (the per-tensor dequantization multiplier);
    * ``block = E4M3(clamp(block_amax / 6 / global_inv, 2**-6, 448))`` (round to nearest even);
    * ``multiplier = (1 / global_inv) / block``: the data is multiplied by it, then cast to E2M1.

    Returns ``(block scales as float8_e4m3fn, global_inv as a 0-d float32, multiplier float32)``; the
    dequantized value is ``code * (block * global_inv)``. Degenerate amax (module docstring): a zero or
    non-finite tensor amax gives ``global_inv = 1.0``, a non-finite block amax counts as zero, and
    ``global_inv`` is clamped to ``[2**-120, 2**120]``, so nothing is inf or NaN.

    A given ``global_inv`` (a static per-tensor scale, e.g. calibrated activations: torchao's
    ``per_tensor_scale``) is used as is; blocks whose amax exceeds ``2688 * global_inv`` get block scale
    448 and saturate.
    """
    amax = amax.float()
    bad = ~torch.isfinite(amax)
    amax = torch.where(bad, torch.zeros_like(amax), amax)
    if global_inv is None:
        global_inv = nvfp4_tensor_scale(torch.where(bad.any(), amax.new_tensor(0.0), amax.amax()))
    else:
        global_inv = torch.as_tensor(global_inv, dtype=torch.float32, device=amax.device).reshape(())
    per_block = _div32(_div32(amax, amax.new_tensor(E2M1.max)), global_inv)
    block = torch.clamp(per_block, E4M3.min_normal, E4M3.max).to(E4M3.dtype)
    multiplier = _div32(_div32(1.0, global_inv), block.float())
    return block, global_inv, multiplier


@dataclass(frozen=True)
class Granularity:
    """How scales are shared over a 2-D tensor ``(rows, cols)``.

    ``kind`` is one of ``"tensor"``, ``"row"`` (one scale per row, e.g. per token), ``"column"`` (one per
    column, e.g. per output channel of a ``(in, out)`` matrix), ``"block"`` (``block = (br, bc)`` tiles,
    ragged last tiles allowed), ``"mx"`` (1x32 blocks along rows with power-of-two E8M0 scales: MXFP8
    with an FP8 element format, MXFP4 with E2M1) or ``"nvfp4"`` (1x16 blocks along rows with E4M3 block
    scales under an FP32 per-tensor scale, ``nvfp4_scales``; E2M1 elements).
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

    @property
    def is_nvfp4(self) -> bool:
        return self.kind == "nvfp4"

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
        if self.kind == "nvfp4" and self.block is not None:
            return f"nvfp4-{self.block[0]}x{self.block[1]}"
        return self.kind


_SPELLINGS = "'tensor', 'row', 'column', 'mx', 'nvfp4', 'mxfp4', (1, 128), (128, 128), (br, bc) or a Granularity"


def _spelling(spec: str) -> str:
    return spec.lower().replace("-", "").replace("_", "")


def named_element_bits(spec: Granularity | str | tuple[int, int] | list[int]) -> int | None:
    """The element width a granularity's spelling names: 4 for ``"nvfp4"`` / ``"mxfp4"``, 8 for
    ``"mxfp8"``, else None (the format decides)."""
    if not isinstance(spec, str):
        return None
    return {"nvfp4": 4, "mxfp4": 4, "mxfp8": 8}.get(_spelling(spec))


def parse_granularity(spec: Granularity | str | tuple[int, int] | list[int]) -> Granularity:
    """Accept ``"tensor"``, ``"row"``, ``"column"``, ``"mx"`` (``"mxfp8"``, ``"mxfp4"``), ``"nvfp4"``,
    ``(br, bc)`` tuples or a ``Granularity``."""
    if isinstance(spec, Granularity):
        return spec
    if isinstance(spec, str):
        key = _spelling(spec)
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
            "mxfp4": Granularity("mx", (1, 32)),
            "nvfp4": Granularity("nvfp4", (1, 16)),
        }
        if key in table:
            return table[key]
        raise ValueError(f"unknown granularity {spec!r}; accepted: {_SPELLINGS}")
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and all(isinstance(v, int) and v > 0 for v in spec):
        return Granularity("block", (int(spec[0]), int(spec[1])))
    raise ValueError(f"unknown granularity {spec!r}; accepted: {_SPELLINGS}")
