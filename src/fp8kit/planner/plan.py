"""``Plan``: a recipe per layer ("bf16" keeps a layer in high precision), with its predicted loss and cost."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Plan", "dataclass_json"]


def dataclass_json(obj: Any, path: str | os.PathLike | None = None) -> str:
    """A dataclass instance as JSON text; with ``path`` also written there (a temp file renamed into place)."""
    text = json.dumps(asdict(obj), indent=2)
    if path is not None:
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return text


@dataclass
class Plan:
    """The per-layer choice of ``fp8kit.autotune`` and what it predicts.

    ``per_layer``: layer name -> recipe name or ``"bf16"``; ``loss_increase`` / ``cost_s``: the chosen
    candidate's predicted loss increase (nats/token) and step seconds on ``target`` per layer;
    ``predicted`` / ``costs``: the same for every candidate (layer -> candidate -> value), the prediction
    being ``max(first_order + fisher, 0)`` of the two Taylor terms also kept; ``uniform``: per candidate, the
    totals of giving every layer that candidate and whether that meets the budget; ``measured``: the mean KL
    divergence (nats/token) of the next-token distributions of the model with each sampled layer alone
    quantized with ``measured_recipe`` from the unquantized model's, on the planning batches, and
    ``spearman`` its rank correlation with the prediction; ``measured_loss`` / ``spearman_loss``: the same
    for the loss change; ``spearman_fisher`` / ``spearman_fisher_loss``: the rank correlation of the Fisher
    term alone with the KL divergence / the loss change."""

    target: str
    loss_budget: float
    base_loss: float
    tokens: int
    candidates: list[str]
    per_layer: dict[str, str]
    loss_increase: dict[str, float]
    cost_s: dict[str, float]
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)
    costs: dict[str, dict[str, float]] = field(default_factory=dict)
    uniform: dict[str, dict[str, Any]] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)
    measured_recipe: str = ""
    spearman: float | None = None
    measured_loss: dict[str, float] = field(default_factory=dict)
    spearman_loss: float | None = None
    fisher: dict[str, dict[str, float]] = field(default_factory=dict)
    first_order: dict[str, dict[str, float]] = field(default_factory=dict)
    spearman_fisher: float | None = None
    spearman_fisher_loss: float | None = None

    @property
    def allowed_increase(self) -> float:
        """The summed loss increase the budget allows (nats/token): ``loss_budget * base_loss``."""
        return self.loss_budget * self.base_loss

    @property
    def total_loss_increase(self) -> float:
        return sum(self.loss_increase.values())

    @property
    def total_cost_s(self) -> float:
        return sum(self.cost_s.values())

    def __str__(self) -> str:
        width = max([len("layer"), *map(len, self.per_layer)])
        lines = [
            f"fp8kit.autotune plan on {self.target}: loss budget {self.loss_budget:.2%} of {self.base_loss:.4f} "
            f"(+{self.allowed_increase:.3g} nats/token), {self.tokens} tokens per step",
            f"{'layer':<{width}}  {'recipe':<8} {'pred. dloss':>12} {'cost (us)':>10}",
        ]
        for name, choice in self.per_layer.items():
            lines.append(
                f"{name:<{width}}  {choice:<8} {self.loss_increase[name]:>12.3g} {self.cost_s[name] * 1e6:>10.2f}"
            )
        lines.append(f"{'plan':<{width}}  {'':<8} {self.total_loss_increase:>12.3g} {self.total_cost_s * 1e6:>10.2f}")
        for name, u in self.uniform.items():
            meets = "meets budget" if u["meets_budget"] else "over budget"
            lines.append(
                f"{'all ' + name:<{width}}  {'':<8} {u['loss_increase']:>12.3g} {u['cost_s'] * 1e6:>10.2f}  {meets}"
            )
        if self.measured:
            loss, kl, fisher_loss, fisher_kl = (
                "n/a" if r is None else f"{r:.2f}"
                for r in (self.spearman_loss, self.spearman, self.spearman_fisher_loss, self.spearman_fisher)
            )
            lines.append(
                f"prediction vs measured ({self.measured_recipe}, {len(self.measured)} layers quantized alone), "
                f"Spearman against the loss change / the KL divergence: first-order + Fisher {loss} / {kl}, "
                f"Fisher alone {fisher_loss} / {fisher_kl}"
            )
        return "\n".join(lines)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The plan as JSON text; with ``path`` also written there (a temp file renamed into place)."""
        return dataclass_json(self, path)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> Plan:
        """A plan from JSON text or the path of a file ``to_json`` wrote."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            text = Path(source).read_text()
        data = json.loads(text)
        missing = {"target", "per_layer", "loss_increase", "cost_s"} - set(data)
        if missing:
            raise ValueError(f"not an fp8kit plan: {', '.join(sorted(missing))} missing")
        return cls(**data)
