"""What ``fp8kit.export`` reads and writes from PTQ, the one door from ``export`` into ``ptq``: the quantized
modules PTQ leaves in a model (``QuantLinear``, ``QuantExperts`` and the functions that find, read, dequantize
and rebuild experts), the FP8 KV-cache switch, the scheme table and the report."""

from .experts import (
    QuantExperts,
    block_tiling_problem,
    dequantize_experts_module,
    dispatch_quant_experts,
    experts_projections,
    find_experts,
    install_quant_experts,
    quantize_codes,
    quantize_experts_module,
    shallow_copy,
)
from .kv_cache import enable_fp8_kv
from .linear import QuantLinear
from .report import PTQReport
from .schemes import FP4_SCHEMES, FP8_BLOCK, SCHEMES, Scheme, get_scheme

__all__ = [
    "FP4_SCHEMES",
    "FP8_BLOCK",
    "PTQReport",
    "QuantExperts",
    "QuantLinear",
    "SCHEMES",
    "Scheme",
    "block_tiling_problem",
    "dequantize_experts_module",
    "dispatch_quant_experts",
    "enable_fp8_kv",
    "experts_projections",
    "find_experts",
    "get_scheme",
    "install_quant_experts",
    "quantize_codes",
    "quantize_experts_module",
    "shallow_copy",
]
