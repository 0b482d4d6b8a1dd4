"""Held-out evaluation of a causal language model: mean next-token loss and perplexity over batches, and the
divergence of its next-token distribution from a reference model's on the same tokens.

One small module that training (``fp8kit train``, ``fp8kit eval``) and inference comparisons
(``fp8kit compare``) share, so that every perplexity fp8kit prints is computed the same way.

``Divergence`` accumulates, over next-token positions, ``KL(P_ref || P)`` (nats/token; ``P_ref`` the reference
model's softmax, e.g. the BF16 model's, ``P`` the quantized model's: what llama.cpp's ``--kl-divergence`` and
model cards report) and top-1 agreement (the fraction of positions whose most likely token is the same), from
two logits streams fed batch by batch: no more than one batch of logits is held at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "Divergence",
    "divergence",
    "evaluate",
    "loss_of",
    "model_device",
    "next_token_divergence",
    "perplexity",
    "window_losses",
    "window_summary",
]

_ROWS = 1024  # positions per log-softmax chunk: bounds the float32 temporaries to a few of (1024, vocab)


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


@dataclass
class Divergence:
    """Running ``KL(P_ref || P)`` and top-1 agreement over next-token positions (module docstring): feed
    ``update(logits, ref_logits)`` one batch at a time, read ``kl`` and ``top1``."""

    kl_sum: float = 0.0
    agree: int = 0
    tokens: int = 0

    @torch.no_grad()
    def update(self, logits: torch.Tensor, ref_logits: torch.Tensor) -> None:
        """Add the positions of ``logits`` (the model's, ``(..., vocab)``) and ``ref_logits`` (the reference's,
        the same shape), in float32 chunks of positions."""
        if logits.shape != ref_logits.shape:
            raise ValueError(f"Divergence: logits {tuple(logits.shape)} vs reference {tuple(ref_logits.shape)}")
        p, r = logits.reshape(-1, logits.shape[-1]), ref_logits.reshape(-1, logits.shape[-1]).to(logits.device)
        for i in range(0, p.shape[0], _ROWS):
            lp, lr = F.log_softmax(p[i : i + _ROWS].float(), -1), F.log_softmax(r[i : i + _ROWS].float(), -1)
            kl = (lr.exp() * (lr - lp)).sum(-1)  # exp(-inf) * (-inf - x) = 0 * -inf: a reference token of p 0
            self.kl_sum += float(torch.nan_to_num(kl, nan=0.0).double().sum())
            self.agree += int((lp.argmax(-1) == lr.argmax(-1)).sum())
            self.tokens += lp.shape[0]

    @property
    def kl(self) -> float:
        """Mean ``KL(P_ref || P)`` in nats per position."""
        return self.kl_sum / self.tokens if self.tokens else float("nan")

    @property
    def top1(self) -> float:
        """The fraction of positions where the model's and the reference's most likely tokens agree."""
        return self.agree / self.tokens if self.tokens else float("nan")

    def summary(self) -> dict[str, float]:
        """``{"kl": ..., "top1": ..., "kl_tokens": ...}``."""
        return {"kl": self.kl, "top1": self.top1, "kl_tokens": self.tokens}


def next_token_divergence(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """``Divergence.summary()`` over a stream of ``(logits, ref_logits)`` pairs (one batch of positions each),
    consumed one pair at a time."""
    div = Divergence()
    for logits, ref in pairs:
        div.update(logits, ref)
    if not div.tokens:
        raise ValueError("next_token_divergence() needs at least one position")
    return div.summary()


@torch.no_grad()
def divergence(
    model: torch.nn.Module, reference: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, float]:
    """``KL(P_ref || P)`` and top-1 agreement of ``model`` against ``reference`` on the inputs of the
    ``(inputs, targets)`` batches (``evaluate``'s), both models in eval mode; their modes are restored."""
    modes = (model.training, reference.training)
    model.eval()
    reference.eval()
    try:
        pairs = (
            (
                model(input_ids=x.to(model_device(model))).logits,
                reference(input_ids=x.to(model_device(reference))).logits,
            )
            for x, _ in batches
        )
        return next_token_divergence(pairs)
    finally:
        model.train(modes[0])
        reference.train(modes[1])


@torch.no_grad()
def window_losses(
    model: torch.nn.Module,
    windows: torch.Tensor,
    batch_size: int = 8,
    reference: torch.nn.Module | None = None,
    divergence: Divergence | None = None,
) -> torch.Tensor:
    """Mean next-token loss (nats/token, FP32) of each window: ``windows`` is ``(n, seq_len + 1)`` token ids
    (inputs ``[:, :-1]``, targets ``[:, 1:]``); returns shape ``(n,)``. With a ``reference`` model, each batch
    also runs through it and ``divergence`` accumulates ``KL(P_ref || P)`` and top-1 agreement on the same
    positions. Eval mode; the modes are restored."""
    if windows.dim() != 2 or windows.shape[0] < 1 or windows.shape[1] < 2:
        raise ValueError(f"window_losses() needs (n >= 1, seq_len + 1 >= 2) token ids, got {tuple(windows.shape)}")
    if (reference is None) != (divergence is None):
        raise ValueError("window_losses(): give reference and divergence together")
    modes = [(m, m.training) for m in (model, reference) if m is not None]
    for m, _ in modes:
        m.eval()
    out = []
    try:
        for i in range(0, windows.shape[0], batch_size):
            w = windows[i : i + batch_size].to(model_device(model))
            logits = model(input_ids=w[:, :-1]).logits.float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="none")
            out.append(nll.reshape(w.shape[0], -1).mean(dim=1))
            if reference is not None and divergence is not None:
                divergence.update(logits, reference(input_ids=w[:, :-1].to(model_device(reference))).logits)
            del logits
    finally:
        for m, was in modes:
            m.train(was)
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
