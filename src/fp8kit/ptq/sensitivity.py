"""Per-layer PTQ sensitivity: quantize one layer at a time and measure how much the model changes.

* ``rank_by_output_error``: relative squared error of the model's output (logits, last hidden state or
  first output tensor) over a ``forward_loop``, each quantized layer swapped in alone (what
  ``quantize(..., keep_bf16=N)`` uses).
* ``layer_sensitivity``: the same swap with any score, e.g. ``dev_loss`` (mean next-token loss on dev
  windows, nats/token): the report ``fp8kit compare --sensitivity`` prints and ``--keep-bf16 N`` reads.

Both quantize the whole model once (SmoothQuant / AWQ folds included), then start from the folded
high-precision model and swap in one ``QuantLinear`` at a time, so every layer is scored in the
function-preserving folded basis that the quantized model really uses.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .layer_error import LayerScore, rank_by_output_error, swap_submodule

__all__ = ["LayerScore", "dev_loss", "keep_filter", "layer_sensitivity", "rank_by_output_error"]


def dev_loss(windows: torch.Tensor, batch_size: int = 8) -> Callable[[nn.Module], float]:
    """A score: mean next-token loss (nats/token) of a causal LM on ``(n, seq_len + 1)`` dev windows."""
    from ..data.evaluation import window_losses

    return lambda model: float(window_losses(model, windows, batch_size).mean())


@torch.no_grad()
def layer_sensitivity(
    model: nn.Module,
    scheme: str,
    forward_loop: Callable[[nn.Module], object],
    score: Callable[[nn.Module], float],
    metric: str = "dev loss delta (nats/token)",
    **quantize_kwargs: Any,
) -> list[LayerScore]:
    """Each quantizable layer of ``model`` (left untouched) scored by ``score(with only it quantized) -
    score(folded high-precision model)``, worst first. ``quantize_kwargs`` go to ``ptq.quantize``."""
    from .quantize import quantize

    work = copy.deepcopy(model)
    originals: dict[str, nn.Module] = {}
    quantize(work, scheme, forward_loop, _originals=originals, **quantize_kwargs)
    qmods = {name: swap_submodule(work, name, orig) for name, orig in originals.items()}  # work: folded, high precision
    base = score(work)
    out = []
    for name, q in qmods.items():
        orig = swap_submodule(work, name, q)
        try:
            out.append(LayerScore(name, score(work) - base, metric))
        finally:
            swap_submodule(work, name, orig)
    return sorted(out, key=lambda s: -s.score)


def keep_filter(ranking: list[LayerScore], n: int) -> Callable[[str, nn.Module], bool]:
    """A ``module_filter`` for ``quantize`` that quantizes every ranked layer except the ``n`` worst."""
    if n < 0:
        raise ValueError(f"keep_bf16 must be >= 0, got {n}")
    kept = {s.name for s in ranking[:n]}
    ranked = {s.name for s in ranking}
    return lambda name, _m: name in ranked and name not in kept
