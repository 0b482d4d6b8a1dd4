"""The independent FP8 reference: each recipe's operand layout written out, scales, codes and a float64
linear layer built from ``fp8kit.cast`` (bit-exact, tested against ``ml_dtypes``) and float64 matmuls."""

from __future__ import annotations

import math

import torch

import fp8kit
from fp8kit import E4M3, E5M2

# (tile shape rule, scale rule) per operand of each recipe, on the operand's 2-D view whose last dim is
# the GEMM's reduction dim. "all" = one tile for the whole tensor, "row" = (1, cols).
LAYOUT: dict[str, dict[str, tuple[object, str]]] = {
    "delayed": {r: ("all", "amax") for r in ("input", "weight", "grad")},
    "current": {r: ("all", "amax") for r in ("input", "weight", "grad")},
    "rowwise": {r: ("row", "amax") for r in ("input", "weight", "grad")},
    "block": {"input": ((1, 128), "pow2"), "weight": ((128, 128), "pow2"), "grad": ((1, 128), "pow2")},
    "mxfp8": {r: ((1, 32), "rceil") for r in ("input", "weight", "grad")},
}
HYBRID = {"input": E4M3, "weight": E4M3, "grad": E5M2}
E4M3_ONLY = {"input": E4M3, "weight": E4M3, "grad": E4M3}
FORMATS = {"delayed": HYBRID, "current": HYBRID, "rowwise": E4M3_ONLY, "block": E4M3_ONLY, "mxfp8": E4M3_ONLY}
KINDS = list(LAYOUT)


def tile_shape(rule: object, rows: int, cols: int) -> tuple[int, int]:
    if rule == "all":
        return rows, cols
    if rule == "row":
        return 1, cols
    return rule  # type: ignore[return-value]


def ref_scale(amax: torch.Tensor, fmt, rule: str, margin: int = 0) -> torch.Tensor:
    """Scale multipliers (float32) from float64 tile amaxes: ``fmt.max / amax / 2**margin`` correctly
    rounded to float32, or the power-of-two rules (``pow2``: rounded down; MX ``rceil`` / ``floor``)."""
    a = amax.double()
    bad = (a == 0) | ~torch.isfinite(a)
    a = torch.where(bad, torch.ones_like(a), a)
    if rule == "amax":
        s = (fmt.max / a / 2.0**margin).float()
    elif rule == "pow2":
        s = torch.exp2(torch.floor(torch.log2((fmt.max / a / 2.0**margin).float().double()))).float()
    elif rule == "rceil":
        s = torch.exp2(-torch.ceil(torch.log2(a / fmt.max))).float()
    elif rule == "floor":
        emax = math.floor(math.log2(fmt.max))
        s = torch.exp2(-(torch.floor(torch.log2(a)) - emax)).float()
    else:
        raise ValueError(rule)
    return torch.where(bad, torch.ones_like(s), s)


def ref_quant(x: torch.Tensor, fmt, block: tuple[int, int], rule: str, scale: torch.Tensor | None = None):
    """``(codes, scale per tile, dequantized float64)`` of a 2-D tensor, tile by tile."""
    x = x.detach()
    rows, cols = x.shape
    br, bc = block
    nbr, nbc = -(-rows // br), -(-cols // bc)
    amax = torch.zeros(nbr, nbc, dtype=torch.float64)
    for i in range(nbr):
        for j in range(nbc):
            amax[i, j] = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].double().abs().max()
    if scale is None:
        scale = ref_scale(amax, fmt, rule)
    full = scale.reshape(nbr, nbc).repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]
    codes = fp8kit.cast(x.float() * full, fmt)  # saturating round-to-nearest-even
    return codes, scale.reshape(nbr, nbc), codes.double() / full.double()


def ref_operand(x: torch.Tensor, kind: str, role: str) -> torch.Tensor:
    """The dequantized float64 operand that recipe ``kind`` feeds its GEMM for ``role``."""
    rule, scale_rule = LAYOUT[kind][role]
    return ref_quant(x, FORMATS[kind][role], tile_shape(rule, *x.shape), scale_rule)[2]


def ref_linear(kind: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor):
    """Float64 ``(y, dx, dW)`` of an FP8 linear layer under recipe ``kind`` (first step)."""
    y = ref_operand(x, kind, "input") @ ref_operand(w, kind, "weight").t()
    if b is not None:
        y = y + b.double()
    dx = ref_operand(g, kind, "grad") @ ref_operand(w.t().contiguous(), kind, "weight").t()
    dw = ref_operand(g.t().contiguous(), kind, "grad") @ ref_operand(x.t().contiguous(), kind, "input").t()
    return y, dx, dw


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to FP32 accumulation order: ~1e-6 relative, far below one FP8 rounding step (6-12%)."""
    got, want = got.detach().double(), want.detach().double()
    tol = 2e-5 * float(want.abs().max()) + 1e-30
    err = float((got - want).abs().max())
    assert err <= tol, f"{what}: max |diff| {err:.3g} > {tol:.3g}"
