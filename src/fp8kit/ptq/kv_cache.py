"""FP8 KV cache for ``transformers`` attention (Llama-style): per-tensor static E4M3 k/v scales.

The k/v scales are calibrated like activation scales (``max``, ``percentile`` or ``mse`` clipping).

fp8kit registers an attention function with ``transformers.AttentionInterface`` that rounds the keys
(after RoPE, as vLLM caches them) and the values to E4M3 with each layer's calibrated ``k_scale`` /
``v_scale`` (dequant multipliers, ``amax / 448``) before the model's own attention kernel runs.
Rounding with a static scale is idempotent, so re-rounding cached entries at each decode step gives
exactly the numbers an FP8 cache would hold. The cache tensors themselves stay in the model's dtype
on the CPU; the memory an FP8 cache saves (1 byte per element instead of 2) is reported by
``kv_cache_bytes``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..numerics.formats import E4M3
from ..numerics.scaling import dequant_scale
from ..numerics.tensor import quantize
from .calibrate import InputObserver, choose_amax

__all__ = ["ATTN_NAME", "attention_modules", "enable_fp8_kv", "kv_cache_bytes"]

ATTN_NAME = "fp8kit_fp8_kv"


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Attention blocks with ``k_proj``/``v_proj`` and a ``layer_idx`` (Llama, Mistral, Qwen, ...)."""
    return {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "k_proj") and hasattr(m, "v_proj") and hasattr(m, "layer_idx")
    }


def _fake_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to E4M3 codes with the static dequant ``scale`` and dequantized (``fp8kit.quantize``);
    a gradient passes straight through (norm tweaking)."""
    codes = quantize(t.detach(), E4M3, "tensor", scale=1.0 / scale, nonfinite="propagate", check_scale=False).data
    fake = (codes.float() * scale).to(t.dtype)
    return t + (fake - t).detach() if t.requires_grad else fake  # straight-through gradient


def _inner_attention(name: str):
    """The attention kernel the model used before fp8kit's (resolved once, not per call)."""
    if name == "eager":
        from transformers.models.llama.modeling_llama import eager_attention_forward

        return eager_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(name, sdpa_attention_forward)


def _fp8_kv_attention(module: nn.Module, query, key, value, attention_mask, **kwargs: Any):
    state = module._fp8kit_kv
    if state["mode"] == "observe":
        state["k"].observe(key)
        state["v"].observe(value)
    elif state["mode"] == "quantize":  # "off": high precision (the norm-tweaking teacher)
        key = _fake_fp8(key, module.k_scale)
        value = _fake_fp8(value, module.v_scale)
    return state["inner"](module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    try:
        from transformers import AttentionInterface
    except ImportError as err:  # pragma: no cover
        raise ImportError("the FP8 KV cache needs transformers >= 4.48 (AttentionInterface)") from err
    AttentionInterface.register(ATTN_NAME, _fp8_kv_attention)


def enable_fp8_kv(model: nn.Module, mode: str = "observe") -> dict[str, nn.Module]:
    """Route attention through fp8kit's FP8 KV rounding. ``mode="observe"`` samples keys/values
    (calibration); ``"quantize"`` rounds with the modules' ``k_scale``/``v_scale`` buffers."""
    blocks = attention_modules(model)
    if not blocks:
        raise ValueError("fp8-kv: the model has no Llama-style attention blocks (k_proj/v_proj/layer_idx)")
    _register()
    config = next(iter(blocks.values())).config
    current = getattr(config, "_attn_implementation", None) or "sdpa"
    if current != ATTN_NAME:  # remember the model's own kernel (a second call keeps the first one)
        config._fp8kit_inner_attn = current
    inner = _inner_attention(getattr(config, "_fp8kit_inner_attn", "sdpa"))
    for m in blocks.values():
        m.config._attn_implementation = ATTN_NAME
        m._fp8kit_kv = {"mode": mode, "inner": inner}
        if mode == "observe":
            m._fp8kit_kv.update(k=InputObserver(f"{m.layer_idx}.k"), v=InputObserver(f"{m.layer_idx}.v"))
    return blocks


def finish_calibration(blocks: dict[str, nn.Module], method: str = "max", percentile: float = 99.99) -> None:
    """Turn the observed keys/values into ``k_scale``/``v_scale`` buffers (clipping chosen by the
    calibration ``method``, as for activations) and switch to quantizing."""
    for name, m in blocks.items():
        st = m._fp8kit_kv
        for which in ("k", "v"):
            obs = st[which]
            obs.name = f"{name} ({which})"
            amax = choose_amax(obs, E4M3, method, percentile)
            m.register_buffer(f"{which}_scale", dequant_scale(torch.tensor([amax]), E4M3))
        m._fp8kit_kv = {"mode": "quantize", "inner": st["inner"]}


def kv_cache_bytes(model: nn.Module, tokens: int, bytes_per_element: int) -> int:
    """Bytes of a KV cache holding ``tokens`` positions for every layer (keys and values)."""
    cfg = model.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * head_dim * tokens * bytes_per_element
