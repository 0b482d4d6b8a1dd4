"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before INT8 quantization.

For a group of linear layers reading the same input ``X``, each input channel ``j`` gets
``s_j = max|X_j|**alpha / max|W_j|**(1 - alpha)`` (``W_j``: column ``j`` of every layer in the group).
The input is divided by ``s`` and the weight columns multiplied by it, so the product is unchanged.
The division is folded into the operation that produces ``X`` (no run-time cost):

* ``input_layernorm`` -> ``q_proj, k_proj, v_proj`` (the norm's weight, and bias if any, divided by s);
* ``post_attention_layernorm`` -> ``gate_proj, up_proj``;
* ``up_proj`` -> ``down_proj`` (``down_proj``'s input is ``act(gate) * up``, linear in ``up``'s rows).

Layers whose input cannot absorb the division (e.g. ``o_proj`` under grouped-query attention) are not
smoothed. The mappings are found by these (Llama, Mistral, Qwen) names, and in BERT-style encoders:

* ``attention.self.value`` -> ``attention.output.dense`` (attention mixes tokens, not channels).

BERT's LayerNorms are post-LN: their output is also the residual stream, so a division folded into them
would change the model (``test_ptq_encoder.py`` shows it); query/key/value and ``intermediate.dense``
(after a LayerNorm) and ``output.dense`` (after GELU) are quantized unsmoothed. A norm whose output feeds
only the smoothed layers (pre-LN, as in Llama) takes the division in its weight and bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .calibrate import InputObserver

__all__ = ["SmoothMapping", "apply_smoothing", "find_mappings", "fold_scales"]


@dataclass
class SmoothMapping:
    """``source`` produces the input of ``targets`` (qualified names)."""

    source: str
    targets: list[str]


def find_mappings(model: nn.Module, eligible: set[str]) -> list[SmoothMapping]:
    """The foldable (source, targets) pairs of a Llama-style decoder among the ``eligible`` Linears."""
    out: list[SmoothMapping] = []
    for name, m in model.named_modules():
        attn, mlp = getattr(m, "self_attn", None), getattr(m, "mlp", None)
        prefix = f"{name}." if name else ""
        if attn is not None and hasattr(m, "input_layernorm"):
            targets = [f"{prefix}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj") if hasattr(attn, p)]
            if targets and all(t in eligible for t in targets):
                out.append(SmoothMapping(f"{prefix}input_layernorm", targets))
        if mlp is not None and hasattr(m, "post_attention_layernorm"):
            targets = [f"{prefix}mlp.{p}" for p in ("gate_proj", "up_proj") if hasattr(mlp, p)]
            if targets and all(t in eligible for t in targets):
                out.append(SmoothMapping(f"{prefix}post_attention_layernorm", targets))
            if hasattr(mlp, "up_proj") and f"{prefix}mlp.down_proj" in eligible:
                out.append(SmoothMapping(f"{prefix}mlp.up_proj", [f"{prefix}mlp.down_proj"]))
        # BERT-style (post-LN) encoder: attention.self.value -> attention.output.dense
        enc = getattr(m, "attention", None)
        value = getattr(getattr(enc, "self", None), "value", None)
        dense = getattr(getattr(enc, "output", None), "dense", None)
        if isinstance(value, nn.Linear) and isinstance(dense, nn.Linear) and value.out_features == dense.in_features:
            if f"{prefix}attention.output.dense" in eligible:
                out.append(SmoothMapping(f"{prefix}attention.self.value", [f"{prefix}attention.output.dense"]))
    return out


def smoothing_factors(x_amax: torch.Tensor, w_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = x_amax_j**alpha / w_amax_j**(1-alpha)``; 1 where either is zero, clamped to [1e-4, 1e4]."""
    s = x_amax.float().pow(alpha) / w_amax.float().pow(1 - alpha)
    ok = (x_amax > 0) & (w_amax > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(1e-4, 1e4)


@torch.no_grad()
def apply_smoothing(
    model: nn.Module, mappings: list[SmoothMapping], observers: dict[str, InputObserver], alpha: float = 0.5
) -> dict[str, torch.Tensor]:
    """Smooth every mapping in place (the model computes the same function); returns the factors."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    factors: dict[str, torch.Tensor] = {}
    for mp in mappings:
        x_amax = observers[mp.targets[0]].channel_amax
        if x_amax is None:
            raise ValueError(f"SmoothQuant: {mp.targets[0]!r} saw no calibration data")
        linears = [model.get_submodule(t) for t in mp.targets]
        w_amax = torch.stack([lin.weight.abs().amax(dim=0) for lin in linears]).amax(dim=0)
        s = smoothing_factors(x_amax, w_amax, alpha)
        fold_scales(model, mp, s)
        factors[mp.source] = s
    return factors


@torch.no_grad()
def fold_scales(model: nn.Module, mp: SmoothMapping, s: torch.Tensor) -> None:
    """Divide the input of ``mp.targets`` by ``s`` (per input channel) and multiply their weight columns by
    it, in place: the division is folded into ``mp.source`` (a Linear's output rows and bias, or a norm's
    weight and bias), so the model computes the same function."""
    linears = [model.get_submodule(t) for t in mp.targets]
    src = model.get_submodule(mp.source)
    if isinstance(src, nn.Linear):  # fold into the producing layer's output rows
        src.weight.div_(s.reshape(-1, 1).to(src.weight.dtype))
        if src.bias is not None:
            src.bias.div_(s.to(src.bias.dtype))
    else:  # a norm: fold into its elementwise weight (and bias)
        weight = getattr(src, "weight", None)
        if weight is None or weight.shape != s.shape:
            raise ValueError(f"SmoothQuant: cannot fold into {mp.source!r} (no per-channel weight)")
        weight.div_(s.to(weight.dtype))
        if getattr(src, "bias", None) is not None:
            src.bias.div_(s.to(src.bias.dtype))
    for lin in linears:
        lin.weight.mul_(s.reshape(1, -1).to(lin.weight.dtype))
