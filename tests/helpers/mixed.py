"""A tiny Llama whose layers mix PTQ schemes, as ``ptq.quantize(..., "auto")`` leaves a model, built directly so
that every per-layer scheme (and BF16) is in it."""

import copy

import torch.nn as nn

# the fused groups of a tiny Llama decoder layer (q/k/v and gate/up share their input: vLLM fuses them into one
# linear and ModelOpt's export requantizes them together, so each needs one scheme), in layer order
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
# group i of the tiny Llama (four per decoder layer, two decoder layers) gets MIX[i % 7]
MIX = ("fp8", "int8-weight-only", "nvfp4-weight-only", "bf16", "fp8-dynamic", "nvfp4", "mxfp4-weight-only")


def mixed_llama(batches, mix: tuple[str, ...] = MIX) -> nn.Module:
    """``tiny_llama()`` with its decoder layers' fused groups (``GROUPS``) quantized cyclically with the schemes of
    ``mix`` (``"bf16"``: kept), each layer as ``ptq.quantize`` with that scheme alone makes it (calibrated on
    ``batches``), and the ``ptq_report`` of an ``auto`` plan (``scheme "auto"``, ``schemes`` per layer)."""
    from fp8kit import ptq
    from fp8kit.export.common import replace_module
    from fp8kit.ptq.report import PTQReport

    from .models import calib, tiny_llama

    base = tiny_llama()
    one = {s: ptq.quantize(copy.deepcopy(base), s, calib(batches)) for s in dict.fromkeys(mix) if s != "bf16"}
    model = copy.deepcopy(base)
    report = PTQReport("auto" if len(one) > 1 else next(iter(one)))
    blocks = [f"model.layers.{i}" for i in range(len(base.model.layers))]
    groups = [[f"{b}.{'self_attn' if g[0][0] in 'qkvo' else 'mlp'}.{p}" for p in g] for b in blocks for g in GROUPS]
    for i, group in enumerate(groups):
        scheme = mix[i % len(mix)]
        for name in group:
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
