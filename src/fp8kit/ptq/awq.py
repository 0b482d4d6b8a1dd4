"""AWQ-style activation-aware scale search (Lin et al., 2024) for weight-only quantization.

For each group of layers reading one input (the SmoothQuant mappings, ``smoothquant.find_mappings``),
input channel ``j`` gets ``s_j = mean|x_j|**alpha`` (normalised so that ``sqrt(max(s) * min(s)) = 1``).
The weight columns are multiplied by ``s`` before rounding and the input divided by it, which is folded
into the producing norm or linear exactly as SmoothQuant folds (``smoothquant.fold_scales``): salient
input channels get finer weight rounding at no run-time cost. ``alpha`` is picked per group from
``AWQ_GRID`` values in ``[0, 1]`` by the mean squared output error of the quantized group on a sample of
calibration inputs; ``alpha = 0`` (no scaling) is on the grid, so the chosen scales never do worse
than plain rounding on that sample.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..numerics.tensor import quantize as fp8_quantize
from .calibrate import run_with_input_hooks
from .schemes import Scheme, get_scheme
from .smoothquant import SmoothMapping, fold_scales

__all__ = ["AWQ_GRID", "apply_awq", "awq_scales"]

AWQ_GRID = 20
ROWS_PER_CALL = 64
MAX_ROWS = 512


def _deq(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    return fp8_quantize(w, scheme.weight_format, scheme.weight_granularity).dequantize(torch.float32)


@torch.no_grad()
def awq_scales(
    x: torch.Tensor, x_mean: torch.Tensor, weights: list[torch.Tensor], scheme: Scheme | str, grid: int = AWQ_GRID
) -> tuple[torch.Tensor, float, dict[float, float]]:
    """The per-channel scales for one group: ``x`` ``(rows, in)`` sample inputs, ``x_mean`` ``(in,)`` mean
    magnitudes, ``weights`` the group's ``(out_i, in)`` weights. Returns ``(s, alpha, {alpha: mse})``."""
    scheme = get_scheme(scheme)
    if grid < 2:
        raise ValueError(f"AWQ grid needs at least 2 points, got {grid}")
    x = x.float()
    w = torch.cat([t.detach().float() for t in weights])
    ref = x @ w.t()
    mean = x_mean.float().clamp_min(1e-8)
    errors: dict[float, float] = {}
    best_s, best_alpha, best_err = torch.ones_like(mean), 0.0, float("inf")
    for alpha in torch.linspace(0, 1, grid).tolist():
        s = mean.pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp(1e-4, 1e4)
        # quantize each layer of the group on its own (per-tensor scales are per layer)
        wq = torch.cat([_deq(t.detach().float() * s, scheme) for t in weights])
        err = float(((x / s) @ wq.t() - ref).pow(2).mean())
        errors[round(alpha, 4)] = err
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    return best_s, best_alpha, errors


def apply_awq(
    model: nn.Module,
    mappings: list[SmoothMapping],
    forward_loop: Callable[[nn.Module], object],
    scheme: Scheme | str,
    grid: int = AWQ_GRID,
    seed: int = 0,
) -> dict[str, float]:
    """Search and fold AWQ scales for every mapping in place (the model computes the same function up
    to rounding); returns the chosen ``alpha`` per source."""
    scheme = get_scheme(scheme)
    gen = torch.Generator().manual_seed(seed)
    firsts = {mp.targets[0]: mp for mp in mappings}
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = dict.fromkeys(firsts, 0)
    rows: dict[str, list[torch.Tensor]] = {t: [] for t in firsts}

    def hook(name: str, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).float()
        sums[name] = sums[name] + x2.abs().sum(0) if name in sums else x2.abs().sum(0)
        counts[name] += x2.shape[0]
        idx = torch.randperm(x2.shape[0], generator=gen)[:ROWS_PER_CALL]
        rows[name].append(x2[idx].clone())

    run_with_input_hooks(model, firsts, hook, forward_loop)
    chosen: dict[str, float] = {}
    for t, mp in firsts.items():
        if counts[t] == 0:
            raise ValueError(f"AWQ: layer {t!r} saw no calibration data (the forward_loop never reached it)")
        x = torch.cat(rows[t])
        if x.shape[0] > MAX_ROWS:
            x = x[torch.randperm(x.shape[0], generator=gen)[:MAX_ROWS]]
        weights = [model.get_submodule(n).weight for n in mp.targets]
        s, alpha, _ = awq_scales(x, sums[t] / counts[t], weights, scheme, grid)
        fold_scales(model, mp, s)
        chosen[mp.source] = alpha
    return chosen
