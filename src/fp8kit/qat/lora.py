"""LoRA adapters (``peft``) on a quantized base: ``QuantLinear`` layers stay quantized, the adapters train in
high precision, and gradients reach the inputs of every quantized layer so adapters below it learn.

``lora_config(**kwargs)`` is ``peft.LoraConfig(**kwargs)`` with ``QuantLinear`` registered as a LoRA target
(``QuantLoraLinear``, peft's ``lora.Linear`` over it): ``peft.get_peft_model(model, lora_config(r=8,
target_modules=[...]))`` on a model from ``fp8kit.ptq.quantize`` or ``fp8kit.export.load_pretrained``. The
base layer's forward with an input that requires a gradient is ``QuantLinear``'s straight-through path:
the same quantized weight (and, for W8A8 and W4A4, the same quantized input), the gradient passed to the
input through the dequantized weight. ``merge_lora`` folds each adapter into its base weight and
re-quantizes the sum into the layer's scheme (the static input scale kept); peft's own ``merge`` would add
a float delta to the codes, so ``QuantLoraLinear``'s ``merge`` refuses and names ``merge_lora``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..ptq.layer_error import swap_submodule
from ..ptq.linear import QuantLinear

__all__ = ["lora_config", "merge_lora", "quant_lora_linear"]


def _peft_linear() -> type:
    from peft.tuners.lora.layer import Linear

    return Linear


_CLASS: list[type] = []


def quant_lora_linear() -> type:
    """``QuantLoraLinear``: peft's ``lora.Linear`` over a ``QuantLinear``, built on first use (peft is optional)."""
    if _CLASS:
        return _CLASS[0]

    class QuantLoraLinear(_peft_linear()):  # type: ignore[misc]
        """peft's ``lora.Linear`` over a ``QuantLinear`` (its merge is ``fp8kit.qat.merge_lora``)."""

        def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
            raise ValueError(
                "a LoRA adapter on a quantized layer merges by re-quantizing base + adapter: call "
                "fp8kit.qat.merge_lora(peft_model) instead of merge/merge_and_unload"
            )

    _CLASS.append(QuantLoraLinear)
    return QuantLoraLinear


def lora_config(**kwargs: Any) -> Any:
    """``peft.LoraConfig(**kwargs)`` that also targets ``QuantLinear`` layers (module doc)."""
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("LoRA on a quantized base needs peft: pip install peft") from err
    config = LoraConfig(**kwargs)
    config._register_custom_module({QuantLinear: quant_lora_linear()})
    return config


@torch.no_grad()
def _merged(layer: Any) -> QuantLinear:
    base: QuantLinear = layer.get_base_layer()
    weight = base.dequantized_weight()
    for name in layer.active_adapters:
        if name in layer.lora_A:
            weight = weight + layer.get_delta_weight(name).float()
    linear = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
    linear.weight.copy_(weight)
    if base.bias is not None:
        linear.bias.copy_(base.bias)
    amax = base.input_amax() if base.input_scale is not None else None  # the exact stored scale is put back below
    q = QuantLinear.from_linear(linear, base.scheme, amax)
    if base.input_scale is not None:
        q.input_scale = base.input_scale.clone()
    return q.to(weight.device)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter on a ``QuantLinear`` into its weight, re-quantized in the layer's scheme, and
    return the base model without peft's wrappers (``ptq_report`` kept, so it exports as before)."""
    cls = quant_lora_linear()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, cls)}
    if not layers:
        raise ValueError("merge_lora() takes a peft model made with fp8kit.qat.lora_config (no LoRA on a QuantLinear)")
    for name, layer in layers.items():
        swap_submodule(model, name, _merged(layer))
    # peft's wrappers of float target layers merge as usual, and the wrappers go
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
