"""``quantize(model, "auto", forward_loop, budget=BITS)``: a PTQ scheme per layer for an effective-bits budget.

ModelOpt's ``auto_quantize`` design on fp8kit's pieces: every candidate scheme's quantized copy of every
plannable unit (an ``nn.Linear``, or a MoE experts module as one unit, quantized as uniform PTQ quantizes
it: ``ptq.experts``), calibrated on ``forward_loop`` and rounded to nearest, is scored in one pass with
gradients by the Fisher estimate of the loss increase at that unit's output (``layer_error.fisher_per_token``,
the rule ``keep_bf16`` ranks by); ``planner.bits.plan_bits`` picks the scheme per unit (or BF16) with the
least summed prediction whose mean effective bits, weighted by weight count (all experts of a module
counted), fit ``budget``. The layers that read one input (q/k/v, gate/up) take one scheme together: vLLM fuses
them into one GEMM, and ModelOpt groups them the same way. The chosen units are swapped in (GPTQ-rounded with
``gptq``); MoE routers stay in high precision, as in uniform PTQ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from ..planner.bits import BF16, EFFECTIVE_BITS, plan_bits
from .calibrate import choose_amax, observe_inputs
from .experts import (
    dispatch_quant_experts,
    experts_projections,
    fp4_experts_problem,
    observe_experts,
    quant_experts_forward,
    quantize_experts_module,
)
from .layer_error import fisher_per_token
from .linear import QuantLinear
from .progress import Progress
from .report import PTQReport
from .schemes import PTQ_SCHEMES, get_scheme
from .smoothquant import find_mappings

if TYPE_CHECKING:
    from .quantize import _Run

__all__ = ["AUTO_CANDIDATES", "quantize_auto"]

# every PTQ scheme that quantizes one layer on its own (SmoothQuant's folds change a whole group of layers)
AUTO_CANDIDATES = (BF16, "fp8", "fp8-dynamic", "int8-weight-only", "nvfp4", "nvfp4-weight-only", "mxfp4-weight-only")


def _candidates(candidates: Sequence[str] | None) -> list[str]:
    names = [c.strip().lower() for c in (AUTO_CANDIDATES if candidates is None else candidates)]
    for c in names:
        if c == "int8-smoothquant":
            raise ValueError(
                "auto plans each layer on its own, and int8-smoothquant's folds rescale whole groups of layers: "
                f"use the other candidates ({', '.join(AUTO_CANDIDATES)})"
            )
        if c not in AUTO_CANDIDATES:
            raise ValueError(f"unknown auto candidate {c!r}; accepted: {', '.join(AUTO_CANDIDATES)}")
    if not [c for c in names if c != BF16]:
        raise ValueError(f"auto needs at least one quantized candidate among {', '.join(AUTO_CANDIDATES[1:])}")
    return list(dict.fromkeys([BF16, *names]))  # BF16 always: it is ModelOpt's "do not quantize" choice


class _ExpertsVariant(nn.Module):
    """A quantized copy of an experts module (a ``QuantExperts`` whose config was left as it is), called
    through the ``"fp8kit_ptq"`` forward as the model calls it once installed: the module auto scores."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return quant_experts_forward(self.experts, *args, **kwargs)


def quantize_auto(
    model: nn.Module,
    forward_loop: Callable[[nn.Module], object] | None,
    *,
    budget: float | None = None,
    candidates: Sequence[str] | None = None,
    calibration: str = "max",
    percentile: float = 99.99,
    gptq: bool = False,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    progress: bool | None = None,
    **other: Any,
) -> nn.Module:
    """Quantize ``model`` in place, each layer (``nn.Linear``, or MoE experts module as one unit) with the
    candidate (default ``AUTO_CANDIDATES``, BF16 always among them) that the plan gives it, and return it:
    the plan (``planner.bits.BitsPlan``) has the least summed Fisher-predicted loss increase (nats/token)
    whose mean effective bits per weight fit ``budget`` (``planner.bits.EFFECTIVE_BITS``, ModelOpt's
    counting), and is ``model.ptq_report.plan``; ``ptq_report.schemes`` names each quantized unit's scheme
    (``ptq_report.experts`` lists the quantized experts modules). Static activation scales are calibrated on
    ``forward_loop`` (``calibration``, ``percentile``; experts as uniform PTQ calibrates them, every token
    through every expert) and the predictions made with round-to-nearest weights; ``gptq`` rounds the chosen
    units with GPTQ. ``module_filter`` and ``progress`` as in ``ptq.quantize``; other ``ptq.quantize``
    options (SmoothQuant, AWQ, FP8 KV cache, keep_bf16, norm tweaking) are refused."""
    from .quantize import PTQOptions, _fp4_misfit, _Run, _select_layers, shared_weight_scales

    if other:
        raise ValueError(f"scheme 'auto' plans the layers' schemes and bits alone: drop {', '.join(other)}")
    if budget is None:
        raise ValueError("scheme 'auto' needs budget=BITS (mean effective bits per weight, e.g. 8 or 6)")
    if not 0 < budget <= 16:
        raise ValueError(f"budget is the mean effective bits per weight, in (0, 16] (e.g. 8 or 6), got {budget}")
    if forward_loop is None:
        raise ValueError("scheme 'auto' scores the layers on data: pass forward_loop=lambda m: [m(x) for x in batches]")
    names = _candidates(candidates)
    schemes = [get_scheme(c) for c in names if c != BF16]
    opts = PTQOptions(calibration=calibration, percentile=percentile, module_filter=module_filter, gptq=gptq)
    for s in schemes:
        opts.check(s)
    report = PTQReport("auto", calibration=calibration)
    bars = Progress(progress, getattr(forward_loop, "batches", None))  # the calibration loop's batches, if it says
    run = _Run(model, PTQ_SCHEMES["fp8"], forward_loop, opts, report, bars, calibrating=True)
    _select_layers(run)
    experts = set(run.experts)
    planned = experts.union(run.targets)
    units = [n for n, _ in model.named_modules() if n in planned]  # in module order
    run.progress.say(
        f"fp8kit.ptq auto on {len(run.targets)} Linear layers"
        + (f" and {len(run.experts)} MoE experts modules" if run.experts else "")
        + f", candidates {', '.join(names)}, budget {budget:g} bits: "
        "calibrate (1 pass) -> score every candidate (1 pass with gradients)"
        + (" -> GPTQ Hessians (1 pass)" if gptq else "")
        + " -> plan -> swap in"
    )
    was_training = model.training
    model.eval()
    try:
        with (
            run.progress.phase("calibrate", run.progress.batches, model=model, timed_pass=True),
            observe_experts(model, run.experts) as expert_observers,
        ):
            observers = observe_inputs(model, run.targets, forward_loop)
        report.expert_tokens = {n: o.tokens.tolist() for n, o in expert_observers.items()}
        variants: dict[str, dict[str, nn.Module]] = {n: {} for n in units}
        amax: dict[tuple[str, str], Any] = {}  # Linear: the input amax; experts: (gate_up, down) input amaxes
        for s in schemes:
            shared = shared_weight_scales(model, s, run.targets)
            for n in run.targets:
                linear = model.get_submodule(n)
                if _fp4_misfit(s, linear):
                    continue
                a = choose_amax(observers[n], s.act_format, calibration, percentile) if s.static_activations else None
                amax[(n, s.name)] = a
                variants[n][s.name] = QuantLinear.from_linear(linear, s, a, shared.get(n))
            for n in run.experts:
                module = model.get_submodule(n)
                if fp4_experts_problem(module, s):
                    continue
                a = expert_observers[n].amax(s.act_format, calibration, percentile) if s.static_activations else None
                amax[(n, s.name)] = a
                q = quantize_experts_module(module, s, a, n, copy=True, dispatch=False)
                variants[n][s.name] = _ExpertsVariant(q)
        with run.progress.phase("score", run.progress.batches, model=model):
            predicted = fisher_per_token(model, variants, forward_loop)
        if predicted is None:
            raise ValueError(
                "auto scores layers by the next-token loss: the model must be a causal LM with input embeddings "
                "called as model(input_ids=...) by forward_loop"
            )
        params = {n: _weight_count(model.get_submodule(n), n in experts) for n in units}
        fused = [m.targets for m in find_mappings(model, set(run.targets)) if len(m.targets) > 1]
        plan = plan_bits(predicted, params, budget, groups=fused)
        chosen = {n: c for n, c in plan.per_layer.items() if c != BF16}
        if gptq and chosen:
            _gptq_chosen(model, chosen, experts, variants, amax, run)
            report.gptq = True
        for n, c in plan.per_layer.items():
            if c == BF16:
                report.skipped[n] = f"kept in high precision by the auto plan ({EFFECTIVE_BITS[BF16]:g} bits)"
                continue
            q = variants[n][c]
            if n in experts:
                q = q.experts
                dispatch_quant_experts(q)
                report.experts.append(n)
                if amax.get((n, c)) is not None:
                    report.input_amax.update(
                        {f"{n}.{p}": float(a) for p, a in zip(q.projections, amax[(n, c)], strict=True)}
                    )
            else:
                report.quantized.append(n)
                if amax.get((n, c)) is not None:
                    report.input_amax[n] = amax[(n, c)]
            parent, _, attr = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, q)
            report.schemes[n] = c
    finally:
        model.train(was_training)
    used = set(report.schemes.values())
    report.scheme = used.pop() if len(used) == 1 else "auto"  # one scheme (and BF16) exports as that scheme
    report.plan = plan
    object.__setattr__(model, "ptq_report", report)
    return model


def _weight_count(module: nn.Module, is_experts: bool) -> int:
    """The weights the bits budget counts: a Linear's ``weight``, all experts of both projections of an
    experts module (biases, as a Linear's, uncounted)."""
    if is_experts:
        return sum(getattr(module, p).numel() for p in experts_projections(module))
    return module.weight.numel()


def _gptq_chosen(
    model: nn.Module,
    chosen: dict[str, str],
    experts: set[str],
    variants: dict[str, dict[str, nn.Module]],
    amax: dict[tuple[str, str], Any],
    run: _Run,
) -> None:
    """Replace the chosen variants by GPTQ-rounded ones: Hessians of the chosen Linear layers and experts
    modules in one pass over ``forward_loop``, the same scales and activation amaxes as the scored variants."""
    from .experts import collect_expert_hessians
    from .gptq import collect_hessians, gptq_linear
    from .quantize import shared_weight_scales

    linears = [n for n in chosen if n not in experts]
    with (
        run.progress.phase("GPTQ Hessians", run.progress.batches, model=model, timed_pass=True),
        collect_expert_hessians(model, [n for n in chosen if n in experts]) as expert_hessians,
    ):
        hessians = collect_hessians(model, linears, run.forward_loop)
    scales = {c: shared_weight_scales(model, get_scheme(c), run.targets) for c in set(chosen.values())}
    for n, c in chosen.items():
        module = model.get_submodule(n)
        if n in experts:
            h = expert_hessians[n].hessians()
            q = quantize_experts_module(module, c, amax.get((n, c)), n, copy=True, hessians=h, dispatch=False)
            variants[n][c] = _ExpertsVariant(q)
        else:
            variants[n][c] = gptq_linear(
                module, hessians.pop(n), c, amax.get((n, c)), weight_global_scale=scales[c].get(n)
            )
