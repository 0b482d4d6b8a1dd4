"""Compressed Adam moments: FP8 E4M3 codes with per-block scales, and BF16.

Every moment is stored flat, padded to a whole number of blocks of ``block`` contiguous elements
(``codes`` shape ``(n_blocks, block)``). Quantization goes through ``fp8kit.quantize`` with
granularity ``(1, block)``: one float32 scale per block, round-to-nearest-even, saturating.

* ``encode_signed`` (first moment ``m``): ``m ~= codes * scale_inv`` per block.
* ``encode_expanded`` (second moment ``v >= 0``, COAT's dynamic range expansion, Xi et al. 2024):
  per block, ``y = (v / vmax) ** k`` with ``k`` chosen so that the block's range ``vmax / vmin``
  (over its non-zero values) becomes E4M3's normal range ``448 / 2**-6``; ``y * 448`` is cast to
  E4M3. Decoding is ``v = vmax * (codes / 448) ** (1 / k)``. A block whose values span less than
  E4M3's range gets ``k > 1``, which spreads them over more codes (relative error ``2**-4 / k``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..numerics.formats import E4M3
from ..numerics.tensor import quantize

__all__ = [
    "decode_bf16",
    "decode_expanded",
    "decode_signed",
    "encode_bf16",
    "encode_expanded",
    "encode_signed",
    "padded_blocks",
]

# E4M3's normal range: the smallest value of an expanded block lands on the smallest normal.
_TARGET_LOG_RANGE = math.log(E4M3.max / E4M3.min_normal)
_K_MIN, _K_MAX = 1e-3, 1e4


def padded_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` flattened to float32 and zero-padded to ``(n_blocks, block)``."""
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.reshape(-1, block)


def encode_signed(x: torch.Tensor, block: int, backend: str = "eager") -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 (n_blocks, block), scale_inv float32 (n_blocks, 1))`` of E4M3 with per-block scales."""
    q = quantize(padded_blocks(x, block), E4M3, (1, block), nonfinite="propagate", backend=backend)
    return q.data.view(torch.uint8), q.scales


def decode_signed(codes: torch.Tensor, scale_inv: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat float32 values (``numel`` of them) of ``encode_signed``'s output."""
    return (codes.view(E4M3.dtype).float() * scale_inv).reshape(-1)[:numel]


def encode_expanded(
    x: torch.Tensor, block: int, backend: str = "eager"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Non-negative ``x`` -> ``(codes uint8, vmax float32 (n_blocks, 1), k bfloat16 (n_blocks, 1))``."""
    t = padded_blocks(x, block)
    vmax = t.amax(dim=1, keepdim=True)
    vmin = torch.where(t > 0, t, torch.full_like(t, math.inf)).amin(dim=1, keepdim=True)
    log_range = torch.log(vmax / vmin)  # 0 for constant blocks, NaN/inf for all-zero ones
    k = torch.where(log_range > 0, _TARGET_LOG_RANGE / log_range, torch.ones_like(log_range))
    k = k.clamp(_K_MIN, _K_MAX).to(torch.bfloat16)  # the stored k is the one used to encode
    y = torch.where(vmax > 0, t / vmax, torch.zeros_like(t)).pow(k.float())
    q = quantize(y, E4M3, (1, block), scale=E4M3.max, check_scale=False, nonfinite="propagate", backend=backend)
    return q.data.view(torch.uint8), vmax, k


def decode_expanded(codes: torch.Tensor, vmax: torch.Tensor, k: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat float32 values (``numel`` of them) of ``encode_expanded``'s output."""
    y = codes.view(E4M3.dtype).float() * (1.0 / E4M3.max)
    return (vmax * y.pow(1.0 / k.float())).reshape(-1)[:numel]


def encode_bf16(x: torch.Tensor) -> torch.Tensor:
    """Flat bfloat16 copy (round to nearest even)."""
    return x.reshape(-1).to(torch.bfloat16)


def decode_bf16(x: torch.Tensor, numel: int) -> torch.Tensor:
    return x.float()[:numel]
