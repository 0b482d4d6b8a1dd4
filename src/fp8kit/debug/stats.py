"""Numerics of one quantized GEMM operand: what FP8 does to a tensor under a given recipe.

Figures (all from the high-precision tensor ``x`` and its quantize-dequantize ``x_hat``):

* ``amax``: max |x|; ``scale`` / ``scale_inv``: the (first tile's) scale and dequant multiplier;
* ``underflow_pct``: % of the non-zero values of ``x`` that quantize to zero;
* ``saturation_pct``: % of values whose scaled magnitude exceeds the format max (clipped to it);
* ``sqnr_db``: 10 log10(sum x^2 / sum (x - x_hat)^2);
* ``dynamic_range_binades``: log2(amax / smallest non-zero |x|);
* ``staleness`` (delayed scaling only): current amax over the amax the scale was set for
  (``fmt.max / scale / 2**margin``); above 1 the tensor outgrew its scale and saturates.

With ``channels=True`` (the inspector asks for it on GEMM inputs), the figures of the channels (the last
dim, the GEMM's reduction dim) too: what a per-tensor scale set by one large channel does to the others.

* ``channel_sqnr_db``: the median over channels of each channel's own SQNR (the total ``sqnr_db`` weighs
  channels by energy, so one outlier channel can hold it high while the rest are crushed);
* ``outlier_ratio``: the largest channel's amax over the median channel amax;
* ``kurtosis``: the fourth standardized moment of the values (3 for a Gaussian; heavy tails grow it).
"""

from __future__ import annotations

import math

import torch

from ..kernels.reference import expand_tiles
from ..numerics.formats import Format
from ..numerics.recipes import DelayedScaling, Recipe
from ..numerics.tensor import QuantizedTensor, quantize

__all__ = ["ROLES", "channel_stats", "operand_stats", "quantize_for_stats"]

ROLES = ("input", "weight", "grad")


def quantize_for_stats(
    x: torch.Tensor, role: str, recipe: Recipe, delayed_scale: torch.Tensor | None = None
) -> QuantizedTensor:
    """Quantize ``x`` as ``recipe`` would for ``role`` without touching any layer state.

    Delayed scaling uses ``delayed_scale`` (the layer's current scale) when given, else the current amax;
    so does any per-tensor recipe given one (a scale set over a larger tensor than ``x``: an MoE expert's
    share of the layer's routed tokens).
    """
    fmt = recipe.format_for(role)
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    if recipe.per_tensor and delayed_scale is not None:
        return quantize(x2, fmt, "tensor", scale=delayed_scale, nonfinite="propagate", check_scale=False)
    if isinstance(recipe, DelayedScaling):
        if delayed_scale is not None:
            return quantize(x2, fmt, "tensor", scale=delayed_scale, nonfinite="propagate", check_scale=False)
        return quantize(x2, fmt, "tensor", margin=recipe.margin, nonfinite="propagate")
    return quantize(x2, fmt, recipe.granularity_for(role), nonfinite="propagate", **recipe.quantize_kwargs)


@torch.no_grad()
def operand_stats(
    x: torch.Tensor,
    role: str,
    recipe: Recipe,
    delayed_scale: torch.Tensor | None = None,
    channels: bool = False,
) -> dict[str, float]:
    """The figures above for ``x`` quantized as ``recipe`` does for ``role`` (``channels``: with the channel
    figures)."""
    q = quantize_for_stats(x, role, recipe, delayed_scale)
    fmt: Format = q.fmt
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    finite = torch.isfinite(x2)
    xf = torch.where(finite, x2, torch.zeros_like(x2))
    x_hat = q.dequantize(torch.float32).reshape(x2.shape)
    x_hat = torch.where(torch.isfinite(x_hat), x_hat, torch.zeros_like(x_hat))
    mag = xf.abs()
    amax = float(mag.max()) if mag.numel() else 0.0
    nonzero = mag > 0
    n_nonzero = int(nonzero.sum())
    underflow = int((nonzero & (x_hat == 0)).sum())
    scale_inv = q.scale_inv.float()  # per tile, dequant multiplier
    tiles = expand_tiles(scale_inv, q.block, tuple(x2.shape))
    saturated = int((mag / tiles > fmt.max).sum())
    diff2 = (xf - x_hat) ** 2
    sq = xf * xf
    err = float(diff2.sum())
    sig = float(sq.sum())
    sqnr = 10 * math.log10(sig / err) if err > 0 and sig > 0 else (math.inf if sig > 0 else float("nan"))
    min_nz = float(mag[nonzero].min()) if n_nonzero else 0.0
    s_inv0 = float(scale_inv.reshape(-1)[0])
    out = {
        "amax": amax,
        "scale": 1.0 / s_inv0 if s_inv0 > 0 else math.inf,
        "scale_inv": s_inv0,
        "underflow_pct": 100.0 * underflow / max(n_nonzero, 1),
        "saturation_pct": 100.0 * saturated / max(x2.numel(), 1),
        "sqnr_db": sqnr,
        "dynamic_range_binades": math.log2(amax / min_nz) if n_nonzero else 0.0,
        "nonfinite": int((~finite).sum()),
    }
    if isinstance(recipe, DelayedScaling) and delayed_scale is not None:
        set_for = fmt.max / float(delayed_scale) / 2**recipe.margin
        out["staleness"] = amax / set_for if set_for > 0 else math.inf
    if channels:
        out.update(_channel_figures(xf, sq, diff2, mag))
    return out


def channel_stats(x: torch.Tensor, x_hat: torch.Tensor) -> dict[str, float]:
    """``channel_sqnr_db``, ``outlier_ratio`` and ``kurtosis`` of a 2-D ``x`` (channels: its columns) and its
    quantize-dequantize ``x_hat``. Channels that are all zero are left out; none left: NaN."""
    return _channel_figures(x, x * x, (x - x_hat) ** 2, x.abs())


def _channel_figures(x: torch.Tensor, sq: torch.Tensor, diff2: torch.Tensor, mag: torch.Tensor) -> dict[str, float]:
    """``channel_stats`` from ``x``, ``x**2``, the squared error and ``|x|`` (already at hand in
    ``operand_stats``). The kurtosis comes from the raw moments, summed in float64."""
    sig = sq.sum(dim=0)
    live = sig > 0
    nan = float("nan")
    if not bool(live.any()):
        return {"channel_sqnr_db": nan, "outlier_ratio": nan, "kurtosis": nan}
    err = diff2.sum(dim=0)
    per = 10 * torch.log10(sig[live] / err[live].clamp_min(torch.finfo(torch.float32).tiny))
    cmax = mag.amax(dim=0)[live]
    med = float(cmax.median())
    n = x.numel()
    m1 = float(x.sum(dtype=torch.float64)) / n
    m2 = float(sig.sum(dtype=torch.float64)) / n
    m3 = float((sq * x).sum(dtype=torch.float64)) / n
    m4 = float((sq * sq).sum(dtype=torch.float64)) / n
    var = m2 - m1 * m1
    central4 = m4 - 4 * m1 * m3 + 6 * m1 * m1 * m2 - 3 * m1**4
    return {
        "channel_sqnr_db": float(per.median()),
        "outlier_ratio": float(cmax.max()) / med if med > 0 else math.inf,
        "kurtosis": central4 / var**2 if var > 0 else nan,
    }
