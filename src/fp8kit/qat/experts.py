"""``QATExperts``: an MoE experts module that trains through a PTQ scheme's expert quantizers.

``install_qat_experts`` swaps a ``transformers`` experts module's class for one with ``QATExperts`` in
front (its 3-D parameters, biases, hooks and ``act_fn`` stay: the float master weights) and routes it
through ``ptq.experts``' ``"fp8kit_ptq"`` implementation, so the tokens are routed and gated exactly as
in the PTQ model. Each projection's forward quantizes every expert's weight as ``ptq.experts`` does
(per expert: 8-bit per tensor or per channel through ``quantize_codes``; NVFP4 with the expert's own
per-tensor scale, the fused ``gate_up`` one for gate and up together, through ``nvfp4_fake_quant``;
MXFP4 through ``fp8kit.quantize``; or, after ``fix_fp4_grid``, on a PTQ module's fixed block scales through
``fixed_fp4_fake_quant``) and the routed tokens as ``QuantExperts.dequantized_input`` does (the
static scale shared by the layer's experts, per token at run time, or NVFP4 blocks under the static
per-tensor scale), then multiplies the dequantized operands with ``QuantExperts``' straight-through
grouped GEMM, so at equal weights the output equals the PTQ module's straight-through path bit for bit
and its inference kernels up to float32 summation order. Gradients pass both quantizers straight through
(``qat.linear``'s rule: zero where a static input scale clips), to the inputs and the master weights.

``frozen_experts`` turns the module back into PTQ's ``QuantExperts`` from its current master weights (on the
fixed grid, with its scales, where ``fix_fp4_grid`` set one).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..nn.class_swap import swap_class
from ..numerics.formats import E2M1, e2m1_encode
from ..numerics.scaling import dequant_scale, nvfp4_tensor_scale
from ..numerics.state_dict import pack_fp4
from ..numerics.tensor import quantize as fp8_quantize
from ..ptq.experts import (
    QuantExperts,
    dispatch_quant_experts,
    experts_base_class,
    experts_projections,
    quantize_codes,
    quantize_experts_module,
)
from ..ptq.schemes import Scheme
from .fakequant import fixed_fp4_fake_quant, nvfp4_fake_quant
from .linear import _codes, _straight

__all__ = ["QATExperts", "fix_fp4_grid", "fp4_grid", "frozen_experts", "install_qat_experts", "qat_experts"]

# the fixed FP4 grid of a projection P (``fix_fp4_grid``): PTQ's block scales, NVFP4's per-tensor scales and the
# float32 multipliers they make, buffers ``P_fixed_<key>``
_GRID_KEYS = ("weight_scale", "weight_scale_2", "scale_inv")


class _GroupedMatmulTrain(torch.autograd.Function):
    """``out[rows of e] = x[rows of e] @ w[e].T`` (``w`` ``(E, out, in)``), differentiable in ``x`` and ``w``;
    the forward is ``QuantExperts``' straight-through grouped GEMM."""

    @staticmethod
    def forward(ctx, x, w, offs):  # noqa: ANN001, ANN205 - autograd.Function's signature
        from ..gemm.grouped import grouped_mm

        ctx.save_for_backward(x, w, offs)
        return grouped_mm(x, w.transpose(1, 2).contiguous(), offs)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        from ..gemm.grouped import grouped_mm

        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        dx = grouped_mm(grad, w.contiguous(), offs) if ctx.needs_input_grad[0] else None
        dw = grouped_mm(grad.t().contiguous(), x.contiguous(), offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class QATExperts(QuantExperts):
    """Mixin ``install_qat_experts`` puts in front of an experts module's class (module doc). Holds
    ``scheme``, ``projections`` and, for static schemes, ``P_input_amax`` buffers (one per projection,
    shared by the layer's experts, as PTQ's ``P_input_scale``)."""

    def master_weight(self, p: int) -> torch.Tensor:
        """Projection ``p``'s trainable master weight as ``(E, out, in)`` float32 (differentiable)."""
        w = getattr(self, self.projections[p]).float()
        return w.transpose(1, 2) if self.is_transposed else w

    def input_scale(self, p: int) -> torch.Tensor | None:
        amax = getattr(self, f"{self.projections[p]}_input_amax", None)
        if amax is None:
            return None
        if self.scheme.act_strategy == "nvfp4":
            return nvfp4_tensor_scale(float(amax)).reshape(1).to(amax.device)
        return dequant_scale(amax.float(), self.scheme.act_format)

    def fixed_scale_inv(self, p: int) -> torch.Tensor | None:
        """Projection ``p``'s fixed FP4 block multipliers ``(E, out, in / block)`` (``fix_fp4_grid``), or None."""
        return getattr(self, f"{self.projections[p]}_fixed_scale_inv", None)

    def on_fixed_grid(self, p: int, w: torch.Tensor, codes: bool = False) -> torch.Tensor:
        """``w`` ``(E, out, in)`` rounded on projection ``p``'s fixed grid (``fix_fp4_grid``): the dequantized
        values, or (``codes``) the E2M1 values, float32 (``fixed_fp4_fake_quant`` over every expert at once)."""
        e, out, cols = w.shape
        inv = self.fixed_scale_inv(p).reshape(e * out, -1)
        return fixed_fp4_fake_quant(w.reshape(e * out, cols), inv, codes=codes).reshape(e, out, cols)

    def dequantized_weight(self, p: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every expert's quantize-dequantized master weight ``(E, out, in)``, straight-through to it."""
        w = self.master_weight(p)
        with torch.no_grad():
            wd = w.detach()
            if self.fixed_scale_inv(p) is not None:
                deq = self.on_fixed_grid(p, wd)
            elif self.scheme.weight_granularity == "nvfp4":
                deq = torch.stack([nvfp4_fake_quant(wd[e]) for e in range(wd.shape[0])])
            elif self.scheme.is_fp4:
                deq = torch.stack(
                    [
                        fp8_quantize(wd[e], E2M1, self.scheme.weight_granularity).dequantize(torch.float32)
                        for e in range(wd.shape[0])
                    ]
                )
            else:
                codes, scale = quantize_codes(wd, self.scheme)
        if self.scheme.is_fp4:
            return _straight(w, deq).to(dtype)
        return (_codes(w, scale, codes.float()) * scale).to(dtype)

    def dequantized_input(self, p: int, x: torch.Tensor) -> torch.Tensor:
        """The routed tokens ``x`` ``(S, in)`` quantize-dequantized as ``QuantExperts`` does, straight-through."""
        fmt = self.scheme.act_format
        if fmt is None:
            return x
        if self.scheme.act_strategy == "nvfp4":
            with torch.no_grad():
                xd = nvfp4_fake_quant(x.detach(), self.input_scale(p))
            return _straight(x, xd)
        with torch.no_grad():
            codes, s = self.quantize_input(p, x.detach())
        qmax = fmt.max if self.scheme.act_strategy == "tensor" else None
        return _codes(x, s.reshape(-1, 1), codes.float(), qmax) * s.reshape(-1, 1)

    def project(self, p: int, x: torch.Tensor, offs: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        del group_ids  # the straight-through GEMM needs only the experts' row ends
        return _GroupedMatmulTrain.apply(self.dequantized_input(p, x.float()), self.dequantized_weight(p), offs)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, scheme={self.scheme.name}, trainable"


def qat_experts(model: nn.Module) -> dict[str, QATExperts]:
    """The ``QATExperts`` modules of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QATExperts)}


def install_qat_experts(module: nn.Module, scheme: Scheme, input_amax: tuple[float, float] | None) -> QATExperts:
    """Make the experts module ``module`` a ``QATExperts`` of ``scheme`` in place (module doc);
    ``input_amax`` ``(gate_up, down)``: the calibrated static input amaxes (static schemes)."""
    if scheme.static_activations and input_amax is None:
        raise ValueError(f"scheme {scheme.name!r} needs calibrated input amaxes for the experts (run a forward_loop)")
    projections = experts_projections(module)
    swap_class(module, QATExperts, "QAT", experts_base_class(module))
    module.scheme, module.projections = scheme, projections
    device = getattr(module, projections[1]).device
    if scheme.static_activations:
        for proj, amax in zip(projections, input_amax, strict=True):
            module.register_buffer(f"{proj}_input_amax", torch.tensor([float(amax)], device=device))
    dispatch_quant_experts(module)
    return module


@torch.no_grad()
def fp4_grid(module: QuantExperts) -> dict[str, torch.Tensor]:
    """The FP4 block grid of a PTQ experts module, for ``fix_fp4_grid``: per projection P, ``P_weight_scale``,
    NVFP4's ``P_weight_scale_2`` and ``P_scale_inv``, the float32 block multipliers ``(E, out, in / block)``."""
    if not module.scheme.is_fp4:
        raise ValueError(f"fp4_grid takes FP4 experts; these are {module.scheme.name}")
    grid = {}
    for p, proj in enumerate(module.projections):
        e, out = module.weight_codes(p).shape[:2]
        grid[f"{proj}_scale_inv"] = module.grouped_fp4_weight(p).scale_inv.float().reshape(e, out, -1).clone()
        grid[f"{proj}_weight_scale"] = module.weight_scale(p).clone()
        if module.weight_scale_2(p) is not None:
            grid[f"{proj}_weight_scale_2"] = module.weight_scale_2(p).clone()
    return grid


@torch.no_grad()
def fix_fp4_grid(module: QATExperts, grid: dict[str, torch.Tensor]) -> None:
    """Round ``module``'s FP4 master weights on ``grid`` (``fp4_grid`` of the PTQ module they came from) from
    now on, as ``QATLinear.fix_fp4_scales`` does for a dense layer: GPTQ leaves some blocks without their
    largest code, and scales recomputed from the dequantized weights would move their codes."""
    for proj in module.projections:
        inv, weight = grid[f"{proj}_scale_inv"], getattr(module, proj)
        experts, out = weight.shape[0], weight.shape[2 if module.is_transposed else 1]
        if tuple(inv.shape[:2]) != (experts, out):
            raise ValueError(f"fix_fp4_grid: {proj}'s grid {tuple(inv.shape)} does not match its experts' weights")
        for key in _GRID_KEYS:
            if f"{proj}_{key}" in grid:
                module.register_buffer(f"{proj}_fixed_{key}", grid[f"{proj}_{key}"].to(weight.device))


@torch.no_grad()
def frozen_experts(module: QATExperts) -> nn.Module:
    """Turn ``module`` into the ``QuantExperts`` PTQ makes of its current master weights and input amaxes, in
    place; on a fixed grid (``fix_fp4_grid``), the master weights' codes on it with its scales."""
    scheme = module.scheme
    amax = None
    if scheme.static_activations:
        amax = tuple(float(getattr(module, f"{proj}_input_amax")) for proj in module.projections)
    fixed: dict[str, torch.Tensor] = {}
    for p, proj in enumerate(module.projections):
        if module.fixed_scale_inv(p) is not None:
            values = module.on_fixed_grid(p, module.master_weight(p).detach(), codes=True)
            fixed[proj] = pack_fp4(e2m1_encode(values)).contiguous()
            for key in ("weight_scale", "weight_scale_2"):
                t = module._buffers.get(f"{proj}_fixed_{key}")
                if t is not None:
                    fixed[f"{proj}_{key}"] = t
    for proj in module.projections:
        for key in ("input_amax", *(f"fixed_{k}" for k in _GRID_KEYS)):
            module._buffers.pop(f"{proj}_{key}", None)
    for key in ("scheme", "projections"):
        module.__dict__.pop(key, None)
    module.__class__ = type(module).__bases__[1]
    frozen = quantize_experts_module(module, scheme, amax)
    for key, t in fixed.items():
        frozen._buffers[key] = t.to(frozen._buffers[key].device)
    return frozen
