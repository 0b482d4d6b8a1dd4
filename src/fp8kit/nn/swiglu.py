"""SwiGLU MLP options: Smooth-SwiGLU (an outlier-proof ``down_proj`` input) and clamped SwiGLU.

A SwiGLU MLP (``transformers`` Llama, Mistral, Qwen: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``)
grows outlier channels in its output as the rows of ``gate_proj`` and ``up_proj`` align over training
(Fishman et al., "Scaling FP8 training to trillion-token LLMs"): one channel of the ``down_proj`` input
ends orders of magnitude above the rest, and a per-tensor FP8 scale set by it crushes every other channel.

* **Smooth-SwiGLU** (``smooth=True``): each forward scales channel ``j`` of the SwiGLU output ``h`` by a
  power of two ``s_j`` and the matching column of the ``down_proj`` weight by ``1 / s_j``, so
  ``down_proj`` computes ``(h * s) @ (W / s).T``, the same product. ``s`` is set from this step's
  channel maxima (``smooth_scales``: SmoothQuant's square-root split of each channel's range between the
  activation and the weight), so the FP8 GEMM quantizes the smoothed operands. Powers of two make the
  fold exact in BF16 and FP32: a high-precision model computes what it did without the option.
* **Clamped SwiGLU** (``limit=L``): the gate pre-activation is clamped to at most ``L`` and the up
  projection to ``[-L, L]`` (GPT-OSS, GLM's ``swiglu_limit``); this changes the model, bounding the
  outliers SwiGLU can produce.

``apply_swiglu_options(model, smooth=..., limit=...)`` gives every such MLP of a model the options in
place (its class gains ``SwiGLUOptions`` in front; parameters, hooks and attributes stay);
``fp8kit.convert(model, recipe, smooth_swiglu=True, swiglu_limit=L)`` calls it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.func import functional_call

from .class_swap import swap_class

__all__ = ["SwiGLUOptions", "apply_swiglu_options", "smooth_scales", "swiglu_mlps"]

MAX_SHIFT = 24  # |log2 s_j| at most: the fold stays far from bfloat16/float32 overflow and underflow


def swiglu_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The SwiGLU MLPs of ``model``: modules with ``gate_proj``, ``up_proj`` and ``down_proj`` linear layers
    (2-D weights) and an ``act_fn``, as ``transformers`` decoders name them."""
    found = []
    for name, m in model.named_modules():
        projs = [getattr(m, p, None) for p in ("gate_proj", "up_proj", "down_proj")]
        if callable(getattr(m, "act_fn", None)) and all(
            isinstance(p, nn.Module) and getattr(p, "weight", None) is not None and p.weight.dim() == 2 for p in projs
        ):
            found.append((name, m))
    return found


@torch.no_grad()
def smooth_scales(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per channel ``j`` of ``h`` (last dim), the power of two ``s_j`` that Smooth-SwiGLU multiplies it by.

    With ``a_j = max |h_j|`` and ``w_j = max |W[:, j]|`` (``weight`` ``(N, K)``), SmoothQuant's split
    ``t_j = sqrt(a_j / w_j)`` leaves ``a_j / t_j = sqrt(a_j w_j) = w_j t_j`` on both operands;
    ``s_j = 2**round(log2(m / t_j))`` with ``m`` the median of ``t`` (a typical channel keeps its
    scale), clipped to ``2**±MAX_SHIFT``. A channel that is all zeros keeps ``s_j = 1``.
    """
    a = h.detach().reshape(-1, h.shape[-1]).abs().amax(dim=0).float()
    w = weight.detach().abs().amax(dim=0).float()
    live = (a > 0) & (w > 0) & torch.isfinite(a)
    s = torch.ones_like(a)
    if bool(live.any()):
        t = torch.sqrt(a[live] / w[live])
        shift = torch.round(torch.log2(t.median() / t)).clamp(-MAX_SHIFT, MAX_SHIFT)
        s[live] = torch.exp2(shift)
    return s


class SwiGLUOptions(nn.Module):
    """The class a SwiGLU MLP gains in front (``apply_swiglu_options``): its forward with the options
    ``swiglu_smooth`` (bool) and ``swiglu_limit`` (float or None) set on the module."""

    swiglu_smooth: bool
    swiglu_limit: float | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
        h = self.act_fn(gate) * up
        down = self.down_proj
        if not self.swiglu_smooth:
            return down(h)
        w = down.weight
        s = smooth_scales(h, w).to(h.dtype)
        # the down projection runs as a module (its hooks, FP8 state and inspector see it) on the smoothed
        # operands; its FP8 weight cache is keyed on the weight tensor, so it is dropped after the call
        out = functional_call(down, {"weight": w / s.to(w.dtype)}, (h * s,))
        release = getattr(down, "release_fp8_weights", None)
        if release is not None:
            release()
        return out


def apply_swiglu_options(model: nn.Module, smooth: bool = False, limit: float | None = None) -> list[str]:
    """Give every SwiGLU MLP of ``model`` Smooth-SwiGLU (``smooth``) and/or clamped SwiGLU (``limit``), in
    place; returns their names. A model without such an MLP is an error when an option is asked for."""
    if limit is not None and not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
        raise ValueError(f"swiglu_limit must be a positive number (GPT-OSS uses 7.0), got {limit!r}")
    if not smooth and limit is None:
        return []
    mlps = swiglu_mlps(model)
    if not mlps:
        raise ValueError(
            "smooth_swiglu / swiglu_limit: the model has no SwiGLU MLP (a module with gate_proj, up_proj, "
            "down_proj and act_fn); leave the options out for this model"
        )
    for _, m in mlps:
        if not isinstance(m, SwiGLUOptions):
            swap_class(m, SwiGLUOptions, "SwiGLU")
        m.swiglu_smooth = bool(smooth)
        m.swiglu_limit = None if limit is None else float(limit)
    return [n for n, _ in mlps]
