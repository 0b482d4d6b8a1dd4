"""``QuantLinear``: an inference ``nn.Linear`` with 8-bit weights (real storage, not fake-quant).

Weights are held as ``float8_e4m3fn`` or ``int8`` codes with float32 dequant scales
(``weight_scale``: shape ``(1,)`` per tensor or ``(out, 1)`` per channel). Activations are quantized
per tensor with a calibrated ``input_scale`` of shape ``(1,)``, per token at run time, or not at all
(weight-only). On the CPU the GEMM runs in FP32 on the exact code values and applies the scales to the
FP32 accumulator, which is what an FP8/INT8 tensor core with FP32 (INT32) accumulation computes, up to
summation order.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..formats import Format, cast_nearest_fast
from .schemes import Scheme, get_scheme

__all__ = ["QuantLinear", "quantize_codes", "scale_for"]

_TINY = 1e-12  # amax floor: an all-zero row gets a finite scale and quantizes to zeros


def scale_for(amax: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Dequant multiplier ``amax / fmt.max`` (float32), floored so an all-zero row stays finite."""
    return (amax.float().clamp_min(_TINY) / fmt.max).float()


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Codes of ``x / scale`` in ``fmt`` (E4M3: saturating round-to-nearest-even; INT8: half-to-even
    rounding clamped to [-127, 127])."""
    y = x.float() / scale
    if fmt.kind == "float":
        return cast_nearest_fast(y, fmt, saturate=True)
    return torch.round(y).clamp_(-fmt.max, fmt.max).to(torch.int8)


class QuantLinear(nn.Module):
    """Inference-only linear layer with 8-bit weights and optional 8-bit activations."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Scheme | str) -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        self.in_features, self.out_features = in_features, out_features
        per_channel = self.scheme.weight_strategy == "channel"
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.scheme.weight_format.dtype))
        self.register_buffer("weight_scale", torch.ones(out_features, 1) if per_channel else torch.ones(1))
        if self.scheme.static_activations:
            self.register_buffer("input_scale", torch.ones(1))
        else:
            self.input_scale = None
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme | str, input_amax: float | None = None) -> QuantLinear:
        """Quantize ``linear``'s weight; ``input_amax`` sets the static activation scale (required for
        static schemes)."""
        scheme = get_scheme(scheme)
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        w = linear.weight.detach().float()
        if not torch.isfinite(w).all():
            raise ValueError("the weight holds NaN or inf; it cannot be quantized")
        amax = w.abs().amax(dim=1, keepdim=True) if scheme.weight_strategy == "channel" else w.abs().amax().reshape(1)
        q.weight_scale = scale_for(amax, scheme.weight_format)
        q.weight = quantize_codes(w, q.weight_scale, scheme.weight_format)
        if linear.bias is not None:
            q.bias = linear.bias.detach().float().clone()
        if scheme.static_activations:
            if input_amax is None:
                raise ValueError(f"scheme {scheme.name!r} needs a calibrated input amax (run a forward_loop)")
            q.input_scale = scale_for(torch.tensor([float(input_amax)]), scheme.act_format)
        return q

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with, ``codes * weight_scale``."""
        return (self.weight.float() * self.weight_scale.reshape(-1, 1)).to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of the stored weight codes and scales (the bias is not counted)."""
        return self.weight.numel() * self.weight.element_size() + self.weight_scale.numel() * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        fmt = self.scheme.act_format
        if fmt is None:  # weight-only
            out = x2 @ self.dequantized_weight().t()
        else:
            if self.scheme.act_strategy == "tensor":
                sx = self.input_scale
            else:  # per token, at run time
                sx = scale_for(x2.abs().amax(dim=1, keepdim=True), fmt)
            xq = quantize_codes(x2, sx, fmt)
            acc = xq.float() @ self.weight.float().t()  # exact products, FP32 accumulation
            out = acc * (sx.reshape(-1, 1) if sx.numel() > 1 else sx) * self.weight_scale.reshape(1, -1)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"
