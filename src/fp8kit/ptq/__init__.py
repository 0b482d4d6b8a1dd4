"""Post-training quantization for inference: FP8, INT8 and FP4 schemes, calibration, FP8 KV cache, MoE experts."""

from .awq import apply_awq
from .calibrate import CALIBRATION_METHODS
from .experts import QuantExperts, quantize_experts_module
from .gptq import collect_hessians, gptq_linear, gptq_weight
from .kv_cache import kv_cache_bytes
from .linear import QuantLinear, resident_bytes, set_weight_cache
from .report import PTQReport
from .schemes import FP4_SCHEMES, PTQ_SCHEMES, SCHEMES, Scheme, get_scheme
from .sensitivity import LayerScore, keep_filter, layer_sensitivity, rank_by_output_error
from .sequential import quantize, quantize_checkpoint

__all__ = [
    "CALIBRATION_METHODS",
    "LayerScore",
    "PTQReport",
    "QuantExperts",
    "QuantLinear",
    "FP4_SCHEMES",
    "PTQ_SCHEMES",
    "SCHEMES",
    "Scheme",
    "apply_awq",
    "collect_hessians",
    "get_scheme",
    "gptq_linear",
    "gptq_weight",
    "keep_filter",
    "kv_cache_bytes",
    "layer_sensitivity",
    "quantize",
    "quantize_checkpoint",
    "quantize_experts_module",
    "rank_by_output_error",
    "resident_bytes",
    "set_weight_cache",
]
