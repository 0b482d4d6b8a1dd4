"""``quantize(model, "auto", forward_loop, budget=BITS)``: a PTQ scheme per layer for an effective-bits budget.

ModelOpt's ``auto_quantize`` design on fp8kit's pieces: every candidate scheme's quantized copy of every
layer (calibrated on ``forward_loop``, rounded to nearest) is scored in one pass with gradients by the
Fisher estimate of the loss increase (``layer_error.fisher_per_token``, the rule ``keep_bf16`` ranks by),
``planner.bits.plan_bits`` picks the scheme per layer (or BF16) with the least summed prediction whose
mean effective bits fit ``budget`` (the layers that read one input, q/k/v and gate/up, take one scheme
together: vLLM fuses them into one GEMM, and ModelOpt groups them the same way), and the chosen layers are
swapped in (GPTQ-rounded with ``gptq``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from ..planner.bits import BF16, EFFECTIVE_BITS, plan_bits
from .calibrate import choose_amax, observe_inputs
from .layer_error import fisher_per_token
from .linear import QuantLinear
from .progress import Progress
from .report import PTQReport
from .schemes import PTQ_SCHEMES, get_scheme
from .smoothquant import find_mappings

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
    """Quantize ``model`` in place, each layer with the candidate (default ``AUTO_CANDIDATES``, BF16 always
    among them) that the plan gives it, and return it: the plan (``planner.bits.BitsPlan``) has the least
    summed Fisher-predicted loss increase (nats/token) whose mean effective bits per weight fit ``budget``
    (``planner.bits.EFFECTIVE_BITS``, ModelOpt's counting), and is ``model.ptq_report.plan``;
    ``ptq_report.schemes`` names each quantized layer's scheme. Static activation scales are calibrated on
    ``forward_loop`` (``calibration``, ``percentile``) and the predictions made with round-to-nearest weights;
    ``gptq`` rounds the chosen layers with GPTQ. ``module_filter`` and ``progress`` as in ``ptq.quantize``;
    other ``ptq.quantize`` options (SmoothQuant, AWQ, FP8 KV cache, keep_bf16, norm tweaking) are refused."""
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
    run = _Run(model, PTQ_SCHEMES["fp8"], forward_loop, opts, report, Progress(progress), calibrating=True)
    _select_layers(run)
    if run.experts:
        raise ValueError(
            f"auto plans nn.Linear layers, not MoE experts ({', '.join(run.experts)}): keep them in high precision "
            "with module_filter, or quantize with one scheme"
        )
    run.progress.say(
        f"fp8kit.ptq auto on {len(run.targets)} Linear layers, candidates {', '.join(names)}, budget {budget:g} bits: "
        f"calibrate (1 pass) -> score every candidate (1 pass with gradients)"
        + (" -> GPTQ Hessians (1 pass)" if gptq else "")
        + " -> plan -> swap in"
    )
    was_training = model.training
    model.eval()
    try:
        with run.progress.phase("calibrate", run.progress.batches, model=model, timed_pass=True):
            observers = observe_inputs(model, run.targets, forward_loop)
        variants: dict[str, dict[str, nn.Module]] = {n: {} for n in run.targets}
        amax: dict[tuple[str, str], float] = {}
        for s in schemes:
            shared = shared_weight_scales(model, s, run.targets)
            for n in run.targets:
                linear = model.get_submodule(n)
                if _fp4_misfit(s, linear):
                    continue
                a = choose_amax(observers[n], s.act_format, calibration, percentile) if s.static_activations else None
                amax[(n, s.name)] = a
                variants[n][s.name] = QuantLinear.from_linear(linear, s, a, shared.get(n))
        with run.progress.phase("score", run.progress.batches, model=model):
            predicted = fisher_per_token(model, variants, forward_loop)
        if predicted is None:
            raise ValueError(
                "auto scores layers by the next-token loss: the model must be a causal LM with input embeddings "
                "called as model(input_ids=...) by forward_loop"
            )
        params = {n: model.get_submodule(n).weight.numel() for n in run.targets}
        fused = [m.targets for m in find_mappings(model, set(run.targets)) if len(m.targets) > 1]
        plan = plan_bits(predicted, params, budget, groups=fused)
        chosen = {n: c for n, c in plan.per_layer.items() if c != BF16}
        if gptq and chosen:
            from .gptq import collect_hessians, gptq_linear

            with run.progress.phase("GPTQ Hessians", run.progress.batches, model=model, timed_pass=True):
                hessians = collect_hessians(model, list(chosen), forward_loop)
            scales = {c: shared_weight_scales(model, get_scheme(c), run.targets) for c in set(chosen.values())}
            for n, c in chosen.items():
                variants[n][c] = gptq_linear(
                    model.get_submodule(n), hessians.pop(n), c, amax.get((n, c)), weight_global_scale=scales[c].get(n)
                )
            report.gptq = True
        for n, c in plan.per_layer.items():
            if c == BF16:
                report.skipped[n] = f"kept in high precision by the auto plan ({EFFECTIVE_BITS[BF16]:g} bits)"
                continue
            parent, _, attr = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, variants[n][c])
            report.quantized.append(n)
            report.schemes[n] = c
            if amax.get((n, c)) is not None:
                report.input_amax[n] = amax[(n, c)]
    finally:
        model.train(was_training)
    used = set(report.schemes.values())
    report.scheme = used.pop() if len(used) == 1 else "auto"  # one scheme (and BF16) exports as that scheme
    report.plan = plan
    object.__setattr__(model, "ptq_report", report)
    return model
