"""fp8kit: train, debug and deploy PyTorch models in FP8."""

from . import nn
from .formats import E4M3, E5M2, E8M0, FORMATS, INT8, Format, cast, get_format
from .gemm import fp8_gemm
from .nn import autocast, convert
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

__all__ = [
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXFP8Scaling",
    "Recipe",
    "RowwiseScaling",
    "autocast",
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
