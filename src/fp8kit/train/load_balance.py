"""Router load balance of Mixture-of-Experts models during ``fp8kit train`` (``--arch moe``).

A ``transformers`` MoE model built with ``output_router_logits=True`` returns each MoE layer's router
logits ``(tokens, experts)`` and the Switch-Transformer load-balancing loss (``output.aux_loss``).
``RouterStats`` turns them into, per layer:

- ``fractions``: the fraction of tokens routed to each expert (top-k of the softmax, as the router picks
  them); a token goes to ``top_k`` experts, so the fractions sum to ``top_k`` and a perfectly balanced
  router gives ``top_k / experts`` each;
- ``max_over_mean``: the busiest expert's load over the mean load (1.0 = balanced; an expert-parallel
  step waits for the busiest expert);
- ``cv``: the coefficient of variation (population std / mean) of the loads;
- ``idle_experts``: experts that received no token.

and ``aux_loss``: the mean of the model's load-balancing loss (unscaled, before
``router_aux_loss_coef``) over the forward passes counted. The router stays in high precision in every
fp8kit run, so a change of these figures between BF16 and FP8 runs comes from FP8 GEMMs elsewhere
(attention, experts) changing the router's input.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["RouterStats", "balance_of"]


def balance_of(counts: torch.Tensor, tokens: int) -> dict[str, Any]:
    """Load-balance figures of one layer: ``counts`` (experts,) tokens routed to each expert out of
    ``tokens`` tokens (each counted once per expert it is routed to)."""
    loads = counts.double()
    mean = loads.mean()
    return {
        "fractions": (loads / max(tokens, 1)).tolist(),
        "max_over_mean": float(loads.max() / mean) if mean > 0 else float("nan"),
        "cv": float(loads.std(unbiased=False) / mean) if mean > 0 else float("nan"),
        "idle_experts": int((counts == 0).sum()),
    }


class RouterStats:
    """Tokens routed per expert and the load-balancing loss, accumulated over forward passes."""

    def __init__(self, layers: int, experts: int, top_k: int, aux_loss_coef: float) -> None:
        self.layers, self.experts, self.top_k, self.aux_loss_coef = layers, experts, top_k, aux_loss_coef
        self.reset()

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> RouterStats | None:
        """Stats for a ``transformers`` MoE model that returns its router logits, else ``None``."""
        cfg = getattr(model, "config", None)
        if cfg is None or not getattr(cfg, "output_router_logits", False) or not getattr(cfg, "num_experts", 0):
            return None
        sparse = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
        layers = len(sparse) or cfg.num_hidden_layers
        return cls(layers, cfg.num_experts, cfg.num_experts_per_tok, float(cfg.router_aux_loss_coef))

    def reset(self) -> None:
        self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float64)
        self.tokens = 0  # per layer
        self.aux_sum, self.passes = 0.0, 0

    def update(self, output: Any) -> None:
        """Count one forward pass's routing from ``output.router_logits`` and ``output.aux_loss``."""
        logits = output.router_logits
        if logits is None or len(logits) != self.layers:
            raise ValueError(
                f"expected router logits of {self.layers} MoE layers, got "
                f"{None if logits is None else len(logits)}: build the model with output_router_logits=True"
            )
        for layer, lg in enumerate(logits):
            # the router's own choice: top-k of the FP32 softmax (norm_topk_prob rescales weights, not the pick)
            picked = torch.topk(F.softmax(lg.detach().float(), dim=-1), self.top_k, dim=-1).indices
            self.counts[layer] += torch.bincount(picked.reshape(-1).cpu(), minlength=self.experts).double()
        self.tokens += logits[0].shape[0]
        self.aux_sum += float(output.aux_loss.detach())
        self.passes += 1

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training objective: mean next-token cross-entropy (nats/token, FP32) plus
        ``aux_loss_coef`` x the load-balancing loss, as ``transformers`` adds it given labels; counts the
        pass's routing."""
        out = model(input_ids=x)
        ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]).float(), y.reshape(-1))
        self.update(out)
        return ce + self.aux_loss_coef * out.aux_loss.float()

    @contextmanager
    def capture(self, model: torch.nn.Module) -> Iterator[RouterStats]:
        """Count the routing of every forward pass of ``model`` inside the block (e.g. an evaluation)."""
        handle = model.register_forward_hook(lambda _m, _args, out: self.update(out))
        try:
            yield self
        finally:
            handle.remove()

    def summary(self, reduce: bool = False) -> dict[str, Any]:
        """The figures so far (see the module docstring), then ``reset``. ``reduce``: sum the counts of
        every process first (data parallelism: each rank routes its shard of the batch)."""
        counts, tokens, aux, passes = self.counts, self.tokens, self.aux_sum, self.passes
        if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.cat([counts.reshape(-1), torch.tensor([tokens, aux, passes], dtype=torch.float64)])
            dist.all_reduce(t)
            counts, (tokens, aux, passes) = t[:-3].reshape(counts.shape), t[-3:].tolist()
        layers = [balance_of(c, int(tokens)) for c in counts]
        self.reset()
        return {
            "tokens": int(tokens),
            "aux_loss": aux / passes if passes else float("nan"),
            "max_over_mean": max(layer["max_over_mean"] for layer in layers),
            "cv": sum(layer["cv"] for layer in layers) / len(layers),
            "idle_experts": sum(layer["idle_experts"] for layer in layers),
            "layers": layers,
        }
