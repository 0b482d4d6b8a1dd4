"""``fp8kit.autotune``: the cheapest recipe per layer whose predicted loss increase fits a budget.

Per plannable layer (what ``fp8kit.convert`` converts) and candidate: the predicted loss increase of
quantizing that layer alone (``sensitivity``: first-order term plus Fisher term, at least 0) and the step
time of its GEMMs and casts on ``target`` (``roofline``: a named GPU's roofline, or timed on this CPU).
``solver.solve`` then picks one candidate per layer, minimising the summed time with the summed predicted
increase at most ``loss_budget * base_loss``. A few layers, spread over the Fisher ranking of the recipe with
the largest Fisher total, are also run quantized alone on the same batches: the loss change and the KL
divergence of the next-token distributions from the unquantized model's (what the Fisher term alone
approximates) are kept in the plan, with the rank agreement (Spearman) of each with the prediction and with
the Fisher term alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch.nn as nn

from ..numerics.recipes import RECIPE_NAMES, recipe_from_name
from .plan import Plan
from .roofline import GPU, GPUS, TARGETS, Gemm, layer_seconds, measured_seconds
from .sensitivity import layer_divergence, plannable_layers, predicted_increase, quantized_copy, spearman
from .solver import Infeasible, solve

__all__ = ["BF16", "DEFAULT_CANDIDATES", "autotune", "layer_gemms"]

BF16 = "bf16"
DEFAULT_CANDIDATES = (BF16, *RECIPE_NAMES)


def layer_gemms(layer: nn.Module, tokens: int) -> list[Gemm]:
    """The GEMM shapes of one step of ``layer`` at ``tokens`` tokens: a Linear's one; an experts module's two
    projections over ``tokens * top_k`` routed rows, held once per expert."""
    if isinstance(layer, nn.Linear):
        return [Gemm(tokens, layer.in_features, layer.out_features)]
    experts = layer.num_experts
    config = getattr(layer, "config", None)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or getattr(layer, "top_k", 1) or 1)
    rows = tokens * top_k
    shapes = []
    for weight in (layer.gate_up_proj if layer.has_gate else layer.up_proj, layer.down_proj):
        a, b = weight.shape[1:]
        in_f, out_f = (a, b) if layer.is_transposed else (b, a)
        shapes.append(Gemm(rows, in_f, out_f, experts))
    return shapes


def _candidates(candidates: Sequence[str] | None) -> list[str]:
    names = list(candidates) if candidates is not None else list(DEFAULT_CANDIDATES)
    if not names:
        raise ValueError("autotune: give at least one candidate ('bf16' or a recipe name)")
    out = []
    for name in names:
        kind = BF16 if name.lower() == BF16 else recipe_from_name(name).kind
        if kind not in out:
            out.append(kind)
    return out


def _costs(layers: Mapping[str, nn.Module], candidates: list[str], target: str | GPU, tokens: int) -> dict[str, dict]:
    """Seconds per layer and candidate on ``target``; on "cpu" each distinct shape is timed once."""
    timed: dict[tuple, float] = {}
    out: dict[str, dict[str, float]] = {}
    for name, layer in layers.items():
        gemms = layer_gemms(layer, tokens)
        row = {}
        for c in candidates:
            if target == "cpu":
                key = (tuple(gemms), c)
                if key not in timed:
                    timed[key] = measured_seconds(gemms, c)
                row[c] = timed[key]
            else:
                row[c] = layer_seconds(gemms, c, target if isinstance(target, GPU) else GPUS[target])
        out[name] = row
    return out


def _sample(ranked: list[str], count: int) -> list[str]:
    """``count`` names spread evenly over ``ranked`` (all of them when there are fewer)."""
    if count >= len(ranked):
        return list(ranked)
    step = (len(ranked) - 1) / max(count - 1, 1)
    return [ranked[round(i * step)] for i in range(count)]


def autotune(
    model: nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    loss_budget: float,
    target: str | GPU = "h100",
    candidates: Sequence[str] | None = None,
    measure_layers: int = 8,
) -> Plan:
    """The plan (``Plan``) that gives each layer ``fp8kit.convert`` would convert one of ``candidates``
    ("bf16" and recipe names; default bf16 and every training recipe) so that the summed step time on
    ``target`` ("h100", "h200", "b200" rooflines, a ``roofline.GPU`` of your own, or "cpu" timed here) is least while the summed
    predicted loss increase (first-order plus Fisher term per layer, at least 0) stays within ``loss_budget``
    (relative: 0.01 allows 1% of the model's loss on ``batches``). ``batches``: dicts of ``model``'s forward
    arguments whose output has ``.loss``. ``measure_layers`` layers (spread over the Fisher ranking) are also
    quantized alone on ``batches`` and their loss change and KL divergence from the unquantized next-token
    distributions measured. The model is not changed; apply the plan with ``fp8kit.convert(model, plan)``."""
    if not isinstance(target, GPU) and target not in TARGETS:
        raise ValueError(f"autotune: unknown target {target!r}; accepted: {', '.join(TARGETS)}")
    if not loss_budget >= 0:
        raise ValueError(f"autotune: loss_budget is a relative loss increase >= 0 (0.01 = 1%), got {loss_budget}")
    names = _candidates(candidates)
    batches = list(batches)
    layers = plannable_layers(model)
    if not layers:
        raise ValueError("autotune: the model has no layer fp8kit.convert converts (nn.Linear or MoE experts)")
    fp8 = [c for c in names if c != BF16]
    variants = {n: {c: quantized_copy(m, recipe_from_name(c)) for c in fp8} for n, m in layers.items()}
    terms = predicted_increase(model, variants, batches)
    base_loss, tokens = terms.base_loss, terms.tokens

    def per_candidate(values: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
        return {n: {c: (0.0 if c == BF16 else values[n][c]) for c in names} for n in layers}

    predicted, fisher, first_order = map(per_candidate, (terms.increase, terms.fisher, terms.first_order))
    costs = _costs(layers, names, target, max(tokens // len(batches), 1))
    allowed = loss_budget * base_loss
    order = list(layers)
    try:
        choice = solve([[predicted[n][c] for c in names] for n in order], [[costs[n][c] for c in names] for n in order],
                       allowed)  # fmt: skip
    except Infeasible:
        raise ValueError(
            f"autotune: no plan keeps the predicted loss increase within {loss_budget:.2%} of {base_loss:.4f} "
            f"with candidates {', '.join(names)}: raise loss_budget or add 'bf16' to the candidates"
        ) from None
    per_layer = {n: names[i] for n, i in zip(order, choice, strict=True)}
    uniform = {}
    for c in names:
        loss = sum(predicted[n][c] for n in order)
        uniform[c] = {"loss_increase": loss, "cost_s": sum(costs[n][c] for n in order), "meets_budget": loss <= allowed}
    plan = Plan(
        target=target.name if isinstance(target, GPU) else target,
        loss_budget=loss_budget,
        base_loss=base_loss,
        tokens=max(tokens // len(batches), 1),
        candidates=names,
        per_layer=per_layer,
        loss_increase={n: predicted[n][per_layer[n]] for n in order},
        cost_s={n: costs[n][per_layer[n]] for n in order},
        predicted=predicted,
        fisher=fisher,
        first_order=first_order,
        costs=costs,
        uniform=uniform,
    )
    if fp8 and measure_layers > 0:  # the sample depends on the Fisher term only: the same for both predictors
        worst = max(fp8, key=lambda c: sum(fisher[n][c] for n in order))  # the widest spread of effects
        ranked = sorted(order, key=lambda n: -fisher[n][worst])
        sample = _sample(ranked, measure_layers)
        measured = layer_divergence(model, {n: variants[n][worst] for n in sample}, batches)
        plan.measured = {n: measured[n]["kl"] for n in sample}
        plan.measured_loss = {n: measured[n]["loss"] for n in sample}
        plan.measured_recipe = worst
        kl, loss = [plan.measured[n] for n in sample], [plan.measured_loss[n] for n in sample]
        prediction, fisher_only = [predicted[n][worst] for n in sample], [fisher[n][worst] for n in sample]
        plan.spearman, plan.spearman_loss = spearman(prediction, kl), spearman(prediction, loss)
        plan.spearman_fisher, plan.spearman_fisher_loss = spearman(fisher_only, kl), spearman(fisher_only, loss)
    return plan
