"""A recipe per layer, chosen by predicted loss increase and step cost: ``autotune`` makes a ``Plan``,
``fp8kit.convert(model, plan)`` applies it."""

from __future__ import annotations

from .plan import Plan
from .tune import autotune

__all__ = ["Plan", "autotune"]
