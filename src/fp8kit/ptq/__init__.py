"""Post-training quantization for inference: FP8, INT8 and FP4 schemes, calibration, FP8 KV cache, MoE experts."""

from collections.abc import Callable
from typing import Any

import torch

from .auto import quantize_auto
from .awq import apply_awq
from .calibrate import CALIBRATION_METHODS
from .experts import QuantExperts, quantize_experts_module
from .gptq import collect_hessians, gptq_linear, gptq_weight
from .kv_cache import kv_cache_bytes
from .linear import QuantLinear, resident_bytes, set_weight_cache
from .quantize import quantize as quantize_module
from .report import PTQReport
from .schemes import FP4_SCHEMES, PTQ_SCHEMES, SCHEMES, Scheme, get_scheme
from .sensitivity import LayerScore, keep_filter, layer_sensitivity, rank_by_output_error


def quantize(
    model: torch.nn.Module,
    scheme: str,
    forward_loop: Callable[[torch.nn.Module], object] | None = None,
    **options: Any,
) -> torch.nn.Module:
    """Quantize a loaded ``model`` in place with ``scheme`` and return it: ``ptq.quantize.quantize`` (see there
    for ``options``), or with scheme ``"auto"`` and ``budget=BITS`` a scheme per layer (``ptq.auto.quantize_auto``).
    A model folder, or a model on the ``meta`` device, is quantized layer by layer and written as it goes by
    ``fp8kit.jobs.quantize_checkpoint``."""
    if not isinstance(model, torch.nn.Module) or any(p.is_meta for p in model.parameters()):
        raise TypeError(
            "fp8kit.ptq.quantize takes a loaded model; quantize a model folder (or a model on the meta device) "
            "layer by layer with fp8kit.jobs.quantize_checkpoint(folder, scheme, out, forward_loop, ...)"
        )
    if "out" in options:
        raise ValueError("quantize(model) returns the quantized model: write it with fp8kit.export.save_pretrained")
    auto = isinstance(scheme, str) and scheme.strip().lower() == "auto"
    if not auto and ("budget" in options or "candidates" in options):
        raise ValueError("budget and candidates go with scheme='auto' (a scheme per layer)")
    if auto:
        return quantize_auto(model, forward_loop, **options)
    return quantize_module(model, scheme, forward_loop, **options)


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
    "quantize_experts_module",
    "rank_by_output_error",
    "resident_bytes",
    "set_weight_cache",
]
