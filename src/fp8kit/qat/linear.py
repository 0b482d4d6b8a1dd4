"""``QATLinear``: a trainable ``nn.Linear`` whose forward runs a PTQ scheme's exact quantizers.

Each forward quantizes the float master weight with the quantizer ``QuantLinear.from_linear`` uses
(``fp8kit.quantize`` with the scheme's format and granularity, NVFP4 through ``nvfp4_fake_quant``, its
dequantized values bit for bit; NVFP4's per-tensor weight scale shared by
the layers that read one input, as ``ptq.quantize.shared_weight_scales`` does) and the input as
``QuantLinear`` does (static calibrated scale, per token at run time, NVFP4 blocks under a static
per-tensor scale, or not at all), then computes ``QuantLinear._forward_reference``'s math on those values:
FP4 and weight-only layers multiply the dequantized operands, W8A8 layers accumulate the code products and
scale the accumulator. With equal codes and scales the output equals the PTQ layer's reference path bit
for bit.

Gradients pass the quantizers straight through (``_Codes``): to the master weight as if the rounding were
the identity, to the input likewise except where a static scale clips it (zero there). With
``learn_scales`` the 8-bit weight scales (per tensor or per channel) and the static per-tensor activation
scale are trained as clipping values (``weight_amax``, ``input_amax``; the stored dequant scale is
``amax / fmt.max``, as PTQ stores it) with the LSQ gradient ``round(v) - v`` inside the range and the
clipped code outside. ``project_scales_`` keeps them finite and positive, within ``SCALE_RANGE`` of their
calibrated values; a forward with a non-finite or non-positive one raises.

``fix_fp4_scales`` pins an FP4 layer's block scales (and NVFP4's per-tensor weight scale) to those of a PTQ
weight, as GPTQ pins them before its sweep: the weight is then rounded to E2M1 on that fixed grid at every
step (``fixed_fp4_fake_quant``) instead of on scales recomputed from the current weight, so a master weight
equal to PTQ's dequantized weight gives back PTQ's codes exactly.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..numerics.formats import e2m1_encode
from ..numerics.scaling import compute_scale, dequant_scale, nvfp4_tensor_scale
from ..numerics.tensor import QuantizedTensor
from ..numerics.tensor import quantize as fp8_quantize
from ..ptq.schemes import Scheme, get_scheme
from .fakequant import fixed_fp4_fake_quant, nvfp4_fake_quant

__all__ = ["SCALE_RANGE", "QATLinear", "group_weight_scale"]

SCALE_RANGE = 2.0**10  # a learned clipping value stays within this factor of its calibrated value


class _Codes(torch.autograd.Function):
    """``codes`` forward (exact: the quantizer's code values of ``x / s``, or with ``s = 1`` the dequantized
    values); backward, the straight-through gradient ``grad / s`` to ``x`` (zero where ``|x / s| > qmax``
    when ``qmax`` is given) and, when ``s`` needs one, the LSQ gradient of the codes with respect to the
    scale (``-x / s**2`` inside the range, reduced to ``s``'s shape; the scale's other term comes from
    ``codes * s`` outside)."""

    @staticmethod
    def forward(ctx, x, s, codes, qmax):  # noqa: ANN001, ANN205 - autograd.Function's signature
        ctx.qmax = qmax
        ctx.save_for_backward(*((s,) if qmax is None else (x, s)))  # x only where the range clips
        return codes

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        if ctx.qmax is None:
            return grad / ctx.saved_tensors[0], None, None, None
        x, s = ctx.saved_tensors
        v = x / s
        inside = torch.isfinite(v) & (v.abs() <= ctx.qmax)
        gx = torch.where(inside, grad / s, torch.zeros_like(grad)) if ctx.needs_input_grad[0] else None
        gs = None
        if ctx.needs_input_grad[1]:
            per = torch.where(inside, -grad * v / s, torch.zeros_like(grad))
            gs = per.sum(dim=[d for d in range(per.dim()) if s.shape[d] == 1], keepdim=True)
        return gx, gs, None, None


def _straight(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (dequantized ``x``) forward, the identity gradient to ``x``."""
    return _Codes.apply(x, x.new_ones(()), value.detach(), None)


def _codes(x: torch.Tensor, s: torch.Tensor, codes: torch.Tensor, qmax: float | None = None) -> torch.Tensor:
    """``codes`` of ``x`` at dequant scale ``s`` (broadcastable to ``x``) forward; the gradient of ``x / s``,
    clipped outside ``qmax`` when given (then also the LSQ gradient of a learned ``s``)."""
    return _Codes.apply(x, s.reshape([1] * (x.dim() - s.dim()) + list(s.shape)), codes.detach(), qmax)


def group_weight_scale(layers: list[QATLinear]) -> torch.Tensor:
    """NVFP4's per-tensor weight scale shared by ``layers`` (the largest of their weights' amaxes)."""
    amax = max(float(m.weight.detach().abs().amax()) for m in layers)
    return nvfp4_tensor_scale(amax)


class QATLinear(nn.Module):
    """An ``nn.Linear`` (its own ``weight`` and ``bias`` parameters, shared with the layer it replaced) that
    computes with the scheme's quantized weight and input and trains through them (module doc)."""

    def __init__(
        self,
        linear: nn.Linear,
        scheme: Scheme | str,
        input_amax: float | None = None,
        learn_scales: bool = False,
        name: str = "",
    ) -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        self.name = name
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.learn_scales = bool(learn_scales)
        self._group: tuple[QATLinear, ...] = ()  # the layers sharing NVFP4's per-tensor weight scale
        if self.learn_scales and self.scheme.is_fp4:
            raise ValueError(
                f"learn_scales trains 8-bit weight scales and static per-tensor activation scales; {self.scheme.name} "
                "block scales follow the weights at every step (train without learn_scales)"
            )
        if self.scheme.static_activations:
            if input_amax is None:
                raise ValueError(f"scheme {self.scheme.name!r} needs a calibrated input amax (run a forward_loop)")
            amax = torch.tensor([float(input_amax)], dtype=torch.float32)
            if self.learn_scales:
                self.input_amax = nn.Parameter(amax)
                self.register_buffer("input_amax_init", amax.clone())
            else:
                self.register_buffer("input_amax", amax)
        else:
            self.input_amax = None
        if self.learn_scales:
            w = self.weight.detach().float()
            amax = w.abs().amax(dim=1, keepdim=True) if self.scheme.weight_strategy == "channel" else w.abs().amax()
            amax = amax.reshape(-1, 1) if self.scheme.weight_strategy == "channel" else amax.reshape(1)
            self.weight_amax = nn.Parameter(amax.clone())
            self.register_buffer("weight_amax_init", amax.clone())
        else:
            self.weight_amax = None
        self.fp4_scales: QuantizedTensor | None = None  # fixed FP4 weight scales (``fix_fp4_scales``)
        self.register_buffer("fp4_scale_inv", None)

    @torch.no_grad()
    def fix_fp4_scales(self, qt: QuantizedTensor) -> None:
        """Round the weight on ``qt``'s grid from now on: ``qt`` is an FP4 weight of this layer's shape and
        granularity (``QuantLinear.fp4_weight()``), whose block scales and per-tensor scale are kept."""
        gran = self.scheme.weight_granularity
        if not self.scheme.is_fp4 or tuple(qt.shape) != (self.out_features, self.in_features) or qt.fmt.name != "e2m1":
            raise ValueError(
                f"fix_fp4_scales takes the ({self.out_features}, {self.in_features}) E2M1 weight of an FP4 layer "
                f"(QuantLinear.fp4_weight()); this layer is {self.scheme.name}"
            )
        if qt.block != (1, 16 if gran == "nvfp4" else 32):
            raise ValueError(
                f"fix_fp4_scales: {gran} weights have 1x{16 if gran == 'nvfp4' else 32} blocks, got {qt.block}"
            )
        self.fp4_scales = QuantizedTensor(
            None, qt.scales.clone(), qt.fmt, qt.granularity, qt.block, torch.float32,
            global_scale=None if qt.global_scale is None else qt.global_scale.clone(),
        )  # fmt: skip
        self.fp4_scale_inv = qt.scale_inv.float().clone().to(self.weight.device)

    def fp4_weight(self) -> QuantizedTensor:
        """The current FP4 weight as PTQ stores it: E2M1 codes with the fixed scales (``fix_fp4_scales``) or
        those ``fp8kit.quantize`` gives the master weight (under the group's shared per-tensor scale)."""
        w = self.weight.detach().float()
        if self.fp4_scales is None:
            shared = self.weight_global_scale()
            kw = {"global_scale": shared} if shared is not None else {}
            return fp8_quantize(w, self.scheme.weight_format, self.scheme.weight_granularity, **kw)
        fixed = self.fp4_scales
        codes = e2m1_encode(fixed_fp4_fake_quant(w, self.fp4_scale_inv, codes=True))
        return QuantizedTensor(
            codes, fixed.scales.to(w.device), fixed.fmt, fixed.granularity, fixed.block, torch.float32,
            global_scale=None if fixed.global_scale is None else fixed.global_scale.to(w.device),
        )  # fmt: skip

    # -- scales ------------------------------------------------------------------------------------

    def scale_parameters(self) -> list[nn.Parameter]:
        """The learned clipping values (empty without ``learn_scales``)."""
        return [p for p in (self.weight_amax, self.input_amax) if isinstance(p, nn.Parameter)]

    @torch.no_grad()
    def project_scales_(self) -> None:
        """Put each learned clipping value back in ``[init / SCALE_RANGE, init * SCALE_RANGE]``; a NaN goes
        back to its calibrated value."""
        for p, init in ((self.weight_amax, "weight_amax_init"), (self.input_amax, "input_amax_init")):
            if isinstance(p, nn.Parameter):
                start = getattr(self, init)
                p.copy_(torch.where(torch.isnan(p), start, p))
                p.copy_(torch.minimum(torch.maximum(p, start / SCALE_RANGE), start * SCALE_RANGE))

    def _checked(self, amax: torch.Tensor, what: str) -> torch.Tensor:
        if not bool(torch.isfinite(amax).all()) or not bool((amax > 0).all()):
            raise ValueError(
                f"layer {self.name or 'QATLinear'}: the {what} clipping value must be finite and > 0, got "
                f"{amax.detach().flatten()[:4].tolist()}: call project_scales_() after each optimizer step "
                "(fp8kit.qat.distill does) or lower the scale learning rate"
            )
        return amax.float()

    def input_scale(self) -> torch.Tensor | None:
        """The static input dequant scale ``QuantLinear.from_linear`` would store (``(1,)``), or ``None``."""
        if self.input_amax is None:
            return None
        amax = self._checked(self.input_amax, "input")
        if self.scheme.act_strategy == "nvfp4":
            return nvfp4_tensor_scale(amax.detach()).reshape(1)
        if self.learn_scales:
            return amax / self.scheme.act_format.max
        return dequant_scale(amax, self.scheme.act_format)

    def weight_global_scale(self) -> torch.Tensor | None:
        """NVFP4's per-tensor weight scale: the fixed one (``fix_fp4_scales``), the one shared with the
        layer's group, or ``None`` (its own)."""
        if self.fp4_scales is not None:
            return self.fp4_scales.global_scale
        return group_weight_scale(list(self._group)) if len(self._group) > 1 else None

    # -- quantized operands --------------------------------------------------------------------------

    def quantized_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight as the forward uses it: FP4, the dequantized weight (float32, ``(out, in)``) and
        ``None``; 8-bit, the code values (float32) and their dequant scale (``(1,)`` or ``(out, 1)``)."""
        fmt, w = self.scheme.weight_format, self.weight.float()
        if self.scheme.is_fp4:
            shared = self.weight_global_scale()
            with torch.no_grad():
                if self.fp4_scale_inv is not None:
                    deq = fixed_fp4_fake_quant(w.detach(), self.fp4_scale_inv)
                elif self.scheme.weight_granularity == "nvfp4":
                    deq = nvfp4_fake_quant(w.detach(), shared)
                else:
                    kw = {"global_scale": shared} if shared is not None else {}
                    deq = fp8_quantize(w.detach(), fmt, self.scheme.weight_granularity, **kw).dequantize(torch.float32)
            return _straight(w, deq), None
        if self.weight_amax is not None:
            amax = self._checked(self.weight_amax, "weight")
            with torch.no_grad():
                gran = "row" if self.scheme.weight_strategy == "channel" else "tensor"
                mult = compute_scale(amax.detach(), fmt)
                codes = fp8_quantize(w.detach(), fmt, gran, scale=mult.reshape(-1, 1) if gran == "row" else mult)
                codes = codes.data.float()
            s = amax / fmt.max
            return _codes(w, s, codes, fmt.max), s
        with torch.no_grad():
            qt = fp8_quantize(w.detach(), fmt, self.scheme.weight_granularity)
            s = dequant_scale(qt.amax, fmt)
            s = s.reshape(-1, 1) if self.scheme.weight_strategy == "channel" else s.reshape(1)
            codes = qt.data.float()
        return _codes(w, s, codes), s

    def quantized_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A 2-D input as the forward uses it: FP4 and weight-only, the (dequantized) values and ``None``;
        W8A8, the code values and their dequant scale (``(1,)`` static, ``(tokens, 1)`` per token)."""
        fmt = self.scheme.act_format
        if fmt is None:
            return x2, None
        if self.scheme.is_fp4:
            gs = self.input_scale()
            with torch.no_grad():
                xd = nvfp4_fake_quant(x2.detach(), gs)
            return _straight(x2, xd), None
        if self.scheme.act_strategy == "tensor":
            s = self.input_scale()
            with torch.no_grad():
                mult = 1.0 / s.detach()
                qt = fp8_quantize(x2.detach(), fmt, "row", scale=mult, nonfinite="propagate", check_scale=False)
            return _codes(x2, s, qt.data.float(), fmt.max), s
        with torch.no_grad():
            qt = fp8_quantize(x2.detach(), fmt, "row", nonfinite="propagate")
        return _codes(x2, qt.scale_inv, qt.data.float()), qt.scale_inv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QATLinear expects inputs with last dim {self.in_features}, got {tuple(x.shape)}")
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        w, ws = self.quantized_weight()
        if self.scheme.is_fp4:
            xd, _ = self.quantized_input(x2)
            out = xd.float() @ w.t()
        elif self.scheme.act_format is None:  # weight-only
            out = x2.float() @ (w * ws.reshape(-1, 1)).t()
        else:
            xq, sx = self.quantized_input(x2)
            acc = xq @ w.t()  # the code products, FP32 accumulation
            out = acc * sx.reshape(-1, 1) * ws.reshape(1, -1)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"learn_scales={self.learn_scales}"
        )
