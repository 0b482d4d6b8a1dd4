"""``prepare`` puts a PTQ scheme's quantizers into a model for training; ``convert`` freezes it into PTQ's modules.

``prepare`` picks the layers ``ptq.quantize`` picks (every ``nn.Linear`` but the output head and, for FP4,
layers whose input dim is not a whole number of blocks; or ``module_filter``'s), calibrates the static
activation scales the way it does (``ptq.calibrate.observe_inputs`` and ``choose_amax`` over
``forward_loop``, the same options checked by ``PTQOptions``) and swaps each layer for a ``QATLinear``
holding the same weight and bias parameters. At that point the model computes what round-to-nearest PTQ
of the scheme computes on ``QuantLinear``'s reference path. MoE experts modules (those ``ptq.quantize``
picks) become ``qat.experts.QATExperts`` in place, with the experts' shared static input scales calibrated
as PTQ calibrates them (``ptq.experts.observe_experts``); they train with straight-through gradients too.

``from_ptq`` starts training from a model ``ptq.quantize`` made instead (GPTQ, AWQ and the calibrated scales
kept): each ``QuantLinear`` becomes a ``QATLinear`` whose master weight is the layer's dequantized weight and whose
static input amax is the one PTQ calibrated. 8-bit weights re-quantize to their codes wherever the tensor's (or
channel's) largest code is the format's largest, so the model starts within float rounding of the PTQ model. FP4
layers keep PTQ's block scales and per-tensor weight scale (``QATLinear.fix_fp4_scales``), since GPTQ leaves some
blocks without their largest code and scales recomputed from the dequantized weight would round those blocks
afresh: the model starts at the PTQ model's logits and ``convert`` gives back its codes until training moves them.
Given the float ``reference`` model, each FP4 master weight is the reference's weight where that rounds to PTQ's
code, else the code's value (same forward; a weight sitting on its grid point needs a step of half the grid
spacing to change code, a float weight may sit anywhere in its interval). Its ``QuantExperts`` become
``QATExperts`` (``ptq.experts.dequantize_experts_module``, PTQ's input scales kept; their FP4 block scales are
recomputed from the dequantized weights).

``convert`` swaps each ``QATLinear`` for the ``QuantLinear`` that ``QuantLinear.from_linear`` makes of its
current master weight, calibrated (or learned) input amax and shared NVFP4 weight scale (learned weight
clipping values: the codes and scales they give), and stores the ``ptq_report`` the exports read, so
``fp8kit.export.save_pretrained`` writes the result in any format the scheme goes with; each ``QATExperts``
becomes the ``QuantExperts`` PTQ makes of its current master weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn

from ..nn.convert import is_output_head
from ..numerics.scaling import NVFP4_TENSOR_MAX, compute_scale, dequant_scale, parse_granularity
from ..numerics.tensor import quantize as fp8_quantize
from ..ptq.calibrate import choose_amax, observe_inputs
from ..ptq.experts import QuantExperts, dequantize_experts_module, find_experts, fp4_experts_problem, observe_experts
from ..ptq.layer_error import swap_submodule
from ..ptq.linear import QuantLinear
from ..ptq.quantize import PTQOptions
from ..ptq.report import PTQReport
from ..ptq.schemes import Scheme, get_scheme
from ..ptq.smoothquant import SmoothMapping, find_mappings, fold_scales
from .experts import fix_fp4_grid, fp4_grid, frozen_experts, install_qat_experts, qat_experts
from .fakequant import _e2m1_round
from .linear import QATLinear

__all__ = ["convert", "from_ptq", "prepare", "qat_layers"]


def qat_layers(model: nn.Module) -> dict[str, QATLinear]:
    """The ``QATLinear`` layers of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, QATLinear)}


def _misfit(scheme: Scheme, module: nn.Module) -> str | None:
    """Why an FP4 scheme leaves ``module`` in high precision (its input dim is not a whole number of blocks)."""
    if not scheme.is_fp4:
        return None
    block = parse_granularity(scheme.weight_granularity).block_shape(1, module.in_features)[1]
    if module.in_features % block:
        return f"in_features {module.in_features} is not a multiple of {scheme.name}'s {block}-element blocks"
    return None


def _targets(model: nn.Module, scheme: Scheme, module_filter, report: PTQReport) -> tuple[list[str], list[str]]:
    """The ``nn.Linear`` layers and the MoE experts modules to train quantized (the rest in ``report.skipped``)."""
    head = is_output_head(model)
    targets = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if module_filter is not None:
            reason = None if module_filter(name, module) else "excluded by module_filter"
        else:
            reason = (
                "output head (kept in high precision, as ModelOpt and llm-compressor do)"
                if head(name, module)
                else None
            )
        reason = reason or _misfit(scheme, module)
        if reason:
            report.skipped[name] = reason
        else:
            targets.append(name)
    experts = []
    for name, module in find_experts(model).items():
        reason = None if module_filter is None or module_filter(name, module) else "excluded by module_filter"
        reason = reason or fp4_experts_problem(module, scheme)
        if reason:
            report.skipped[name] = reason
        else:
            experts.append(name)
    if not targets and not experts:
        raise ValueError(
            "no nn.Linear layer to train quantized"
            + (" (the module_filter matched none)" if module_filter else " in this model")
        )
    return targets, experts


def _share_nvfp4_weight_scales(model: nn.Module, scheme: Scheme, layers: dict[str, QATLinear]) -> None:
    """NVFP4: the layers that read one input (q/k/v, gate/up) share one per-tensor weight scale, as in PTQ."""
    if scheme.weight_strategy != "nvfp4":
        return
    for mapping in find_mappings(model, set(layers)):
        if len(mapping.targets) > 1:
            group = tuple(layers[t] for t in mapping.targets)
            for m in group:
                m._group = group


def prepare(
    model: nn.Module,
    scheme: Scheme | str,
    forward_loop: Callable[[nn.Module], object] | None = None,
    *,
    calibration: str = "max",
    percentile: float = 99.99,
    learn_scales: bool = False,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Swap ``model``'s quantizable ``nn.Linear`` layers for ``QATLinear`` layers of ``scheme`` in place;
    returns the model.

    Args:
        scheme: any PTQ scheme (``fp8``, ``fp8-dynamic``, ``int8-smoothquant`` without its SmoothQuant folds,
            ``int8-weight-only``, ``nvfp4``, ``nvfp4-weight-only``, ``mxfp4-weight-only``).
        forward_loop: ``forward_loop(model)`` runs calibration batches (as ``ptq.quantize``); required by the
            schemes with static activation scales (``fp8``, ``int8-smoothquant``, ``nvfp4``).
        calibration, percentile: the static scales' method (``ptq.calibrate.choose_amax``).
        learn_scales: train the 8-bit weight scales and static activation scales (``QATLinear``).
        module_filter: ``(name, module) -> bool`` chooses the layers (replaces the default, which keeps the
            output head in high precision).
    """
    scheme = get_scheme(scheme)
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare() takes an nn.Module, got {type(model).__name__}")
    PTQOptions(calibration, percentile).check(scheme)
    if learn_scales and scheme.is_fp4:
        raise ValueError(
            f"learn_scales trains 8-bit weight scales and static per-tensor activation scales; {scheme.name}'s "
            "block scales follow the weights at every step: prepare without learn_scales"
        )
    report = PTQReport(scheme.name, calibration=calibration if scheme.static_activations else None)
    targets, experts = _targets(model, scheme, module_filter, report)
    amax: dict[str, float] = {}
    expert_amax: dict[str, tuple[float, float]] = {}
    if scheme.static_activations:
        if forward_loop is None:
            raise ValueError(
                f"scheme {scheme.name!r} has static activation scales: pass "
                "forward_loop=lambda m: [m(x) for x in calibration_batches]"
            )
        was_training = model.training
        model.eval()
        try:
            with observe_experts(model, experts) as expert_observers:
                observers = observe_inputs(model, targets, forward_loop)
        finally:
            model.train(was_training)
        amax = {n: choose_amax(observers[n], scheme.act_format, calibration, percentile) for n in targets}
        expert_amax = {n: o.amax(scheme.act_format, calibration, percentile) for n, o in expert_observers.items()}
    layers = {}
    for name in targets:
        layers[name] = QATLinear(model.get_submodule(name), scheme, amax.get(name), learn_scales, name)
        swap_submodule(model, name, layers[name])
    _share_nvfp4_weight_scales(model, scheme, layers)
    for name in experts:
        install_qat_experts(model.get_submodule(name), scheme, expert_amax.get(name))
    report.input_amax = dict(amax)
    report.experts = list(experts)
    object.__setattr__(model, "qat_report", report)
    return model


def _input_amax(layer: QuantLinear, calibrated: float | None) -> float | None:
    """The static input amax a PTQ layer was made with: the report's calibrated value, else the stored scale's."""
    if layer.input_scale is None:
        return None
    if calibrated is not None:
        return float(calibrated)
    return layer.input_amax()


def _inside_codes(deq: torch.Tensor, ref: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The master weights for PTQ's FP4 codes ``deq`` on the fixed grid ``scale_inv`` (per block): ``ref``'s
    value where it rounds to the same code, the code's value where it does not (a weight GPTQ moved to
    another code stays at that code's centre rather than at the edge of its interval)."""
    out, cols = deq.shape
    m = scale_inv.float().unsqueeze(-1)
    r = ref.float().reshape(out, m.shape[1], -1)
    same = _e2m1_round(r / m) == _e2m1_round(deq.float().reshape(r.shape) / m)  # deq / m is a code up to an ulp
    return torch.where(same, r, deq.float().reshape(r.shape)).reshape(out, cols)


@torch.no_grad()
def from_ptq(model: nn.Module, learn_scales: bool = False, reference: nn.Module | None = None) -> nn.Module:
    """Swap the ``QuantLinear`` layers of a model ``fp8kit.ptq.quantize`` made for ``QATLinear`` layers of the
    same scheme in place (module doc); returns the model, ready for ``distill`` and ``convert``.

    ``reference``: the float model PTQ started from (FP4 schemes): each master weight is then the
    reference's weight where it rounds to PTQ's code (the forward unchanged), else the code's value. When
    PTQ folded SmoothQuant factors (``ptq_report.smooth_folds``), a copy of the reference gets the same folds
    first, so it is compared with the weights PTQ rounded."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"from_ptq() takes an nn.Module, got {type(model).__name__}")
    found = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    if not found and not experts:
        raise ValueError(
            "from_ptq() takes a model quantized by fp8kit.ptq.quantize (it holds no QuantLinear layer); "
            "for a float model use fp8kit.qat.prepare(model, scheme, forward_loop)"
        )
    schemes = {m.scheme.name for m in [*found.values(), *experts.values()]}
    if len(schemes) > 1:
        raise ValueError(f"from_ptq() trains one scheme; this model mixes {sorted(schemes)} (a mixed-precision plan)")
    ptq_report = getattr(model, "ptq_report", None)
    calibrated = dict(ptq_report.input_amax) if ptq_report is not None else {}
    scheme = next(iter([*found.values(), *experts.values()])).scheme
    if reference is not None and not scheme.is_fp4:
        raise ValueError(f"from_ptq(reference=...) places master weights on FP4 grids; {scheme.name} is not FP4")
    if reference is not None and ptq_report is not None and ptq_report.smooth_folds:
        reference = _smoothed(reference, ptq_report.smooth_folds)
    layers = {}
    for name, q in found.items():
        linear = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None, device=q.weight.device)
        linear.weight.copy_(q.dequantized_weight(torch.float32))
        if q.bias is not None:
            linear.bias.copy_(q.bias.float())
        layer = QATLinear(linear, scheme, _input_amax(q, calibrated.get(name)), learn_scales, name)
        if scheme.is_fp4:  # PTQ's (GPTQ's) block scales stay: the dequantized weight rounds back to its codes
            qt = q.fp4_weight()
            layer.fix_fp4_scales(qt)
            if reference is not None:
                ref = reference.get_submodule(name).weight
                if tuple(ref.shape) != tuple(linear.weight.shape):
                    raise ValueError(
                        f"from_ptq: reference layer {name} has shape {tuple(ref.shape)}, not {tuple(linear.weight.shape)}"
                    )
                linear.weight.copy_(_inside_codes(linear.weight, ref.to(linear.weight.device), layer.fp4_scale_inv))
        layers[name] = layer
        swap_submodule(model, name, layer)
    _share_nvfp4_weight_scales(model, scheme, layers)
    for name, module in experts.items():
        amax = None
        if scheme.static_activations:
            top = NVFP4_TENSOR_MAX if scheme.act_strategy == "nvfp4" else scheme.act_format.max
            amax = tuple(float(module.input_scale(p).float().reshape(())) * top for p in range(2))
        grid = fp4_grid(module) if scheme.is_fp4 else None  # PTQ's (GPTQ's) block scales stay, as above
        trained = install_qat_experts(dequantize_experts_module(module), scheme, amax)
        if grid is not None:
            fix_fp4_grid(trained, grid)
            if reference is not None:
                _experts_inside_codes(trained, reference.get_submodule(name), name)
    report = PTQReport(scheme.name, calibration=ptq_report.calibration if ptq_report is not None else None)
    if ptq_report is not None:
        report.skipped = dict(ptq_report.skipped)
    report.input_amax = {n: float(m.input_amax.detach()) for n, m in layers.items() if m.input_amax is not None}
    report.experts = list(experts)
    model.__dict__.pop("ptq_report", None)
    object.__setattr__(model, "qat_report", report)
    return model


@torch.no_grad()
def _smoothed(reference: nn.Module, folds: list[tuple[SmoothMapping, torch.Tensor]]) -> nn.Module:
    """A copy of ``reference`` with PTQ's SmoothQuant ``folds`` (``(mapping, factors)``) applied in order."""
    out = copy.deepcopy(reference)
    for mapping, factors in folds:
        fold_scales(out, mapping, factors.to(next(out.parameters()).device))
    return out


@torch.no_grad()
def _experts_inside_codes(module: nn.Module, reference: nn.Module, name: str) -> None:
    """``from_ptq(reference=)`` for FP4 experts on a fixed grid: each master weight the reference's where it
    rounds to the same code, else the code's value (``_inside_codes`` per expert)."""
    for p, proj in enumerate(module.projections):
        w, inv = module.master_weight(p).detach(), module.fixed_scale_inv(p)
        ref = getattr(reference, proj, None)
        if ref is None or ref.numel() != w.numel():
            raise ValueError(f"from_ptq: reference experts {name}.{proj} do not match the quantized ones")
        ref = ref.detach().float().to(w.device)
        ref = ref.transpose(1, 2) if reference.is_transposed else ref
        e, out, cols = w.shape
        new = _inside_codes(w.reshape(e * out, cols), ref.reshape(e * out, cols), inv.reshape(e * out, -1))
        new = new.reshape(e, out, cols)
        getattr(module, proj).copy_(new.transpose(1, 2) if module.is_transposed else new)


@torch.no_grad()
def _frozen(layer: QATLinear) -> QuantLinear:
    """The ``QuantLinear`` PTQ makes of ``layer``'s current weight and scales."""
    input_amax = None if layer.input_amax is None else float(layer.input_amax.detach())
    q = QuantLinear.from_linear(layer, layer.scheme, input_amax, layer.weight_global_scale())  # type: ignore[arg-type]
    if layer.fp4_scales is not None:  # the fixed grid's codes and scales
        q.set_fp4_weight(layer.fp4_weight())
    if layer.weight_amax is not None:  # learned clipping values: their codes and scales
        fmt, amax = layer.scheme.weight_format, layer.weight_amax.detach().float()
        gran = "row" if layer.scheme.weight_strategy == "channel" else "tensor"
        mult = compute_scale(amax, fmt)
        qt = fp8_quantize(
            layer.weight.detach().float(), fmt, gran, scale=mult.reshape(-1, 1) if gran == "row" else mult
        )
        q.weight = qt.data.contiguous()
        q.weight_scale = dequant_scale(amax, fmt).reshape(q.weight_scale.shape).contiguous()
    return q.to(layer.weight.device)


def convert(model: nn.Module) -> nn.Module:
    """Freeze a ``prepare``d model into PTQ's inference modules in place (module doc); returns it."""
    layers, experts = qat_layers(model), qat_experts(model)
    if not layers and not experts:
        raise ValueError("convert() takes a model made by fp8kit.qat.prepare (it holds no QATLinear layer)")
    base = getattr(model, "qat_report", None)
    scheme = next(iter([*layers.values(), *experts.values()])).scheme.name
    report = PTQReport(scheme, calibration=base.calibration if base is not None else None)
    if base is not None:
        report.skipped = dict(base.skipped)
    for name, layer in layers.items():
        swap_submodule(model, name, _frozen(layer))
        report.quantized.append(name)
        if layer.input_amax is not None:
            report.input_amax[name] = float(layer.input_amax.detach())
    for name, module in experts.items():
        amaxes = [getattr(module, f"{proj}_input_amax", None) for proj in module.projections]
        frozen = frozen_experts(module)
        report.experts.append(name)
        for proj, amax in zip(frozen.projections, amaxes, strict=True):
            if amax is not None:
                report.input_amax[f"{name}.{proj}"] = float(amax)
    model.__dict__.pop("qat_report", None)
    object.__setattr__(model, "ptq_report", report)
    return model
