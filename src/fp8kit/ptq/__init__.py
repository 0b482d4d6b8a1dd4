"""Post-training quantization for inference: FP8 and INT8 schemes, calibration, FP8 KV cache."""

from .calibrate import CALIBRATION_METHODS
from .kv_cache import kv_cache_bytes
from .linear import QuantLinear
from .quantize import PTQReport, quantize
from .schemes import SCHEMES, Scheme, get_scheme

__all__ = [
    "CALIBRATION_METHODS",
    "PTQReport",
    "QuantLinear",
    "SCHEMES",
    "Scheme",
    "get_scheme",
    "kv_cache_bytes",
    "quantize",
]
