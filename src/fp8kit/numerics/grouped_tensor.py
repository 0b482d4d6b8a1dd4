"""Quantized operands of the MoE experts' grouped GEMMs (``fp8kit.gemm.grouped``) and their quantizers.

* ``GroupedWeight``: expert weights ``(E, R, C)`` quantized per expert (one scale per expert, per row, per
  MX block or per tile; NVFP4: each expert's own per-tensor scale over its E4M3 tile scales; never shared
  across experts). ``quantize_experts`` is the experts' one weight
  quantizer, for training (``nn.experts``) and PTQ (``ptq.experts``); ``quantize_experts_columns`` gives
  the transposed weight's row-wise quantization without a transposed copy.
* ``GroupColumns``: an operand of the weight-gradient GEMM quantized along the token dim with one scale
  per expert and row (``quantize_group_columns``): scales never cover two experts' tokens.

Their kernels are in ``kernels.grouped``; the GEMMs that multiply them in ``gemm.grouped``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.grouped import cast_scaled, quantize_columns_values, scaled_values
from ..kernels.opaque import dequantize_tiles, repeat_tiles
from ..kernels.reference import BlockSpec
from .formats import Format, e2m1_decode, e8m0_decode
from .scaling import Granularity, compute_scale
from .tensor import CodesFromValues, quantize

__all__ = [
    "GroupColumns",
    "GroupedWeight",
    "quantize_experts",
    "quantize_experts_columns",
    "quantize_group_columns",
]


@dataclass
class GroupedWeight(CodesFromValues):
    """Expert weights quantized per expert.

    Attributes:
        codes: ``(E, R, C)`` FP8 codes (E2M1: uint8 codes, one per element), ``C`` the GEMM's reduction dim;
            None where the kernel wrote only ``values`` (``quantize_experts(..., lazy_codes=True)``): ``data``
            encodes them on first read.
        scales: ``(E, ceil(R/br), ceil(C/bc))`` per-tile dequantization multipliers (float32, E8M0 uint8
            codes for MX, or float8_e4m3fn NVFP4 block scales relative to ``global_scale``).
        fmt, block, orig_dtype: element format, tile shape ``(br, bc)`` and the weight's dtype.
        amax: ``(E,)`` each expert's amax (float32) with one scale per expert, ``(E, R)`` each row's with
            row scales, where known.
        values: CPU only, where set (``with_weight_values``): the operand the GEMMs read, in the GEMM
            dtype, shape of ``data``: the unscaled FP8 values where the scales factor out of the GEMM
            (``scales_factor_out``), else the dequantized weight. One decode then feeds the forward and
            the input-gradient GEMM of a weight whose transpose is a view (per-tensor, square tiles).
        global_scale: NVFP4: ``(E,)`` float32, each expert's per-tensor dequantization multiplier (a tile's
            multiplier is ``scales * global_scale[e]``); None otherwise.
    """

    codes: torch.Tensor | None
    scales: torch.Tensor
    fmt: Format
    block: tuple[int, int]
    orig_dtype: torch.dtype
    is_mx: bool = False
    values: torch.Tensor | None = None
    amax: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def scale_inv(self) -> torch.Tensor:
        if self.global_scale is not None:
            return self.scales.float() * self.global_scale.reshape(-1, 1, 1)
        return e8m0_decode(self.scales) if self.scales.dtype == torch.uint8 else self.scales

    def code_values(self) -> torch.Tensor:
        """The codes as a GEMM reads them: FP8 codes as stored, E2M1 codes decoded to float32."""
        return e2m1_decode(self.data) if self.fmt.sub_byte else self.data

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_tiles(self.code_values(), self.scale_inv.float(), self.block, dtype).contiguous()

    def transpose(self) -> GroupedWeight:
        """``(E, C, R)``: per-expert transposes (tiles transpose with them; no requantization). ``values``
        go along only where the scales factor out of both GEMMs or of neither (the values are unscaled in
        the one case, dequantized in the other; a tile spanning K need not span the transpose's K)."""
        flipped = (self.scales.transpose(1, 2), self.fmt, self.block[::-1], self.orig_dtype, self.is_mx)
        kw = {"global_scale": self.global_scale}
        if self.values is not None and self.scales_factor_out == (self.block[0] >= self.shape[1]):
            codes = None if self.codes is None else self.codes.transpose(1, 2)
            return GroupedWeight(codes, *flipped, values=self.values.transpose(1, 2), **kw)
        return GroupedWeight(self.data.transpose(1, 2), *flipped, **kw)

    def row_scales(self) -> torch.Tensor:
        """``(E, R)`` per-row multipliers (``(E, 1)`` for one scale per expert); needs one tile along C."""
        s = self.scale_inv[:, :, 0]
        if s.shape[1] == 1:
            return s
        return repeat_tiles(s, self.block[0], 1, self.shape[1])

    @property
    def scales_factor_out(self) -> bool:
        """Every scale spans a whole row along the reduction dim (applied to the GEMM's result); never for
        FP4 codes, whose scales enter before the GEMM (NVFP4's two levels)."""
        return self.block[1] >= self.shape[2] and not self.fmt.sub_byte


def quantize_experts(
    w: torch.Tensor,
    fmt: Format,
    granularity: str | tuple[int, int] | Granularity,
    *,
    scale: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
    backend: str = "eager",
    **knobs: object,
) -> GroupedWeight:
    """Quantize ``w`` ``(E, R, C)`` along C, each expert on its own: ``"tensor"`` (one scale per expert;
    ``scale`` ``(E,)`` gives static ones, ``amax`` ``(E,)`` the experts' known amaxes), ``"row"``, ``"mx"``
    or ``(br, bc)`` tiles (R is zero-padded per expert to a multiple of ``br`` so that no tile covers two
    experts; zeros leave tile amaxes unchanged); E2M1 with ``"nvfp4"`` 1x16 blocks or
    ``Granularity("nvfp4", (16, 16))`` tiles: each expert is ``quantize``'s NVFP4 of ``w[e]``, with its own
    per-tensor scale (``GroupedWeight.global_scale``).
    ``knobs`` go to ``quantize``; its ``values=`` (a CPU GEMM dtype) keeps the unscaled values the
    compiled kernel writes beside the codes, per expert or row (``GroupedWeight.values``), and
    ``lazy_codes=True`` has it write only those (``GroupedWeight.codes`` None until ``data`` is read)."""
    e, r, c = w.shape
    kw = {"nonfinite": "propagate", "backend": backend, **knobs}
    if isinstance(granularity, Granularity) and granularity.is_nvfp4 or granularity == "nvfp4":
        return _quantize_experts_nvfp4(w, fmt, granularity, kw)  # type: ignore[arg-type]
    if granularity == "tensor":
        if scale is not None:
            kw["scale"], kw["check_scale"] = scale.reshape(e, 1), False
        if amax is not None:
            kw["amax"] = amax.reshape(e, 1)
        q = quantize(w.reshape(e * r, c), fmt, (r, c), **kw)
        return GroupedWeight(
            _reshaped(q.codes, w.shape),
            q.scales.reshape(e, 1, 1),
            fmt,
            (r, c),
            w.dtype,
            values=_reshaped(q.values, w.shape),
            amax=None if q.amax is None else q.amax.reshape(e),
        )
    if granularity in ("row", "mx"):
        q = quantize(w.reshape(e * r, c), fmt, granularity, **kw)
        return GroupedWeight(
            _reshaped(q.codes, w.shape),
            q.scales.reshape(e, r, -1),
            fmt,
            q.block,
            w.dtype,
            granularity == "mx",
            values=_reshaped(q.values, w.shape),
            amax=None if q.amax is None or granularity == "mx" else q.amax.reshape(e, r),
        )
    br, bc = granularity  # type: ignore[misc]
    kw.pop("values", None)  # tiles keep no values (the GEMMs dequantize them), so they keep their codes
    kw.pop("lazy_codes", None)
    pad = (-r) % br
    wp = torch.nn.functional.pad(w, (0, 0, 0, pad)) if pad else w
    q = quantize(wp.reshape(e * (r + pad), c), fmt, (br, bc), **kw)
    data = q.data.reshape(e, r + pad, c)[:, :r]
    return GroupedWeight(data, q.scales.reshape(e, (r + pad) // br, -1), fmt, (br, bc), w.dtype)


def _quantize_experts_nvfp4(
    w: torch.Tensor, fmt: Format, granularity: str | Granularity, kw: dict[str, object]
) -> GroupedWeight:
    """NVFP4 per expert: ``quantize(w[e], fmt, granularity)`` for each expert (its own per-tensor scale, as
    one weight tensor per expert has), stacked. Tiles keep their codes (the GEMMs dequantize them)."""
    kw = {k: v for k, v in kw.items() if k not in ("values", "lazy_codes")}
    qs = [quantize(w[i], fmt, granularity, **kw) for i in range(w.shape[0])]  # type: ignore[arg-type]
    return GroupedWeight(
        torch.stack([q.data for q in qs]),
        torch.stack([q.scales for q in qs]),
        fmt,
        qs[0].block,
        w.dtype,
        global_scale=torch.stack([q.global_scale for q in qs]),  # type: ignore[misc]
    )


def quantize_experts_columns(w: torch.Tensor, fmt: Format, values: torch.dtype) -> GroupedWeight:
    """``quantize_experts(w.transpose(1, 2), fmt, "row", values=values, lazy_codes=True)`` without the
    transposed copy (CPU): ``w`` ``(E, N, K)`` is read in place, one scale per expert and column, and the
    values (``values`` dtype) are written in ``w``'s layout; the result's ``values`` are their transposed
    view ``(E, K, N)``, which the input-gradient GEMM reads as a row-major ``(E, N, K)`` operand. Bit for
    bit the transposed quantization (same amaxes, scales and products); codes encoded on first read."""
    e, n, k = w.shape
    spec = BlockSpec(fmt, (1, n))
    scale, amax, vals = quantize_columns_values(w, spec, values)
    scale_inv = (1.0 / scale).float().reshape(e, k, 1)
    return GroupedWeight(None, scale_inv, fmt, (1, n), w.dtype, values=vals.transpose(1, 2))


def _reshaped(t: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    return None if t is None else t.reshape(shape)


@dataclass
class GroupColumns(CodesFromValues):
    """A ``(R, P)`` operand of the weight-gradient GEMM quantized with one scale per expert and row
    (row-wise scaling along the token dim P, never across two experts' tokens).

    ``codes`` ``(R, P)`` FP8 codes (a transposed view), None where only ``values`` were written (``data``
    encodes them on first read); ``scale_inv`` ``(E, R)`` float32; ``amax`` ``(E, R)``; ``values``: the
    unscaled exact FP8 values in the CPU GEMM dtype, ``(R, P)``, where kept."""

    codes: torch.Tensor | None
    scale_inv: torch.Tensor
    fmt: Format
    amax: torch.Tensor
    values: torch.Tensor | None = None


def quantize_group_columns(
    x: torch.Tensor, group_ids: torch.Tensor, num_groups: int, fmt: Format, *, values: torch.dtype | None = None
) -> GroupColumns:
    """Quantize ``x.T`` (``x`` is ``(P, R)``, rows grouped by ``group_ids``) with one scale per group and
    column of ``x``: ``scale = fmt.max / amax`` (``compute_scale``), saturating round-to-nearest-even.
    ``values`` (a CPU GEMM dtype; FP8, CPU): write only the GEMM operand's values, no codes (an output
    gradient: its codes are never saved)."""
    p, r = x.shape
    mag = x.detach().abs()  # the maxima in x's dtype: exact, without a float32 copy of x
    amax = mag.new_zeros(num_groups, r).scatter_reduce(0, group_ids.reshape(p, 1).expand(p, r), mag, "amax").float()
    scale = compute_scale(amax, fmt)
    scale_inv = (1.0 / scale).float()
    if values is not None and x.device.type == "cpu" and fmt.kind == "float":
        return GroupColumns(None, scale_inv, fmt, amax, scaled_values(x, scale, group_ids, fmt, values).t())
    data = cast_scaled(x, scale, group_ids, fmt)  # x.float() * scale[group_ids], cast in one loop on CPU
    return GroupColumns(data.t(), scale_inv, fmt, amax)
