"""Fused amax + scale + cast, compiled with ``torch.compile``.

The kernel is written once in PyTorch and compiled for the device at hand: C++/OpenMP vector loops
on CPU, Triton on CUDA. Tile shapes that divide the tensor need no padding; the per-tensor case is a
max-reduction pass followed by one multiply-clamp-convert pass.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..formats import Format
from .reference import BlockSpec, scale_from_amax, tile_view

_COMPILE = {"enabled": True}


def set_compile_enabled(enabled: bool) -> None:
    """Turn the compiled kernels on or off process-wide (off: the same math runs eagerly)."""
    _COMPILE["enabled"] = bool(enabled)


def _cast(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    if fmt.kind == "int":
        return torch.round(y).clamp(-fmt.max, fmt.max).to(torch.int8)
    return y.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def quantize_blocks_eager(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Saturating round-to-nearest-even tile quantizer (eager). Same contract as the reference."""
    rows, cols = x.shape
    br, bc = spec.block
    tiles = x.reshape(rows // br, br, cols // bc, bc) if rows % br == 0 and cols % bc == 0 else tile_view(x, spec.block)
    amax = tiles.abs().amax(dim=(1, 3)).float()
    if scale is None:
        scale = scale_from_amax(amax, spec)
    y = _cast(tiles.float() * scale[:, None, :, None], spec.fmt).reshape(tiles.shape[0] * br, tiles.shape[2] * bc)
    if y.shape != (rows, cols):
        y = y[:rows, :cols].contiguous()  # drop the padding of ragged tiles from memory too
    return y, scale, amax


def _per_tensor(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    amax = torch.amax(torch.abs(x)).float().reshape(1, 1)
    if scale is None:
        scale = scale_from_amax(amax, spec)
    return _cast(x.float() * scale.reshape(()), spec.fmt), scale, amax


def quantize_pair_eager(
    x: torch.Tensor, spec: BlockSpec, spec_t: BlockSpec
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Quantize ``x`` along its rows and ``x.T`` along its rows (the copy a weight-gradient GEMM needs)."""
    return quantize_blocks_eager(x, spec), quantize_blocks_eager(x.t(), spec_t)


@functools.cache
def _compiled(kind: str):
    # One model has many operand shapes (x, x.T, dy, dy.T, W per layer): compile for symbolic sizes,
    # and allow more cached variants (specs, static vs computed scale) than dynamo's default of 8.
    cfg = torch._dynamo.config
    for attr in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, attr):
            setattr(cfg, attr, max(getattr(cfg, attr), 64))
    fn = {"tensor": _per_tensor, "tiles": quantize_blocks_eager, "pair": quantize_pair_eager}[kind]
    return torch.compile(fn, dynamic=True)


def _run(kind: str, eager, *args):
    """Run the compiled kernel ``kind``; use ``eager`` when compiling is off, nested or unavailable."""
    if not _COMPILE["enabled"] or torch.compiler.is_compiling():
        return eager(*args)
    try:
        return _compiled(kind)(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    except Exception as err:  # no C++ compiler, unsupported platform...
        warnings.warn(f"fp8kit: compiled quantize kernel unavailable ({err}); using eager kernels", stacklevel=3)
        set_compile_enabled(False)
        return eager(*args)


def quantize_blocks_fused(
    x: torch.Tensor, spec: BlockSpec, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compiled tile quantizer; bit-exact to ``quantize_blocks_reference`` with saturation and RNE."""
    if tuple(spec.block) == tuple(x.shape):
        return _run("tensor", _per_tensor, x, spec, scale)
    return _run("tiles", quantize_blocks_eager, x, spec, scale)


def quantize_pair_fused(x: torch.Tensor, spec: BlockSpec, spec_t: BlockSpec):
    """Compiled ``quantize_pair_eager``: both orientations from one graph that reads ``x``."""
    return _run("pair", quantize_pair_eager, x, spec, spec_t)
