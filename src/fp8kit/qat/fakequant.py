"""NVFP4 fake quantization for training: the dequantized values of ``fp8kit.quantize(x, E2M1, "nvfp4")``.

``nvfp4_fake_quant(x, global_scale)`` returns, bit for bit, ``quantize(x, E2M1, "nvfp4",
global_scale=...).dequantize(torch.float32)`` for a float tensor whose last dim is a whole number of
16-element blocks, in a handful of element-wise ops instead of the encode/decode of the E2M1 codes: the
block scales are ``scaling.nvfp4_scales``' (the same function the quantizer calls), each scaled value is
rounded to the E2M1 grid ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` with round-half-to-even and saturation (steps of
0.5 below 2, of 1 below 4, of 2 up to 6: ``round`` of the value times 2, 1 or 0.5, every product exact in
float32), and multiplied by the block's dequantization multiplier ``block * global``. The training forward
(``QATLinear``) calls it once per weight and once per input at every step, where the codes are never kept.
"""

from __future__ import annotations

import torch

from ..numerics.scaling import nvfp4_scales

__all__ = ["NVFP4_BLOCK", "fixed_fp4_fake_quant", "nvfp4_fake_quant"]

NVFP4_BLOCK = 16


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """``y`` rounded to the nearest E2M1 value (ties to even), saturating at +-6; the sign kept."""
    a = y.abs()
    fine = torch.round(a * 2.0) * 0.5  # [0, 2): steps of 0.5
    mid = torch.round(a)  # [2, 4): steps of 1
    top = torch.round(a * 0.5) * 2.0  # [4, 6]: steps of 2
    q = torch.where(a < 2.0, fine, torch.where(a < 4.0, mid, top)).clamp_(max=6.0)
    return torch.copysign(q, y)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 quantize-dequantize of ``x`` in float32 (module doc): 1x16 blocks along the last dim, E4M3
    block scales under the per-tensor scale ``global_scale`` (``None``: ``x``'s own, ``amax / 2688``).

    Raises ``ValueError`` when the last dim is not a multiple of 16 or ``x`` holds NaN or inf (E2M1 has
    neither), as ``fp8kit.quantize`` does."""
    cols = x.shape[-1] if x.dim() else 1
    if x.dim() == 0 or cols % NVFP4_BLOCK:
        raise ValueError(
            f"nvfp4_fake_quant needs a last dim that is a multiple of {NVFP4_BLOCK}, got shape {tuple(x.shape)}; "
            "use fp8kit.quantize for ragged blocks"
        )
    tiles = x.float().reshape(-1, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    amax = tiles.abs().amax(dim=-1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(
            "tensor to quantize holds NaN or inf, which e2m1 cannot encode; fix the producer of the values, "
            "or replace them first (e.g. torch.nan_to_num)"
        )
    if global_scale is not None:
        global_scale = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device).reshape(())
    block, global_inv, multiplier = nvfp4_scales(amax, global_scale)
    codes = _e2m1_round(tiles * multiplier.unsqueeze(-1))
    return (codes * (block.float() * global_inv).unsqueeze(-1)).reshape(x.shape)


def fixed_fp4_fake_quant(w: torch.Tensor, scale_inv: torch.Tensor, codes: bool = False) -> torch.Tensor:
    """``w`` (``(out, in)``) rounded to E2M1 on fixed 1 x ``in / nblocks`` blocks whose dequantization
    multipliers are ``scale_inv`` (``(out, nblocks)``: ``QuantizedTensor.scale_inv``): ``round(w / m) * m``
    with saturation at +-6 (``codes``: the E2M1 values ``round(w / m)`` themselves), float32."""
    out, cols = w.shape
    nb = scale_inv.shape[-1]
    if tuple(scale_inv.shape) != (out, nb) or cols % nb:
        raise ValueError(f"fixed_fp4_fake_quant: scales {tuple(scale_inv.shape)} do not tile a weight {tuple(w.shape)}")
    m = scale_inv.float().unsqueeze(-1)
    q = _e2m1_round(w.float().reshape(out, nb, cols // nb) / m)
    return (q if codes else q * m).reshape(out, cols)
