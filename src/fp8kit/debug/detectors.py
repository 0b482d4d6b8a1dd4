"""Detectors usable inside any training loop: first non-finite value, and loss spikes."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

__all__ = ["NaNDetector", "NonFiniteError", "Spike", "SpikeDetector"]


class NonFiniteError(FloatingPointError):
    """A NaN or inf appeared; the message names the layer, the operand and the step."""


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)):
        for o in obj:
            t = _first_tensor(o)
            if t is not None:
                return t
    if hasattr(obj, "logits"):
        return obj.logits
    return None


def _finite(t: torch.Tensor | None) -> bool:
    return t is None or not t.is_floating_point() or bool(torch.isfinite(t).all())


class NaNDetector:
    """Hooks every leaf module; records the first ``(layer, operand, step)`` where a non-finite value
    appears, in execution order: a module's ``input``, ``weight``, ``output``, or in backward its
    ``grad_output``. MoE experts modules (3-D expert weights) are hooked too and name the expert:
    a non-finite weight as ``"{module}[{expert}].{weight}"`` (e.g. ``mlp.experts[3].gate_up_proj``), a
    non-finite output as ``"{module}[{expert}]"`` when one expert is routed every token it appears in.

    ``with NaNDetector(model) as det: ...`` then ``det.first`` (``None`` while all is finite). With
    ``raise_on_nan=True`` it raises ``NonFiniteError`` at once. Call ``det.step()`` once per
    training step to number the steps.
    """

    def __init__(self, model: nn.Module, raise_on_nan: bool = False) -> None:
        self.model = model
        self.raise_on_nan = raise_on_nan
        self.first: dict[str, Any] | None = None
        self.current_step = 0
        self._hooks: list[Any] = []

    def step(self) -> None:
        self.current_step += 1

    def _flag(self, name: str, operand: str) -> None:
        if self.first is not None:
            return
        self.first = {"layer": name, "operand": operand, "step": self.current_step}
        if self.raise_on_nan:
            raise NonFiniteError(f"first non-finite value: {operand} of layer {name!r} at step {self.current_step}")

    def __enter__(self) -> NaNDetector:
        from ..nn.experts import is_experts_module

        for name, m in self.model.named_modules():
            experts = is_experts_module(m)
            if any(True for _ in m.children()) and not experts:
                continue
            name = name or type(m).__name__

            def pre(mod, args, name=name, experts=experts):
                if self.first is None:
                    if not _finite(_first_tensor(args)):
                        self._flag(name, "input")
                    elif experts:
                        bad = _nonfinite_expert_weight(mod)
                        if bad is not None:
                            self._flag(f"{name}{bad}", "weight")
                    elif not _finite(getattr(mod, "weight", None)):
                        self._flag(name, "weight")

            def post(mod, args, out, name=name, experts=experts):
                t = _first_tensor(out)
                if self.first is None and not _finite(t):
                    self._flag(f"{name}{_expert_of_rows(t, args) if experts else ''}", "output")
                if t is not None and t.requires_grad:  # its gradient is this module's grad_output

                    def on_grad(g, name=name):
                        if self.first is None and not _finite(g):
                            self._flag(name, "grad_output")

                    t.register_hook(on_grad)

            self._hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def message(self) -> str:
        if self.first is None:
            return "no non-finite value seen"
        f = self.first
        return f"first non-finite value: {f['operand']} of layer {f['layer']!r} at step {f['step']}"


def _nonfinite_expert_weight(experts: nn.Module) -> str | None:
    """``"[e].name"`` of the first expert weight of an experts module holding a non-finite value, or None."""
    names = ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")
    for name in names:
        w = getattr(experts, name).detach()
        bad = ~torch.isfinite(w).flatten(1).all(dim=1)
        if bool(bad.any()):
            return f"[{int(bad.nonzero()[0, 0])}].{name}"
    return None


def _expert_of_rows(out: torch.Tensor, args: tuple[Any, ...]) -> str:
    """``"[e]"`` when the non-finite rows of an experts module's output ``(T, H)`` all went to expert ``e``
    (``args[1]``: the routing ``(T, k)``) and no finite row did, else ``""`` (the module as a whole)."""
    if len(args) < 2 or not isinstance(args[1], torch.Tensor) or out.dim() != 2:
        return ""
    routing = args[1]
    bad = ~torch.isfinite(out).all(dim=-1)
    if routing.shape[0] != bad.shape[0]:
        return ""
    experts = torch.arange(int(routing.max()) + 1, device=routing.device)
    has = (routing[..., None] == experts).any(dim=1)  # (T, E): token routed to expert
    culprit = has[bad].all(dim=0) & ~has[~bad].any(dim=0)
    return f"[{int(culprit.nonzero()[0, 0])}]" if int(culprit.sum()) == 1 else ""


@dataclass
class Spike:
    step: int
    loss: float
    zscore: float
    median: float


class SpikeDetector:
    """Loss-spike detector: robust z-score of each loss against the median and MAD of the last
    ``window`` losses; a spike is ``z > threshold`` (or a non-finite loss). Spiking losses do not
    enter the window, so one spike does not mask the next."""

    def __init__(self, window: int = 50, threshold: float = 6.0, min_history: int = 8) -> None:
        if window < 3 or min_history < 3 or min_history > window:
            raise ValueError("SpikeDetector needs 3 <= min_history <= window")
        self.window, self.threshold, self.min_history = window, threshold, min_history
        self.history: deque[float] = deque(maxlen=window)
        self.spikes: list[Spike] = []
        self.steps = 0

    def update(self, loss: float | torch.Tensor, step: int | None = None) -> Spike | None:
        """Feed one loss; returns the ``Spike`` if this loss is one."""
        value = float(loss)
        self.steps += 1
        step = self.steps if step is None else step
        if not math.isfinite(value):
            spike = Spike(step, value, math.inf, self._median())
            self.spikes.append(spike)
            return spike
        if len(self.history) >= self.min_history:
            med = self._median()
            mad = sorted(abs(v - med) for v in self.history)[len(self.history) // 2]
            spread = max(1.4826 * mad, 1e-3 * abs(med), 1e-12)
            z = (value - med) / spread
            if z > self.threshold:
                spike = Spike(step, value, z, med)
                self.spikes.append(spike)
                return spike
        self.history.append(value)
        return None

    def _median(self) -> float:
        if not self.history:
            return float("nan")
        vals = sorted(self.history)
        return vals[len(vals) // 2]
