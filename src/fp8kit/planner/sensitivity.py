"""How much each layer's quantization alone raises a model's loss, per candidate recipe.

* ``predicted_increase``: per layer and recipe, the two terms of the Taylor estimate of the loss change of
  quantizing that layer alone (``ptq.layer_error.loss_change_terms``), in one pass with gradients over the
  batches: the first-order term ``sum(g * (Y_q - Y)) / tokens`` and the Fisher estimate of the second-order
  term ``0.5 * sum((g * (Y_q - Y))**2) / tokens``; ``Y`` is the layer's output in the model, ``Y_q`` the
  output of a copy of the layer converted to the recipe (same parameters) on the same input, ``g`` the
  gradient of the summed loss with respect to ``Y``. The prediction is their sum, at least 0.
* ``layer_divergence``: for a few layers, the model run with that layer swapped for its converted copy: the
  loss change (what the prediction estimates) and the KL divergence of its next-token distributions from the
  unquantized ones (what the Fisher term alone approximates); ``spearman`` their rank agreement.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..nn.convert import conversion_targets, convert_layer
from ..nn.experts import convert_experts, fp8_experts_forward
from ..numerics.recipes import Recipe
from ..ptq.layer_error import loss_change_terms, swap_submodule

__all__ = [
    "LossPrediction",
    "batch_loss",
    "batch_loss_of",
    "layer_divergence",
    "measured_increase",
    "plannable_layers",
    "predicted_increase",
    "quantized_copy",
    "spearman",
]


def plannable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers ``fp8kit.convert`` would convert (``nn.Linear`` and MoE experts modules), in module order."""
    targets = conversion_targets(model)
    chosen = {id(m) for _, m in targets.experts + targets.linears}
    return {name: m for name, m in model.named_modules() if id(m) in chosen}


class _ConvertedExperts(nn.Module):
    """Calls a converted copy of an experts module through fp8kit's experts forward (no config switch)."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return fp8_experts_forward(self.experts, *args, **kwargs)


def quantized_copy(layer: nn.Module, recipe: Recipe) -> nn.Module:
    """A copy of ``layer`` (sharing its parameters, without its hooks) that computes with ``recipe``."""
    shared: dict[int, Any] = {id(p): p for p in layer.parameters()}
    q = copy.deepcopy(layer, shared)
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
        getattr(q, attr).clear()
    if isinstance(layer, nn.Linear):
        return convert_layer(q, recipe)
    return _ConvertedExperts(convert_experts(q, recipe))


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return {k: _to(v, device) for k, v in batch.items()} if isinstance(batch, Mapping) else batch


def _tokens(batch: Mapping[str, Any], out: Any) -> int:
    """Tokens a batch's mean loss averages over: shifted labels other than -100, else the logits' positions."""
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
        return int((labels[..., 1:] != -100).sum())
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return int(logits.shape[:-1].numel())
    ids = batch.get("input_ids")
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else 1


def batch_loss(model: nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """``model(**batch).loss`` and the tokens it averages over."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"autotune: batches are dicts of the model's forward arguments, got {type(batch).__name__}")
    return batch_loss_of(batch, model(**batch))


def batch_loss_of(batch: Mapping[str, Any], out: Any) -> tuple[torch.Tensor, int]:
    """The ``.loss`` of a model's output ``out`` on ``batch`` and the tokens it averages over."""
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError("autotune: the model's output has no .loss: give batches with labels (e.g. labels=input_ids)")
    return loss, _tokens(batch, out)


@dataclass(frozen=True)
class LossPrediction:
    """``predicted_increase``'s result: per layer and candidate (layer -> candidate -> nats/token) the
    ``first_order`` term ``sum(g * dy) / tokens`` and the ``fisher`` term ``0.5 * sum((g * dy)**2) / tokens``
    of the loss change of quantizing that layer alone; the ``base_loss`` (nats/token) and the ``tokens`` seen."""

    first_order: dict[str, dict[str, float]]
    fisher: dict[str, dict[str, float]]
    base_loss: float
    tokens: int

    @property
    def increase(self) -> dict[str, dict[str, float]]:
        """The predicted loss increase: ``max(first_order + fisher, 0)`` (a layer whose quantization lowers
        the loss on these batches frees no budget for the others)."""
        return {n: {c: max(self.first_order[n][c] + f, 0.0) for c, f in row.items()} for n, row in self.fisher.items()}


def predicted_increase(
    model: nn.Module, variants: Mapping[str, Mapping[str, nn.Module]], batches: Iterable[Mapping[str, Any]]
) -> LossPrediction:
    """The Taylor terms of the loss change (nats/token) per layer and candidate of ``variants`` (layer ->
    candidate -> quantized copy) on ``batches``, the base loss and the tokens seen (``LossPrediction``)."""
    seen = {"loss": 0.0, "tokens": 0}
    device = next(model.parameters()).device

    def backward_pass() -> None:
        for batch in batches:
            loss, n = batch_loss(model, _to(batch, device))
            if not torch.isfinite(loss):
                raise FloatingPointError(f"autotune: the model's loss is {float(loss)} on the given batches")
            (loss * n).backward()
            seen["loss"] += loss.item() * n
            seen["tokens"] += n

    first, fisher = loss_change_terms(model, variants, backward_pass)
    if not seen["tokens"]:
        raise ValueError("autotune: no batches given (pass a few dicts of the model's forward arguments)")
    tokens = seen["tokens"]
    return LossPrediction(
        first_order={name: {c: t / tokens for c, t in row.items()} for name, row in first.items()},
        fisher={name: {c: t / tokens for c, t in row.items()} for name, row in fisher.items()},
        base_loss=seen["loss"] / tokens,
        tokens=tokens,
    )


def _kl_mask(batch: Mapping[str, Any], logits: torch.Tensor) -> torch.Tensor:
    """The positions whose next-token distribution the loss scores: those with a shifted label other than
    -100, else every position but the last."""
    labels = batch.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape == logits.shape[:-1]:
        return labels[..., 1:] != -100
    return torch.ones(logits.shape[:-2] + (logits.shape[-2] - 1,), dtype=torch.bool, device=logits.device)


@torch.no_grad()
def layer_divergence(
    model: nn.Module, variants: Mapping[str, nn.Module], batches: list[Mapping[str, Any]]
) -> dict[str, dict[str, float]]:
    """Per layer of ``variants`` (name -> quantized copy), run with that layer swapped in alone on every batch:
    ``"loss"``, the change of the mean loss (nats/token), and ``"kl"``, the mean KL divergence
    ``KL(p || p_q)`` of the next-token distributions (nats/token, the unquantized ``p`` against the quantized
    ``p_q``) over the positions the loss scores. The KL is what the Fisher term alone approximates (a
    Gauss-Newton quadratic); the loss change adds the first-order term, which on a model short of a minimum of
    the loss can outweigh it, with either sign."""
    device = next(model.parameters()).device
    sums = {name: {"loss": 0.0, "kl": 0.0} for name in variants}
    tokens = kl_tokens = 0
    for batch in batches:
        batch = _to(batch, device)
        out = model(**batch)
        base, n = batch_loss_of(batch, out)
        if not isinstance(getattr(out, "logits", None), torch.Tensor):
            raise ValueError("autotune: the layer check compares next-token distributions: the output needs .logits")
        mask = _kl_mask(batch, out.logits)
        logp = torch.log_softmax(out.logits[..., :-1, :].float(), dim=-1)[mask]
        for name, q in variants.items():
            orig = swap_submodule(model, name, q)
            try:
                out_q = model(**batch)
            finally:
                swap_submodule(model, name, orig)
            loss_q, _ = batch_loss_of(batch, out_q)
            logq = torch.log_softmax(out_q.logits[..., :-1, :].float(), dim=-1)[mask]
            sums[name]["loss"] += (float(loss_q) - float(base)) * n
            sums[name]["kl"] += float((logp.exp() * (logp - logq)).sum())
        tokens += n
        kl_tokens += int(mask.sum())
    return {name: {"loss": s["loss"] / max(tokens, 1), "kl": s["kl"] / max(kl_tokens, 1)} for name, s in sums.items()}


def measured_increase(
    model: nn.Module, variants: Mapping[str, nn.Module], batches: list[Mapping[str, Any]]
) -> dict[str, float]:
    """Loss change (nats/token) of running ``model`` with each layer of ``variants`` (name -> quantized copy)
    swapped in alone (``layer_divergence``' ``"loss"``)."""
    return {name: m["loss"] for name, m in layer_divergence(model, variants, batches).items()}


def _ranks(values: list[float]) -> list[float]:
    """Ranks from 0, ties given their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman rank correlation of two equal-length lists (``None`` under 3 values or a constant list)."""
    if len(a) != len(b):
        raise ValueError(f"spearman: {len(a)} and {len(b)} values")
    if len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else None
