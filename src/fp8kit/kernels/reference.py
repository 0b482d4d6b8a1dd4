"""Eager reference quantizer over 2-D tiles: the oracle for the fused kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..numerics.formats import Format, cast_reference, e2m1_encode
from ..numerics.scaling import compute_scale, mx_scale, nvfp4_scales


@dataclass(frozen=True)
class BlockSpec:
    """Everything a tile quantizer needs besides the data.

    ``block`` is the tile shape ``(br, bc)``; ``mx_rounding`` is set for MX (power-of-two E8M0 scales);
    ``nvfp4`` for NVFP4's E4M3 block scales under a per-tensor scale (``scaling.nvfp4_scales``).
    """

    fmt: Format
    block: tuple[int, int]
    margin: float = 0.0
    power_of_two: bool = False
    mx_rounding: str | None = None
    nvfp4: bool = False


def tile_view(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """View a 2-D tensor as ``(nbr, br, nbc, bc)`` tiles, zero-padding ragged edges."""
    rows, cols = x.shape
    br, bc = block
    pr, pc = (-rows) % br, (-cols) % bc
    if pr or pc:
        x = F.pad(x, (0, pc, 0, pr))
    return x.reshape((rows + pr) // br, br, (cols + pc) // bc, bc)


def tile_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Absolute maximum of each tile, float32, shape ``(nbr, nbc)`` (NaN if a tile holds NaN)."""
    return tile_view(x, block).abs().amax(dim=(1, 3)).float()


def scale_from_amax(amax: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """The multipliers of the tiles of one tensor from their amaxes ``(nbr, nbc)`` (float32)."""
    if spec.nvfp4:
        return nvfp4_scales(amax)[2]
    if spec.mx_rounding is not None:
        return mx_scale(amax, spec.fmt, spec.mx_rounding)
    return compute_scale(amax, spec.fmt, spec.margin, spec.power_of_two)


def repeat_tiles_eager(s: torch.Tensor, block: int, dim: int, size: int) -> torch.Tensor:
    """Per-tile values ``s`` repeated ``block`` times along ``dim``, the first ``size`` kept (a ragged last
    tile cut): the one per-tile scale expansion (``expand_tiles``, ``kernels.opaque.repeat_tiles``)."""
    return s.repeat_interleave(block, dim).narrow(dim, 0, size)


def expand_tiles(s: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Broadcast a per-tile tensor ``(..., nbr, nbc)`` back to the element grid ``(..., *shape)``."""
    return repeat_tiles_eager(repeat_tiles_eager(s, block[0], -2, shape[0]), block[1], -1, shape[1])


def quantize_blocks_reference(
    x: torch.Tensor,
    spec: BlockSpec,
    scale: torch.Tensor | None = None,
    *,
    saturate: bool = True,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor tile by tile.

    Returns ``(data, scale, amax)``: ``data`` in ``spec.fmt.dtype`` with ``x``'s shape and ``scale`` (float32
    multipliers, one per tile, shape ``(nbr, nbc)``) and the per-tile amax (float32). A given ``scale``
    (static scaling) is used as is.
    """
    amax = tile_amax(x, spec.block)
    if scale is None:
        scale = scale_from_amax(amax, spec)
    scaled = x.float() * expand_tiles(scale, spec.block, tuple(x.shape))
    rounded = cast_reference(scaled, spec.fmt, saturate=saturate, rounding=rounding, generator=generator)
    return (e2m1_encode(rounded) if spec.fmt.sub_byte else rounded.to(spec.fmt.dtype)), scale, amax
