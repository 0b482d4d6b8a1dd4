"""Which layers' quantization alone changes a model's output most (used by ``quantize(..., keep_bf16=N)``).

A leaf module (no import of ``ptq.quantize``): ``ptq.sensitivity`` builds the full report on top of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["LayerScore", "rank_by_output_error"]


@dataclass(frozen=True)
class LayerScore:
    """``score``: how much quantizing layer ``name`` alone worsens the model (``metric`` says in what)."""

    name: str
    score: float
    metric: str


def _swap(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, attr)
    setattr(parent, attr, module)
    return old


def _output_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        t = getattr(out, key, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ValueError(f"sensitivity: cannot find the output tensor of a {type(out).__name__} (return a tensor)")


@torch.no_grad()
def rank_by_output_error(
    model: nn.Module, qmods: dict[str, nn.Module], forward_loop: Callable[[nn.Module], object]
) -> list[LayerScore]:
    """Layers of ``qmods`` (name -> quantized module for ``model``'s layer ``name``), worst first, by
    ``sum |y_q - y|^2 / sum |y|^2`` over the outputs ``y`` of ``forward_loop(model)``."""
    ref: list[torch.Tensor] = []
    state = {"i": 0, "err": 0.0, "norm": 0.0}

    def record(_m, _args, out):
        ref.append(_output_tensor(out).detach().to(torch.bfloat16))

    def compare(_m, _args, out):
        y = _output_tensor(out).detach().float()
        r = ref[state["i"]].float()
        state["i"] += 1
        state["err"] += float((y - r).pow(2).sum())
        state["norm"] += float(r.pow(2).sum())

    h = model.register_forward_hook(record)
    try:
        forward_loop(model)
    finally:
        h.remove()
    if not ref:
        raise ValueError("sensitivity: the forward_loop never ran the model")
    scores = []
    for name, q in qmods.items():
        state.update(i=0, err=0.0, norm=0.0)
        orig = _swap(model, name, q)
        h = model.register_forward_hook(compare)
        try:
            forward_loop(model)
        finally:
            h.remove()
            _swap(model, name, orig)
        scores.append(LayerScore(name, state["err"] / max(state["norm"], 1e-30), "relative output error"))
    return sorted(scores, key=lambda s: -s.score)
