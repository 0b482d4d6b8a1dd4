"""Layers that compute ``y = x @ W.T + b`` without being a plain ``nn.Linear``, and how fp8kit converts them.

* ``transformers``' ``Conv1D`` (GPT-2, GPT-2-derived models): the weight is stored transposed, ``(in, out)``
  (``nx``, ``nf``). ``convert`` gives the layer the class ``FP8Conv1D(Conv1DLinear, Conv1D)`` in place: an
  ``fp8kit.nn.Linear`` (and still a ``Conv1D``) whose GEMMs read ``weight.t()``, a view of the same parameter,
  so the parameter, its ``(in, out)`` layout in the state dict, hooks and attributes stay as they were.
* Subclasses of ``nn.Linear`` that keep ``nn.Linear.forward``, or whose own ``forward`` computes ``x @ W.T + b``
  (Falcon's ``FalconLinear``; checked on a small random input): the class ``FP8<Sub>(Linear, Sub)``, in place.
  A subclass computing something else (a router returning indices) is left in high precision and reported.

``transformers`` is looked up in ``sys.modules`` only: a model holding a ``Conv1D`` has already imported it,
so ``import fp8kit`` stays light.
"""

from __future__ import annotations

import functools
import inspect
import re
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
    "weights_read_outside",
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
    (plain ``nn.Linear``, ``Conv1D`` and subclasses whose forward computes ``x @ W.T + b``)."""
    if type(module) is nn.Linear or is_conv1d(module) or not isinstance(module, nn.Linear):
        return None
    cls = type(module)
    if isinstance(module, Linear) or cls.forward is nn.Linear.forward or _computes_linear(module):
        return None
    return (
        f"{cls.__module__}.{cls.__qualname__} subclasses nn.Linear with a forward that does not compute "
        "x @ W.T + b (pass module_filter to skip it quietly)"
    )


@torch.no_grad()
def _computes_linear(module: nn.Linear) -> bool:
    """Whether a subclass's own forward computes ``F.linear(x, weight, bias)`` (Falcon's ``x @ W.T + b``): checked
    on a small random input in float32 (exactly equal up to summation order), on the layer's device."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor) or weight.device.type == "meta" or not weight.is_floating_point():
        return False
    x = torch.randn(2, module.in_features, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    try:
        out = type(module).forward(module, x)
    except Exception:
        return False
    want = torch.nn.functional.linear(x, weight, module.bias)
    return isinstance(out, torch.Tensor) and out.shape == want.shape and torch.allclose(out, want, rtol=1e-3, atol=1e-5)


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


@functools.cache
def _weights_read_by(cls: type) -> frozenset[str]:
    """Submodule paths ``X`` (``dt_proj``, ``self_attn.o_proj``) whose ``self.X.weight`` the methods of ``cls``
    (and of its bases outside torch) read, leaving out those that build or initialize the module."""
    found: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins", "fp8kit.")):
            continue
        for fname, fn in vars(klass).items():
            if "init" in fname or fname == "reset_parameters" or not inspect.isfunction(fn):
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            found.update(re.findall(r"self\.((?:\w+\.)*\w+)\.weight\b", source))
    return frozenset(found)


def weights_read_outside(model: nn.Module) -> dict[str, str]:
    """Linear layers whose weight the model's own code reads directly (``self.dt_proj.weight @ x`` in Mamba's
    mixer, a weight handed to a fused kernel, ``x.to(self.self_attn.o_proj.weight.dtype)``), by qualified name,
    with the reason: found as ``self.<path>.weight`` in the source of a module's class, ``<path>`` resolved from
    that module. A quantized layer holds codes there, so PTQ keeps these in high precision; training layers keep
    their high-precision weight and are unaffected."""
    out = {}
    for parent_name, parent in model.named_modules():
        if type(parent).__module__.startswith(("torch.", "fp8kit.")):
            continue
        for path in _weights_read_by(type(parent)):
            try:
                child = parent.get_submodule(path)
            except AttributeError:
                continue
            if is_linear_like(child):
                name = f"{parent_name}.{path}" if parent_name else path
                out[name] = (
                    f"{type(parent).__name__} reads {path}.weight itself (not through the layer's forward): "
                    "a quantized layer would hand it codes"
                )
    return out
