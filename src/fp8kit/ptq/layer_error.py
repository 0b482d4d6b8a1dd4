"""Which layers' quantization alone changes a model's output most (used by ``quantize(..., keep_bf16=N)``).

* ``rank_by_fisher``: one pass with gradients for all layers at once (causal LMs): each layer's output
  change under quantization, weighted by the gradient of the next-token loss (a Fisher estimate of the
  loss increase, as in HAWQ-V2 and BRECQ); ``fisher_per_token`` gives it for several quantized variants
  per layer (``quantize(..., "auto")``), ``fisher_totals`` for any loss and ``loss_change_terms`` with the
  first-order term ``sum(g * dy)`` too (``fp8kit.autotune``).
* ``rank_by_output_error``: one ``forward_loop`` per layer with that layer alone quantized (any model).

A leaf module (no import of ``ptq.quantize``): ``ptq.sensitivity`` builds the full report on top of it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "LayerScore",
    "fisher_per_token",
    "fisher_totals",
    "loss_change_terms",
    "rank_by_fisher",
    "rank_by_output_error",
    "swap_submodule",
]


@dataclass(frozen=True)
class LayerScore:
    """``score``: how much quantizing layer ``name`` alone worsens the model (``metric`` says in what)."""

    name: str
    score: float
    metric: str


def swap_submodule(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Put ``module`` at ``model``'s qualified ``name``; returns the module that was there."""
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
        orig = swap_submodule(model, name, q)
        h = model.register_forward_hook(compare)
        try:
            forward_loop(model)
        finally:
            h.remove()
            swap_submodule(model, name, orig)
        scores.append(LayerScore(name, state["err"] / max(state["norm"], 1e-30), "relative output error"))
    return sorted(scores, key=lambda s: -s.score)


def _causal_lm_loss(output: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Summed next-token cross-entropy of a causal LM call (``logits`` and ``input_ids``), else ``None``."""
    logits = getattr(output, "logits", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(logits, torch.Tensor) or not isinstance(ids, torch.Tensor) or logits.dim() != 3:
        return None
    if ids.shape != logits.shape[:2] or ids.shape[1] < 2:
        return None
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum"
    )


def loss_change_terms(
    model: nn.Module, variants: Mapping[str, Mapping[Hashable, nn.Module]], backward_pass: Callable[[], object]
) -> tuple[dict[str, dict[Hashable, float]], dict[str, dict[Hashable, float]]]:
    """The two terms of the Taylor estimate of the summed loss change of swapping each variant in alone:
    ``(first, fisher)``, per layer of ``variants`` (name -> key -> module computing what layer ``name``
    computes, quantized) and per key, ``sum(g * dy)`` (first order) and ``0.5 * sum(g**2 * dy**2)`` (the
    diagonal Fisher estimate of the second-order term) over the layer's output elements in every forward of
    ``backward_pass()`` (which runs ``model`` and calls ``backward`` on its summed loss): ``dy`` is the change of
    the output when the variant runs on the same inputs, ``g`` the loss gradient with respect to that output.
    The parameters' own gradients are not computed when ``model`` has input embeddings (their output is made
    to require grad instead); otherwise they are, and each parameter's ``.grad`` is restored after."""
    first: dict[str, dict[Hashable, float]] = {n: dict.fromkeys(v, 0.0) for n, v in variants.items()}
    fisher: dict[str, dict[Hashable, float]] = {n: dict.fromkeys(v, 0.0) for n, v in variants.items()}

    def layer_hook(name: str):
        def hook(_m, args, kwargs, out):
            if not torch.is_grad_enabled() or not isinstance(out, torch.Tensor) or not out.requires_grad:
                return
            args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
            y = out.detach().clone()  # a copy: later in-place ops on the output must not change it

            def on_grad(g: torch.Tensor) -> None:  # the variants run here: one output held per layer, not one dy each
                dtype = torch.promote_types(g.dtype, torch.float32)
                with torch.no_grad():
                    for key, q in variants[name].items():
                        gdy = g.to(dtype) * (q(*args, **kwargs) - y).to(dtype)
                        first[name][key] += float(gdy.sum(dtype=torch.float64))
                        fisher[name][key] += 0.5 * float(gdy.pow(2).sum(dtype=torch.float64))

            out.register_hook(on_grad)

        return hook

    def embed_hook(_m, _args, out):
        return out.requires_grad_() if isinstance(out, torch.Tensor) and out.is_floating_point() else out

    params = list(model.parameters())
    flags = [p.requires_grad for p in params]
    grads = [p.grad for p in params]
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    handles = []
    try:
        if isinstance(embed, nn.Module):
            for p in params:
                p.requires_grad_(False)
            handles.append(embed.register_forward_hook(embed_hook))
        handles += [model.get_submodule(n).register_forward_hook(layer_hook(n), with_kwargs=True) for n in variants]
        with torch.enable_grad():
            backward_pass()
    finally:
        for h in handles:
            h.remove()
        for p, flag, grad in zip(params, flags, grads, strict=True):
            p.requires_grad_(flag)
            p.grad = grad
    return first, fisher


def fisher_totals(
    model: nn.Module, variants: Mapping[str, Mapping[Hashable, nn.Module]], backward_pass: Callable[[], object]
) -> dict[str, dict[Hashable, float]]:
    """The Fisher term of ``loss_change_terms``: per layer and key, ``0.5 * sum(g**2 * dy**2)``."""
    return loss_change_terms(model, variants, backward_pass)[1]


def fisher_per_token(
    model: nn.Module, variants: Mapping[str, Mapping[Hashable, nn.Module]], forward_loop: Callable[[nn.Module], object]
) -> dict[str, dict[Hashable, float]] | None:
    """``fisher_totals`` of the summed next-token loss of ``forward_loop(model)`` divided by the tokens seen: per
    layer and variant, the diagonal-Fisher estimate of the loss increase (nats/token, as in HAWQ-V2, BRECQ and
    ModelOpt's ``auto_quantize``). One ``forward_loop`` with gradients. ``None`` if ``model``'s calls are not
    causal-LM calls (no ``logits`` or ``input_ids``) or it has no input embeddings."""
    state = {"seqs": 0, "tokens": 0, "ok": True}

    def model_hook(_m, args, kwargs, output):
        loss = _causal_lm_loss(output, args, kwargs)
        if loss is None or not loss.requires_grad:
            state["ok"] = False
            return
        logits = output.logits
        state["seqs"] += logits.shape[0]
        state["tokens"] += logits.shape[0] * (logits.shape[1] - 1)
        loss.backward()

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(embed, nn.Module):
        return None
    handle = model.register_forward_hook(model_hook, with_kwargs=True)
    try:
        totals = fisher_totals(model, variants, lambda: forward_loop(model))
    finally:
        handle.remove()
    if not state["ok"] or state["seqs"] == 0:
        return None
    return {n: {k: t / state["tokens"] for k, t in row.items()} for n, row in totals.items()}


def rank_by_fisher(
    model: nn.Module, qmods: dict[str, nn.Module], forward_loop: Callable[[nn.Module], object]
) -> list[LayerScore] | None:
    """Layers of ``qmods``, worst first, by ``fisher_per_token`` (nats/token); ``None`` where that is ``None``
    (use ``rank_by_output_error`` then)."""
    per_token = fisher_per_token(model, {n: {n: q} for n, q in qmods.items()}, forward_loop)
    if per_token is None:
        return None
    metric = "Fisher estimate of the loss increase (nats/token)"
    scores = [LayerScore(n, t[n], metric) for n, t in per_token.items()]
    return sorted(scores, key=lambda s: -s.score)
