"""Layers that compute ``y = x @ W.T + b`` without being a plain ``nn.Linear``, and how fp8kit converts them.

* ``transformers``' ``Conv1D`` (GPT-2, GPT-2-derived models): the weight is stored transposed, ``(in, out)``
  (``nx``, ``nf``). ``convert`` gives the layer the class ``FP8Conv1D(Conv1DLinear, Conv1D)`` in place: an
  ``fp8kit.nn.Linear`` (and still a ``Conv1D``) whose GEMMs read ``weight.t()``, a view of the same parameter,
  so the parameter, its ``(in, out)`` layout in the state dict, hooks and attributes stay as they were.
* Subclasses of ``nn.Linear`` that keep ``nn.Linear.forward``: the class ``FP8<Sub>(Linear, Sub)``, in place.
  A subclass with its own ``forward`` computes something fp8kit cannot follow: it is left in high precision
  and reported with the reason.

``transformers`` is looked up in ``sys.modules`` only: a model holding a ``Conv1D`` has already imported it,
so ``import fp8kit`` stays light.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from .linear import Linear

__all__ = [
    "Conv1DLinear",
    "as_linear",
    "is_linear_like",
    "is_conv1d",
    "linear_dims",
    "linear_like_why_not",
    "linear_weight",
    "transposed_in_checkpoint",
]


def _conv1d_class() -> type | None:
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``Conv1D`` (weight stored ``(in, out)``), converted or not."""
    cls = _conv1d_class()
    return cls is not None and isinstance(module, cls)


def transposed_in_checkpoint(module: nn.Module) -> bool:
    """Whether the checkpoint holds ``module``'s weight as ``(in, out)``: a ``Conv1D``, or the inference layer
    that replaced one (``ptq`` marks it ``checkpoint_transposed``)."""
    return is_conv1d(module) or bool(getattr(module, "checkpoint_transposed", False))


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a linear-like layer."""
    if is_conv1d(module) and not isinstance(module, Linear):
        return int(module.nx), int(module.nf)
    return int(module.in_features), int(module.out_features)


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The layer's weight as ``(out_features, in_features)`` (a view for ``Conv1D``)."""
    if isinstance(module, Linear):
        return module.linear_weight()
    return module.weight.t() if is_conv1d(module) else module.weight


def linear_like_why_not(module: nn.Module) -> str | None:
    """Why a layer that looks linear (an ``nn.Linear`` subclass) cannot be converted, or ``None`` if it can
    (plain ``nn.Linear``, ``Conv1D`` and subclasses that keep ``nn.Linear.forward``)."""
    if type(module) is nn.Linear or is_conv1d(module) or not isinstance(module, nn.Linear):
        return None
    cls = type(module)
    if isinstance(module, Linear):
        return None
    if cls.forward is not nn.Linear.forward:
        return (
            f"{cls.__module__}.{cls.__qualname__} subclasses nn.Linear with its own forward "
            "(fp8kit cannot tell what it computes; pass module_filter to skip it quietly)"
        )
    return None


def is_linear_like(module: nn.Module) -> bool:
    """Whether ``convert`` and ``ptq.quantize`` treat ``module`` as a linear layer: ``nn.Linear`` and its
    subclasses (fp8kit's own included), ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


class Conv1DLinear(Linear):
    """The FP8 half of ``FP8Conv1D``: GEMMs on ``weight.t()`` (``Conv1D`` stores ``(in, out)``)."""

    def linear_weight(self) -> torch.Tensor:
        return self.weight.t()

    def extra_repr(self) -> str:
        return f"nf={self.out_features}, nx={self.in_features}, recipe={self.recipe.kind}"

    def __repr__(self) -> str:  # Conv1D's own __repr__ formats self.__dict__ and misses the recipe
        return nn.Module.__repr__(self)


def as_linear(module: nn.Module) -> nn.Linear:
    """``module`` itself if it is an ``nn.Linear``; for a ``Conv1D`` an ``nn.Linear`` whose weight is a view of
    its weight as ``(out, in)`` (no copy, no gradient) and whose bias is its bias: what a quantizer reads."""
    if isinstance(module, nn.Linear):
        return module
    in_features, out_features = linear_dims(module)
    with torch.device("meta"):
        linear = nn.Linear(in_features, out_features, bias=module.bias is not None)
    linear.weight = nn.Parameter(module.weight.detach().t(), requires_grad=False)
    if module.bias is not None:
        linear.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear
