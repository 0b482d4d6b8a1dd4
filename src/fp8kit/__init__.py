"""fp8kit: train, debug and deploy PyTorch models in FP8."""

from . import nn
from .formats import E4M3, E5M2, E8M0, FORMATS, INT8, Format, cast, get_format
from .gemm import fp8_gemm
from .nn import autocast, compile, convert
from .recipes import (
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    MXFP8Scaling,
    Recipe,
    RowwiseScaling,
    recipe_from_name,
)
from .scaling import Granularity, compute_scale, mx_scale
from .tensor import QuantizedTensor, quantize

__version__ = "0.1.0"

# Submodules reachable as attributes after ``import fp8kit`` (``fp8kit.ptq.quantize(...)``), imported on first
# use (PEP 562) so that ``import fp8kit`` stays light: no transformers, matplotlib or tensorboard.
_LAZY_SUBMODULES = (
    "compare",
    "data",
    "debug",
    "distributed",
    "evaluation",
    "export",
    "integrations",
    "models",
    "optim",
    "ptq",
    "train",
)


def __getattr__(name: str):
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
    return sorted({*globals(), *_LAZY_SUBMODULES})


__all__ = [
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXFP8Scaling",
    "Recipe",
    "RowwiseScaling",
    "autocast",
    "compile",
    "convert",
    "fp8_gemm",
    "nn",
    "recipe_from_name",
    "E4M3",
    "E5M2",
    "E8M0",
    "FORMATS",
    "INT8",
    "Format",
    "Granularity",
    "QuantizedTensor",
    "cast",
    "compute_scale",
    "get_format",
    "mx_scale",
    "quantize",
]
