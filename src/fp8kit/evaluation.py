"""Held-out evaluation of a causal language model: mean next-token loss and perplexity over batches.

One small module that training (``fp8kit train``, ``fp8kit eval``) and inference comparisons
(``fp8kit compare``) share, so that every perplexity fp8kit prints is computed the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

__all__ = ["evaluate", "loss_of", "perplexity"]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token, FP32) of ``model(input_ids=x).logits`` against targets ``y``."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss (nats/token) over ``(inputs, targets)`` batches, in eval mode; the mode is restored."""
    batches = list(batches)
    if not batches:
        raise ValueError("evaluate() needs at least one batch (give batches >= 1)")
    was = model.training
    model.eval()
    try:
        total = sum(loss_of(model, x, y).item() for x, y in batches) / len(batches)
    finally:
        model.train(was)
    return total


def perplexity(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """``exp`` of ``evaluate``: held-out perplexity over the batches."""
    return math.exp(evaluate(model, batches))
