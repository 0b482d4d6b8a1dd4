"""fp8kit: train, debug and deploy PyTorch models in FP8."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import _moved, nn
from .gemm import fp8_gemm
from .nn import autocast, compile
from .numerics.formats import E2M1, E4M3, E5M2, E8M0, FORMATS, INT8, Format, cast, get_format
from .numerics.recipes import (
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    MXFP8Scaling,
    NVFP4BlockScaling,
    Recipe,
    RowwiseScaling,
    recipe_from_name,
)
from .numerics.scaling import Granularity, compute_scale, mx_scale
from .numerics.tensor import QuantizedTensor, quantize
from .version import __version__

_moved.install()


def convert(
    model: torch.nn.Module | str | os.PathLike,
    recipe: Recipe | str | Mapping[str, Recipe | str] | None = None,
    module_filter: Callable[[str, torch.nn.Module], bool] | None = None,
    **kwargs: Any,
) -> torch.nn.Module:
    """``fp8kit.nn.convert`` (FP8 training layers in place, see there), which also takes the directory of an
    FP8 or INT8 checkpoint (``compressed-tensors``, ``modelopt`` or ``fp8-block``, from fp8kit or any
    producer): FP8 model in, FP8 model out. The checkpoint is read by ``fp8kit.export.dequantized_model``
    (weights exactly ``code * scale``, float32), and with the block recipe each layer starts from the
    checkpoint's own 128x128 tiles. ``recipe`` may be a per-layer plan (``fp8kit.autotune``'s ``Plan``)."""
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise TypeError(f"convert() takes an nn.Module or the directory of an FP8 checkpoint; {model!r} is neither")
        from .export import dequantized_model

        model = dequantized_model(model)
    return nn.convert(model, recipe, module_filter, **kwargs)


# Submodules reachable as attributes after ``import fp8kit`` (``fp8kit.ptq.quantize(...)``), imported on first
# use (PEP 562) so that ``import fp8kit`` stays light: no transformers, matplotlib or tensorboard.
_LAZY_SUBMODULES = (
    "data",
    "debug",
    "distributed",
    "export",
    "integrations",
    "jobs",
    "models",
    "optim",
    "planner",
    "ptq",
    "qat",
    "runtime",
    "train",
)
# Functions and classes of lazy submodules reachable from ``fp8kit`` (``fp8kit.autotune(...)``), imported on first use.
_LAZY_NAMES = {"autotune": "planner", "Plan": "planner"}


def __getattr__(name: str):
    if name in _LAZY_NAMES:
        value = getattr(__getattr__(_LAZY_NAMES[name]), name)
        globals()[name] = value
        return value
    if name in _LAZY_SUBMODULES:
        import importlib

        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise  # a dependency of the submodule is missing: say which
            raise AttributeError(f"module 'fp8kit' has no attribute {name!r}") from None
        globals()[name] = module
        return module
    raise AttributeError(f"module 'fp8kit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES, *_LAZY_NAMES})


__all__ = [
    "__version__",
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXFP8Scaling",
    "NVFP4BlockScaling",
    "Recipe",
    "RowwiseScaling",
    "autocast",
    "autotune",
    "compile",
    "convert",
    "fp8_gemm",
    "nn",
    "recipe_from_name",
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "FORMATS",
    "INT8",
    "Format",
    "Granularity",
    "Plan",
    "QuantizedTensor",
    "cast",
    "compute_scale",
    "get_format",
    "mx_scale",
    "quantize",
]
