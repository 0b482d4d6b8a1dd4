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

from ..nn.attention import ATTN_NAME as FP8_ATTENTION_NAME
from ..nn.attention import QKVP_FORMAT, STATE_NAME, attention_states, static_scales
from ..numerics.formats import E4M3
from ..numerics.scaling import dequant_scale
from ..numerics.tensor import quantize
from .calibrate import InputObserver, choose_amax

__all__ = ["ATTN_NAME", "attention_modules", "enable_fp8_kv", "fp8_attention_to_kv_scales", "kv_cache_bytes"]

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


@torch.no_grad()
def fp8_attention_to_kv_scales(model: nn.Module) -> list[str]:
    """Hand the calibrated K and V scales to the FP8 KV cache and leave FP8 attention: each block gets ``k_scale`` /
    ``v_scale`` buffers (per-tensor dequantization multipliers: the largest of its static K and V multipliers over
    heads, as vLLM reads per-head ones into its KV cache; where the state has no static scales, ``amax / 448`` of
    the largest K and V amax it recorded, over heads and history) and loses its ``FP8AttentionState``; when every
    block had one, the model then runs the FP8 KV cache (``enable_fp8_kv(model, "quantize")``: keys and values
    rounded with those scales, the model's previous attention on them), else its previous attention; a PTQ report
    (``model.ptq_report``) then says the KV cache is FP8.
    ``fp8kit.export.save_pretrained`` writes them as an FP8 KV cache
    (compressed-tensors ``kv_cache_scheme``, ModelOpt ``k_proj.k_scale`` / ``v_proj.v_scale``). Returns the blocks' names; raises
    ``ValueError`` where a block recorded no K or V amax (calibrate first: ``calibrate_fp8_attention``)."""
    states = attention_states(model)
    if not states:
        raise ValueError("fp8_attention_to_kv_scales: the model has no FP8 attention")
    if any(st.attention_recipe.hadamard for st in states.values()):
        raise ValueError(
            "fp8_attention_to_kv_scales: Hadamard-rotated FP8 attention scales rotated keys, which no KV cache "
            "holds: calibrate without hadamard"
        )
    blocks = []
    for name, st in states.items():
        parent_name = name.removesuffix(f".{STATE_NAME}") if name != STATE_NAME else ""
        block = model.get_submodule(parent_name)
        static = static_scales(st)
        dequant = {}
        for op in ("k", "v"):
            index = st.index(op)
            if static is not None:
                dequant[op] = static[op].amax().reshape(1)
            elif bool((st.fp8_seen[index] > 0).all()):
                dequant[op] = dequant_scale(st.fp8_amax_history[index].amax().reshape(1), QKVP_FORMAT)
            else:
                raise ValueError(
                    f"{parent_name}: FP8 attention recorded no {op.upper()} amax; run calibrate_fp8_attention first"
                )
        for op in ("k", "v"):
            block.register_buffer(f"{op}_scale", dequant[op])
        del block._modules[STATE_NAME]
        cfg = block.config
        cfg._attn_implementation = getattr(cfg, "_fp8kit_previous_attn", None) or "sdpa"
        blocks.append(parent_name)
    top = getattr(model, "config", None)
    if top is not None and getattr(top, "_attn_implementation", None) == FP8_ATTENTION_NAME:
        top._attn_implementation = getattr(top, "_fp8kit_previous_attn", None) or "sdpa"
    report = getattr(model, "ptq_report", None)
    if report is not None and hasattr(report, "kv_cache"):
        report.kv_cache = True  # a PTQ model now has a calibrated FP8 KV cache (what the exporters read)
    if set(attention_modules(model)) == set(blocks):  # every block has its scales: run what the export serves
        enable_fp8_kv(model, "quantize")
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
