"""Fixes for a latent finding, each with the FP8 figures it gives on the operand the doctor recorded.

A latent finding names a GEMM input (a departure of that ``input``, or a growing signal of an MLP, whose
``down_proj`` input it is). The doctor captures that operand from the trained FP8 copy (one more forward
on the last batch) and asks each candidate fix what it would make of it (``operand_stats``):

* **Smooth-SwiGLU** (the operand is a SwiGLU MLP's ``down_proj`` input): the smoothed operand ``x * s``
  (``nn.swiglu.smooth_scales``) under the layer's recipe; ``fp8kit.convert(..., smooth_swiglu=True)``;
* **a tile recipe for that layer** (``block``: 1x128 tiles, ``rowwise``: one scale per token): the operand
  under it, the rest of the model unchanged;
* **keep the layer in BF16**: the operand rounded to bfloat16.

Ranked by the median-channel SQNR they give (what a per-tensor scale set by one channel takes from the
others), the fixes that keep FP8 first; keeping BF16 comes first only when no FP8 fix brings the operand
back within ``CLEAR_DB`` of its clean level.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from ..nn.swiglu import smooth_scales, swiglu_mlps
from ..numerics.recipes import BlockScaling, Recipe, RowwiseScaling
from .diagnosis import Culprit, Recommendation, module_of
from .stats import channel_stats, operand_stats

__all__ = ["CLEAR_DB", "bf16_stats", "latent_fixes", "operand_layer"]

CLEAR_DB = 3.0  # an FP8 fix within this many dB of the operand's clean median-channel SQNR clears it


def operand_layer(c: Culprit, layers: list[str]) -> str | None:
    """The FP8 layer whose input a latent finding is about (a departure of a layer's input, or a growing
    signal of a down projection's input or of an MLP: its ``down_proj``), else None."""
    if c.operand in ("input", "outlier_ratio", "kurtosis") and c.layer in layers:
        return c.layer
    if c.operand == "gate_up_alignment" and f"{c.layer}.down_proj" in layers:
        return f"{c.layer}.down_proj"
    return None


@torch.no_grad()
def bf16_stats(x: torch.Tensor) -> dict[str, float]:
    """``sqnr_db`` and the channel figures of ``x`` rounded to bfloat16."""
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    x_hat = x2.to(torch.bfloat16).float()
    err, sig = float(((x2 - x_hat) ** 2).sum()), float((x2**2).sum())
    sqnr = 10 * math.log10(sig / err) if err > 0 and sig > 0 else math.inf
    return {"sqnr_db": sqnr, **channel_stats(x2, x_hat)}


def _figures(stats: dict[str, float]) -> dict[str, float]:
    return {"sqnr_db": stats["sqnr_db"], "channel_sqnr_db": stats["channel_sqnr_db"]}


def latent_fixes(
    c: Culprit, layer: str, x: torch.Tensor, model: nn.Module, recipe: Recipe, clean_db: float | None
) -> list[Recommendation]:
    """The ranked fixes (module docstring) for latent finding ``c`` about ``layer``'s input ``x`` in the trained
    FP8 ``model`` under ``recipe``; ``clean_db``: the operand's clean median-channel SQNR (None: unknown)."""
    now = _figures(operand_stats(x, "input", recipe, channels=True))
    why = f"{c.layer} {c.operand}: {c.reason}; now on the recorded operand: {_fmt(now)}"
    fp8: list[Recommendation] = []
    mlp = module_of(layer).rpartition(".")[0]
    if layer.endswith("down_proj") and any(n == mlp for n, _ in swiglu_mlps(model)):
        weight = model.get_submodule(layer).weight
        smoothed = x * smooth_scales(x, weight).to(x.dtype)
        figs = _figures(operand_stats(smoothed, "input", recipe, channels=True))
        fp8.append(
            Recommendation(
                f"Smooth-SwiGLU: fp8kit.convert(model, recipe, smooth_swiglu=True) ({_fmt(figs)})",
                {"type": "smooth_swiglu"},
                why,
                figs,
            )
        )
    for alt, what in ((BlockScaling(), "1x128 tiles"), (RowwiseScaling(), "one scale per token")):
        if alt.kind == recipe.kind:
            continue
        figs = _figures(operand_stats(x, "input", alt, channels=True))
        fp8.append(
            Recommendation(
                f"{alt.kind} recipe ({what}) for {layer}: fp8kit.convert(model, {{..., {layer!r}: {alt.kind!r}}}) "
                f"({_fmt(figs)})",
                {"type": "layer_recipe", "layers": [layer], "recipe": alt.kind},
                why,
                figs,
            )
        )
    fp8.sort(key=lambda r: -_key(r.sqnr))
    figs = _figures(bf16_stats(x))
    keep = Recommendation(
        f"keep {layer} in BF16: fp8kit.convert(model, recipe, module_filter=lambda n, m: n != {layer!r}) "
        f"({_fmt(figs)})",
        {"type": "bf16_layers", "layers": [layer]},
        why,
        figs,
    )
    target = clean_db if clean_db is not None else now["channel_sqnr_db"]
    clears = fp8 and _key(fp8[0].sqnr) >= target - CLEAR_DB
    return [*fp8, keep] if clears else [keep, *fp8]


def _key(figs: dict[str, float] | None) -> float:
    v = (figs or {}).get("channel_sqnr_db", math.nan)
    return v if v == v else -math.inf


def _fmt(figs: dict[str, Any]) -> str:
    return f"median-channel SQNR {figs['channel_sqnr_db']:.1f} dB, total {figs['sqnr_db']:.1f} dB"
