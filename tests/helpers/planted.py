"""A small MLP with a planted fault (outlier channel or NaN) for the debugging tests."""

from __future__ import annotations

import torch
import torch.nn as nn


class Planted(nn.Module):
    """Identity until ``start`` calls have passed; then multiplies one feature by ``factor`` (an outlier
    channel) or writes a NaN into it."""

    def __init__(self, start: int | None = None, channel: int = 3, factor: float = 1e4, nan: bool = False):
        super().__init__()
        self.start, self.channel, self.factor, self.nan, self.calls = start, channel, factor, nan, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.start is None or self.calls <= self.start:
            return x
        x = x.clone()
        if self.nan:
            x[0, self.channel] = float("nan")
        else:
            x[:, self.channel] = x[:, self.channel] * self.factor
        return x


def mlp(planted: nn.Module | None = None) -> nn.Sequential:
    """A 4-Linear GELU MLP (64 -> 16) with ``planted`` (default: an identity ``Planted``) after the second."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), planted or Planted(),
        nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16),
    )  # fmt: skip


def mse(model, batch) -> torch.Tensor:
    """The MSE loss of ``model`` on ``batch = (x, y)``."""
    return nn.functional.mse_loss(model(batch[0]), batch[1])
