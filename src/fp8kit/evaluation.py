"""Held-out evaluation of a causal language model: mean next-token loss and perplexity over batches.

One small module that training (``fp8kit train``, ``fp8kit eval``) and inference comparisons
(``fp8kit compare``) share, so that every perplexity fp8kit prints is computed the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

__all__ = ["evaluate", "loss_of", "model_device", "perplexity", "window_losses", "window_summary"]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token, FP32) of ``model(input_ids=x).logits`` against targets ``y``."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.to(logits.device).reshape(-1))


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s first parameter lives (the CPU for a module without parameters)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss (nats/token) over ``(inputs, targets)`` batches, in eval mode; the mode is restored."""
    batches = list(batches)
    if not batches:
        raise ValueError("evaluate() needs at least one batch (give batches >= 1)")
    was = model.training
    model.eval()
    try:
        device = model_device(model)
        total = sum(loss_of(model, x.to(device), y).item() for x, y in batches) / len(batches)
    finally:
        model.train(was)
    return total


def perplexity(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """``exp`` of ``evaluate``: held-out perplexity over the batches."""
    return math.exp(evaluate(model, batches))


@torch.no_grad()
def window_losses(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """Mean next-token loss (nats/token, FP32) of each window: ``windows`` is ``(n, seq_len + 1)`` token ids
    (inputs ``[:, :-1]``, targets ``[:, 1:]``); returns shape ``(n,)``. Eval mode; the mode is restored."""
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"window_losses() needs (n >= 1, seq_len + 1 >= 2) token ids, got {tuple(windows.shape)}")
    was = model.training
    model.eval()
    out = []
    try:
        for i in range(0, windows.shape[0], batch_size):
            w = windows[i : i + batch_size].to(model_device(model))
            logits = model(input_ids=w[:, :-1]).logits.float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="none")
            out.append(nll.reshape(w.shape[0], -1).mean(dim=1))
    finally:
        model.train(was)
    return torch.cat(out).cpu()


def window_summary(losses: torch.Tensor, reference: torch.Tensor | None = None) -> dict[str, float]:
    """Perplexity ``exp(mean loss)`` over equal-length windows and its spread.

    Returns ``ppl``, ``ppl_std`` (std over windows of each window's perplexity), ``windows`` and, given
    the ``reference`` model's losses on the same windows, the paired change ``ppl_rel``
    (``exp(mean(l - l_ref)) - 1``), ``ppl_rel_std`` (std over windows of ``exp(l - l_ref) - 1``) and
    ``ppl_rel_sem`` (its standard error, ``std / sqrt(n)``)."""
    losses = losses.double()
    n = losses.numel()
    out = {
        "ppl": math.exp(float(losses.mean())),
        "ppl_std": float(losses.exp().std()) if n > 1 else 0.0,
        "windows": n,
    }
    if reference is not None:
        if reference.shape != losses.shape:
            raise ValueError(f"window_summary: {tuple(losses.shape)} losses vs {tuple(reference.shape)} reference")
        d = losses - reference.double()
        rel = d.exp() - 1
        std = float(rel.std()) if n > 1 else 0.0
        out.update(ppl_rel=math.expm1(float(d.mean())), ppl_rel_std=std, ppl_rel_sem=std / math.sqrt(n))
    return out
