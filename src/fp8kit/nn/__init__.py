"""FP8 modules and model conversion."""

from .autocast import autocast, fp8_enabled
from .convert import ConversionReport, convert, default_module_filter
from .layernorm import LayerNormLinear, LayerNormMLP
from .linear import Linear, set_quantize_backend, strip_fp8_state

__all__ = [
    "ConversionReport",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "autocast",
    "convert",
    "default_module_filter",
    "fp8_enabled",
    "set_quantize_backend",
    "strip_fp8_state",
]
