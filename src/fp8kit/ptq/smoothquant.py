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

from ..numerics.formats import Format
from ..numerics.scaling import compute_scale, nvfp4_tensor_scale
from ..numerics.tensor import quantize as fp8_quantize
from .calibrate import InputObserver
from .schemes import Scheme, get_scheme

__all__ = [
    "ALPHA_GRID",
    "SmoothMapping",
    "apply_smoothing",
    "apply_smoothing_search",
    "find_mappings",
    "fold_scales",
    "search_alpha",
    "smoothed_error",
]


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


ALPHA_GRID = 11  # alpha in 0, 0.1, ..., 1 for the per-mapping search


def _fake_quant(x: torch.Tensor, fmt: Format, granularity: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize ``x`` (float32) with ``fp8kit.quantize``; a static per-tensor ``amax`` if given."""
    scale = None if amax is None else compute_scale(amax.reshape(1), fmt)
    return fp8_quantize(x, fmt, granularity, scale=scale, check_scale=False).dequantize(torch.float32)


@torch.no_grad()
def smoothed_error(
    x: torch.Tensor, x_amax: torch.Tensor, weights: list[torch.Tensor], scheme: Scheme | str, s: torch.Tensor
) -> float:
    """Mean squared output error of one smoothed group, as ``scheme`` quantizes it: sample inputs ``x``
    ``(rows, in)`` divided by ``s`` and quantized with the static per-tensor scale that ``max`` calibration
    gives (``max(x_amax / s)``), or per token for dynamic schemes, or NVFP4 blocks under that static tensor
    scale; each weight ``(out_i, in)`` times ``s`` quantized per channel, per tensor or in FP4 blocks (round
    to nearest); against the unquantized ``x @ W^T``."""
    scheme = get_scheme(scheme)
    x = x.float()
    ref = torch.cat([x @ w.float().t() for w in weights], dim=1)
    xs = x / s
    if scheme.act_strategy == "nvfp4":  # E2M1 blocks under the max-calibrated tensor scale
        gs = nvfp4_tensor_scale((x_amax.float() / s).amax())
        xs = fp8_quantize(xs, scheme.act_format, "nvfp4", global_scale=gs).dequantize(torch.float32)
    elif scheme.act_format is not None:
        static = scheme.act_strategy == "tensor"
        amax = (x_amax.float() / s).amax() if static else None
        xs = _fake_quant(xs, scheme.act_format, "tensor" if static else "row", amax)
    gran = scheme.weight_granularity if scheme.is_fp4 else "row" if scheme.weight_strategy == "channel" else "tensor"
    out = torch.cat([xs @ _fake_quant(w.float() * s, scheme.weight_format, gran).t() for w in weights], dim=1)
    return float((out - ref).pow(2).mean())


@torch.no_grad()
def search_alpha(
    x: torch.Tensor,
    x_amax: torch.Tensor,
    weights: list[torch.Tensor],
    scheme: Scheme | str,
    grid: int = ALPHA_GRID,
) -> tuple[torch.Tensor, float | None, dict[float | None, float]]:
    """The SmoothQuant alpha of one group (SmoothQuant's per-layer search): the factors of ``alpha`` on
    ``grid`` points in ``[0, 1]``, or no smoothing (``None``), whichever gives the smallest
    ``smoothed_error`` on the sample ``x``. Returns ``(s, alpha, {alpha: error})``."""
    if grid < 2:
        raise ValueError(f"the SmoothQuant alpha search needs at least 2 grid points, got {grid}")
    w_amax = torch.stack([w.detach().abs().amax(dim=0) for w in weights]).amax(dim=0)
    candidates: dict[float | None, torch.Tensor] = {None: torch.ones_like(x_amax, dtype=torch.float32)}
    for a in torch.linspace(0, 1, grid).tolist():
        candidates[round(a, 4)] = smoothing_factors(x_amax, w_amax, a)
    errors = {a: smoothed_error(x, x_amax, weights, scheme, s) for a, s in candidates.items()}
    best = min(errors, key=lambda a: errors[a])
    return candidates[best], best, errors


@torch.no_grad()
def apply_smoothing_search(
    model: nn.Module,
    mappings: list[SmoothMapping],
    observers: dict[str, InputObserver],
    rows: dict[str, torch.Tensor],
    scheme: Scheme | str,
    grid: int = ALPHA_GRID,
    factors: dict[str, torch.Tensor] | None = None,
) -> dict[str, float | None]:
    """Smooth every mapping in place with its own alpha from ``search_alpha`` (on the sample input
    ``rows[first target]``); returns the chosen alpha per source (``None``: left unsmoothed) and puts the
    folded factors per smoothed source in ``factors`` when given (``apply_smoothing``'s return)."""
    chosen: dict[str, float | None] = {}
    for mp in mappings:
        x_amax = observers[mp.targets[0]].channel_amax
        if x_amax is None or mp.targets[0] not in rows:
            raise ValueError(f"SmoothQuant: {mp.targets[0]!r} saw no calibration data")
        weights = [model.get_submodule(t).weight for t in mp.targets]
        s, alpha, _ = search_alpha(rows[mp.targets[0]], x_amax, weights, scheme, grid)
        if alpha is not None:
            fold_scales(model, mp, s)
            if factors is not None:
                factors[mp.source] = s
        chosen[mp.source] = alpha
    return chosen


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
