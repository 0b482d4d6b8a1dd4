"""A tiny Llama whose layers mix PTQ schemes, as ``ptq.quantize(..., "auto")`` leaves a model, built directly so
that every per-layer scheme (and BF16) is in it."""

import copy

import torch.nn as nn

# layer i of the tiny Llama (q, k, v, o, gate, up, down; two decoder layers) gets MIX[i % 7]
MIX = ("fp8", "int8-weight-only", "nvfp4-weight-only", "bf16", "fp8-dynamic", "nvfp4", "mxfp4-weight-only")


def mixed_llama(batches, mix: tuple[str, ...] = MIX) -> nn.Module:
    """``tiny_llama()`` with its decoder layers quantized cyclically with the schemes of ``mix`` (``"bf16"``: kept),
    each layer as ``ptq.quantize`` with that scheme alone makes it (calibrated on ``batches``), and the
    ``ptq_report`` of an ``auto`` plan (``scheme "auto"``, ``schemes`` per layer)."""
    from fp8kit import ptq
    from fp8kit.export.common import replace_module
    from fp8kit.ptq.report import PTQReport

    from .models import calib, tiny_llama

    base = tiny_llama()
    one = {s: ptq.quantize(copy.deepcopy(base), s, calib(batches)) for s in dict.fromkeys(mix) if s != "bf16"}
    model = copy.deepcopy(base)
    names = [n for n, m in base.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]
    report = PTQReport("auto" if len(one) > 1 else next(iter(one)))
    for i, name in enumerate(names):
        scheme = mix[i % len(mix)]
        if scheme == "bf16":
            report.skipped[name] = "kept in high precision by the plan"
            continue
        replace_module(model, name, one[scheme].get_submodule(name))
        report.quantized.append(name)
        report.schemes[name] = scheme
        if name in one[scheme].ptq_report.input_amax:
            report.input_amax[name] = one[scheme].ptq_report.input_amax[name]
    report.skipped["lm_head"] = "output head"
    object.__setattr__(model, "ptq_report", report)
    return model
