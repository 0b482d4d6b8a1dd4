"""FP8 modules and model conversion."""

from .autocast import autocast, fp8_enabled
from .bf16 import BF16Linear, to_bf16_gemms
from .compiling import compile
from .convert import ConversionReport, convert, convert_layer, default_module_filter
from .experts import FP8Experts
from .layernorm import LayerNormLinear, LayerNormMLP
from .linear import Linear, set_quantize_backend, strip_fp8_state
from .memory import saved_activation_bytes

__all__ = [
    "BF16Linear",
    "ConversionReport",
    "FP8Experts",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "autocast",
    "compile",
    "convert",
    "convert_layer",
    "default_module_filter",
    "fp8_enabled",
    "set_quantize_backend",
    "saved_activation_bytes",
    "strip_fp8_state",
    "to_bf16_gemms",
]
