"""``BitsPlan``: a PTQ scheme per layer (or BF16) for an effective-bits budget, least predicted loss increase.

Effective bits are counted as ModelOpt's ``auto_quantize`` counts them (``estimate_quant_compression``, 0.47):
the weight format's value bits (``E + M + 1`` for floats, ``num_bits`` for integers), per-tensor and
per-channel scales uncounted, NVFP4 4.5 (its ``effective_bits`` override in
``modelopt_recipes/configs/numerics/nvfp4.yaml``: an E4M3 scale per 16 values), MXFP4 4.0 (no override:
its E8M0 scale per 32 values, 0.25 bits, is not counted), no quantization 16. The budget is the mean over
the planned layers' weights, each layer counted by its weight count (a MoE experts module by all its
experts' weights). ``solver.solve`` then picks, per layer, the scheme that minimises the summed predicted
loss increase with the summed bits within the budget.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .plan import dataclass_json
from .solver import Infeasible, solve

__all__ = ["BF16", "EFFECTIVE_BITS", "BitsPlan", "plan_bits"]

BF16 = "bf16"
EFFECTIVE_BITS: dict[str, float] = {
    BF16: 16.0,
    "fp8": 8.0,
    "fp8-dynamic": 8.0,
    "int8-smoothquant": 8.0,
    "int8-weight-only": 8.0,
    "nvfp4": 4.5,
    "nvfp4-weight-only": 4.5,
    "mxfp4-weight-only": 4.0,
}


@dataclass
class BitsPlan:
    """The per-layer choice of ``plan_bits`` and what it predicts.

    ``per_layer``: layer -> scheme or ``"bf16"``; ``loss_increase``: the chosen scheme's predicted loss
    increase per layer (nats/token); ``params``: each layer's weight count; ``predicted``: every candidate's
    prediction (layer -> scheme -> value; a scheme a layer cannot take is absent); ``uniform``: per
    candidate every layer can take, its mean bits and summed predicted increase."""

    budget: float
    candidates: list[str]
    per_layer: dict[str, str]
    loss_increase: dict[str, float]
    params: dict[str, int]
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)
    uniform: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def bits(self) -> float:
        """The plan's effective bits: its layers' bits averaged over their weights."""
        total = sum(self.params.values())
        return sum(EFFECTIVE_BITS[self.per_layer[n]] * p for n, p in self.params.items()) / max(total, 1)

    @property
    def total_loss_increase(self) -> float:
        return sum(self.loss_increase.values())

    def counts(self) -> dict[str, int]:
        """Layers per chosen scheme, in ``candidates`` order."""
        chosen = list(self.per_layer.values())
        return {c: chosen.count(c) for c in self.candidates if c in chosen}

    def summary(self) -> str:
        """Two lines: the plan's bits, predicted increase and layers per scheme; the uniform schemes'."""
        counts = ", ".join(f"{c} {k}" for c, k in self.counts().items())
        uni = ", ".join(f"{c} {u['bits']:g} bits +{u['loss_increase']:.3g}" for c, u in self.uniform.items())
        return (
            f"auto plan: {self.bits:.2f} effective bits (budget {self.budget:g}), predicted loss increase "
            f"+{self.total_loss_increase:.3g} nats/token; layers: {counts}\n  uniform schemes: {uni}"
        )

    def __str__(self) -> str:
        width = max([len("layer"), *map(len, self.per_layer)])
        lines = [
            self.summary(),
            f"{'layer':<{width}}  {'scheme':<18} {'bits':>5} {'pred. dloss':>12}",
        ]
        for name, choice in self.per_layer.items():
            lines.append(
                f"{name:<{width}}  {choice:<18} {EFFECTIVE_BITS[choice]:>5g} {self.loss_increase[name]:>12.3g}"
            )
        return "\n".join(lines)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The plan as JSON text; with ``path`` also written there (a temp file renamed into place)."""
        return dataclass_json(self, path)


def plan_bits(
    predicted: Mapping[str, Mapping[str, float]],
    params: Mapping[str, int],
    budget: float,
    groups: Sequence[Sequence[str]] = (),
) -> BitsPlan:
    """The scheme per layer of ``predicted`` (layer -> scheme -> predicted loss increase; ``"bf16"`` is added
    with 0) minimising the summed prediction with the mean effective bits (``EFFECTIVE_BITS``, weighted by
    ``params``: layer -> weight count) at most ``budget``. Each of ``groups`` (layers that read one input: q/k/v,
    gate/up, which serving engines fuse into one GEMM with one scheme) takes one scheme for all its layers, the
    schemes every one of them can take, as ModelOpt's ``auto_quantize`` groups them."""
    if not 0 < budget <= 16:
        raise ValueError(f"budget is the mean effective bits per weight, in (0, 16] (e.g. 8 or 6), got {budget}")
    order = list(predicted)
    if not order:
        raise ValueError("plan_bits: no layer to plan")
    unknown = {c for row in predicted.values() for c in row} - set(EFFECTIVE_BITS)
    if unknown:
        raise ValueError(
            f"plan_bits: no effective bits for {', '.join(sorted(unknown))}; known: {', '.join(EFFECTIVE_BITS)}"
        )
    rows = {n: {**predicted[n], BF16: 0.0} for n in order}
    candidates = [c for c in EFFECTIVE_BITS if any(c in rows[n] for n in order)]
    unit_of = {n: n for n in order}
    for g in groups:
        members = [n for n in g if n in rows]
        unit_of.update(dict.fromkeys(members, members[0] if members else None))
    units: dict[str, list[str]] = {}
    for n in order:
        units.setdefault(unit_of[n], []).append(n)
    options = {u: [c for c in candidates if all(c in rows[n] for n in ms)] for u, ms in units.items()}
    total = sum(params[n] for n in order)
    try:
        choice = solve(
            [[EFFECTIVE_BITS[c] * sum(params[n] for n in ms) for c in options[u]] for u, ms in units.items()],
            [[sum(rows[n][c] for n in ms) for c in options[u]] for u, ms in units.items()],
            budget * total,
        )
    except Infeasible:
        low = sum(min(EFFECTIVE_BITS[c] for c in options[unit_of[n]]) * params[n] for n in order) / total
        raise ValueError(
            f"no plan fits {budget:g} effective bits: the fewest these candidates allow is {low:.2f}"
        ) from None
    chosen = {u: options[u][i] for u, i in zip(units, choice, strict=True)}
    per_layer = {n: chosen[unit_of[n]] for n in order}
    uniform: dict[str, dict[str, Any]] = {}
    for c in candidates:
        if all(c in rows[n] for n in order):
            uniform[c] = {"bits": EFFECTIVE_BITS[c], "loss_increase": sum(rows[n][c] for n in order)}
    return BitsPlan(
        budget=budget,
        candidates=candidates,
        per_layer=per_layer,
        loss_increase={n: rows[n][per_layer[n]] for n in order},
        params={n: int(params[n]) for n in order},
        predicted={n: dict(rows[n]) for n in order},
        uniform=uniform,
    )
