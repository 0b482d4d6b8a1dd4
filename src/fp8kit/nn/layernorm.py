"""Norm + FP8 GEMM modules: ``LayerNormLinear`` and ``LayerNormMLP`` (GELU or SwiGLU).

The normalization (LayerNorm or RMSNorm) runs in high precision and its output is quantized as the
GEMM input; under ``torch.compile`` the norm and the cast fuse into one kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..numerics.recipes import Recipe
from .linear import Linear

__all__ = ["LayerNormLinear", "LayerNormMLP"]

_NORMS = ("LayerNorm", "RMSNorm")


def _norm(x: torch.Tensor, kind: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if kind == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class _NormMixin(nn.Module):
    def _init_norm(self, hidden: int, normalization: str, eps: float, device: Any, dtype: torch.dtype | None) -> None:
        if normalization not in _NORMS:
            raise ValueError(f"normalization must be one of {_NORMS}, got {normalization!r}")
        self.normalization = normalization
        self.eps = eps
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden, device=device, dtype=dtype))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(hidden, device=device, dtype=dtype))
        else:
            self.register_parameter("layer_norm_bias", None)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps)


class LayerNormLinear(Linear, _NormMixin):
    """``Linear(norm(x))`` with the norm's parameters inside the module (Transformer Engine layout)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        device: Any = None,
        dtype: torch.dtype | None = None,
        recipe: Recipe | None = None,
        save_fp8_activations: bool = True,
        name: str = "",
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            bias,
            device,
            dtype,
            recipe=recipe,
            save_fp8_activations=save_fp8_activations,
            name=name,
        )
        self._init_norm(in_features, normalization, eps, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x))


class LayerNormMLP(_NormMixin):
    """``fc2(act(fc1(norm(x))))`` with FP8 GEMMs; ``activation`` is ``"gelu"`` or ``"swiglu"``.

    For SwiGLU ``fc1`` produces ``2 * ffn_hidden_size`` features: ``silu(gate) * up``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        eps: float = 1e-5,
        device: Any = None,
        dtype: torch.dtype | None = None,
        recipe: Recipe | None = None,
        save_fp8_activations: bool = True,
        name: str = "",
    ) -> None:
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation must be 'gelu' or 'swiglu', got {activation!r}")
        self.activation = activation
        self._init_norm(hidden_size, normalization, eps, device, dtype)
        width = 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size
        kw = {"device": device, "dtype": dtype, "recipe": recipe, "save_fp8_activations": save_fp8_activations}
        self.fc1 = Linear(hidden_size, width, bias, name=f"{name or 'LayerNormMLP'}.fc1", **kw)
        self.fc2 = Linear(ffn_hidden_size, hidden_size, bias, name=f"{name or 'LayerNormMLP'}.fc2", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.norm(x))
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)
