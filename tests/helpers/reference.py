"""The independent FP8 reference: each recipe's operand layout written out, scales, codes and a float64
linear layer built from ``fp8kit.cast`` (bit-exact, tested against ``ml_dtypes``) and float64 matmuls; and
the FP4 reference (NVFP4, MXFP4) transcribed from torchao, with ml_dtypes' element cast."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
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


# FP4: an independent transcription of torchao 0.18's torchao/prototype/mx_formats/nvfp4_tensor.py
# (``per_tensor_amax_to_scale``, ``nvfp4_quantize`` with a per-tensor scale) and mx_tensor.py (``to_mx`` with
# ``ScaleCalculationMode.FLOOR`` and ``_to_mx_rceil``), float32 torch ops step by step as there, with
# ml_dtypes' ``float4_e2m1fn`` as the element cast. Where torchao has no finite answer (an all-zero tensor:
# its per-tensor scale 0 gives NaN; a per-tensor scale below 2**-120, whose reciprocals can overflow) it
# follows fp8kit's documented rule (per-tensor scale 1.0, resp. 2**-120; scaling.py).
F4_E2M1_MAX = 6.0
F8E4M3_MAX = 448.0


def ref_e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """ml_dtypes' saturating round-to-nearest-even cast of float32 ``y`` to ``float4_e2m1fn``, as uint8 codes."""
    a = np.clip(y.detach().float().numpy(), -F4_E2M1_MAX, F4_E2M1_MAX).astype(ml_dtypes.float4_e2m1fn)
    return torch.from_numpy(a.view(np.uint8).copy())


def ref_e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """ml_dtypes' float32 values of uint8 E2M1 codes."""
    return torch.from_numpy(codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def ref_nvfp4(x: torch.Tensor, elem_max: float = F4_E2M1_MAX, per_tensor_scale: torch.Tensor | None = None):
    """``(codes, block scales float8_e4m3fn (rows, cols/16), per-tensor scale)`` of a 2-D ``x``;
    ``elem_max`` other than 6 plants a wrong scale (for the tests' mutants); ``per_tensor_scale`` given:
    torchao's static (calibrated) per-tensor scale, used as is."""
    rows, cols = x.shape
    data = x.float().reshape(rows, cols // 16, 16)
    if per_tensor_scale is None:
        amax = data.abs().amax()
        per_tensor_scale = amax / (F8E4M3_MAX * elem_max) if amax > 0 else torch.tensor(1.0)
        # fp8kit's rule where torchao's reciprocals can overflow to inf (amax < 2688 * 2**-120 ~ 2e-33)
        per_tensor_scale = per_tensor_scale.clamp(min=2.0**-120)
    block_scale = data.abs().amax(dim=-1) / elem_max
    scaled_block_scales = block_scale / per_tensor_scale
    eps = torch.finfo(torch.float8_e4m3fn).tiny
    scales_fp8 = torch.clamp(scaled_block_scales, min=eps, max=F8E4M3_MAX).to(torch.float8_e4m3fn)
    reciprocal_scale = (1.0 / per_tensor_scale) / scales_fp8.float()
    data_scaled = torch.clamp(data * reciprocal_scale.unsqueeze(-1), -F4_E2M1_MAX, F4_E2M1_MAX)
    return ref_e2m1_codes(data_scaled.reshape(rows, cols)), scales_fp8, per_tensor_scale


def ref_mxfp4(x: torch.Tensor, mode: str = "rceil", shift: int = 0):
    """``(codes, E8M0 scale codes uint8 (rows, cols/32))`` of a 2-D ``x`` with normal-range block amaxes:
    ``"rceil"`` as torchao's ``_to_mx_rceil`` with ``_f32_to_e8m0_rceil`` (the exact rule of Blackwell's
    ``cvt.rp.ue8m0``; torchao 0.18's eager fallback takes ``ceil(log2())`` instead), ``"floor"`` as its
    FLOOR mode (the OCP rule). All-zero blocks take fp8kit's rule (scale 1.0, code 127); torchao gives
    them 2**-127 (code 0). ``shift`` other than 0 plants a wrong scale (``2**shift`` times the right one)."""
    rows, cols = x.shape
    data = x.float().reshape(rows, cols // 32, 32)
    max_abs = data.abs().amax(dim=-1, keepdim=True)
    if mode == "rceil":
        bits = (max_abs * (1.0 / F4_E2M1_MAX)).view(torch.int32)
        biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        exponent = biased + torch.where(biased == 0, mantissa > 0x400000, mantissa != 0).to(torch.int32)
    else:
        extracted_pow2 = ((max_abs.view(torch.int32) >> 23) & 0xFF) - 127
        exponent = torch.clamp(extracted_pow2 - 2, min=-127, max=128) + 127  # F4_E2M1_MAX_POW2 = 2
    exponent = torch.where(max_abs == 0, torch.full_like(exponent, 127), exponent + shift).to(torch.int32)
    reciprocal = ((254 - exponent) << 23).view(torch.float32)  # _e8m0_scale_to_reciprocal_fp32
    codes = ref_e2m1_codes((data * reciprocal).reshape(rows, cols))
    return codes, exponent.squeeze(-1).to(torch.uint8)
