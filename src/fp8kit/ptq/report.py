"""``PTQReport``: what one ``fp8kit.ptq.quantize`` call did, and its rendering as text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..planner.bits import BitsPlan
    from .layer_error import LayerScore
    from .norm_tweak import NormTweakResult
    from .smoothquant import SmoothMapping

__all__ = ["PTQReport"]


@dataclass
class PTQReport:
    """What ``quantize`` did: the scheme, quantized and skipped layers, calibrated amaxes."""

    scheme: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    smoothed: list[str] = field(default_factory=list)
    smooth_alpha: dict[str, float | None] = field(default_factory=dict)
    # the SmoothQuant folds made, in order: (mapping, factors); ``smoothquant.fold_scales`` repeats one
    smooth_folds: list[tuple[SmoothMapping, torch.Tensor]] = field(default_factory=list)
    kv_cache: bool = False
    calibration: str | None = None
    norm_tweak: NormTweakResult | None = None
    gptq: bool = False
    awq: dict[str, float] = field(default_factory=dict)
    sensitivity: list[LayerScore] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)  # the MoE experts modules quantized (QuantExperts)
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # calibration tokens routed per expert
    schemes: dict[str, str] = field(default_factory=dict)  # scheme "auto": each quantized layer's scheme
    plan: BitsPlan | None = None  # scheme "auto": the per-layer plan

    def __str__(self) -> str:
        lines = [f"fp8kit.ptq ({self.scheme}): quantized {len(self.quantized)} Linear layers"]
        if self.plan is not None:
            lines.append("  " + self.plan.summary())
            lines += [f"  {name}: {scheme}" for name, scheme in self.schemes.items()]
        if self.experts:
            lines.append(
                f"  quantized {len(self.experts)} MoE experts modules (per-expert weight scales"
                + (", every expert calibrated on all tokens)" if self.expert_tokens else ")")
            )
        for name, tokens in self.expert_tokens.items():
            idle = [e for e, t in enumerate(tokens) if t == 0]
            lines.append(
                f"  {name}: calibration tokens routed per expert {tokens}"
                + (f" (never routed: {idle}; calibrated on all tokens)" if idle else "")
            )
        if self.smooth_alpha:
            searched = [a for a in self.smooth_alpha.values() if a is not None]
            detail = (
                f" (alpha searched per group: {min(searched)}-{max(searched)}, "
                f"{len(self.smooth_alpha) - len(searched)} left unsmoothed)"
                if len(set(self.smooth_alpha.values())) > 1 and searched
                else ""
            )
            lines.append(f"  SmoothQuant folded into {len(self.smoothed)} producers{detail}")
        if self.awq:
            lines.append(
                f"  AWQ scales folded into {len(self.awq)} producers"
                + ("; MoE experts rounded to nearest (AWQ covers the Linear layers)" if self.experts else "")
            )
        if self.gptq:
            lines.append(
                "  GPTQ weight rounding (Hessian-aware error compensation)"
                + (", every expert included (Hessians over all calibration tokens)" if self.experts else "")
            )
        if self.kv_cache:
            lines.append("  FP8 KV cache (per-tensor static k/v scales)")
        if self.norm_tweak is not None:
            t = self.norm_tweak
            lines.append(
                f"  norm tweaking: {t.parameters} norm weights, {t.steps} steps at lr {t.lr:g}: calibration "
                f"{t.metric} {t.loss_before:.4g} -> {t.loss_after:.4g}" + (" (no gain: reverted)" if t.reverted else "")
            )
        for name, why in self.skipped.items():
            lines.append(f"  kept {name}: {why}")
        return "\n".join(lines)
