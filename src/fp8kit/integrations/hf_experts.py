"""``transformers`` MoE experts: fp8kit's FP8 experts as an ``ExpertsInterface`` implementation.

Since transformers 5 an experts module's forward is looked up by name in
``transformers.integrations.moe.ExpertsInterface`` from ``config._experts_implementation`` (``"eager"``,
``"grouped_mm"``, ...). fp8kit registers ``"fp8kit"`` (``fp8kit.nn.experts.fp8_experts_forward``) there,
and ``fp8kit.convert`` switches the converted model's config to it: one registered function serves every
architecture that uses the registry (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3, ...), with no patch
per model. Experts modules that were not converted (filtered out) keep the implementation the config named
before (``module._fp8kit_fallback``), as does every module inside ``fp8kit.autocast(enabled=False)``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

__all__ = ["IMPLEMENTATION", "register", "use_fp8_experts"]

IMPLEMENTATION = "fp8kit"


def register() -> None:
    """Register ``"fp8kit"`` in ``transformers``' ``ExpertsInterface`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    from ..nn.experts import fp8_experts_forward

    ExpertsInterface.register(IMPLEMENTATION, fp8_experts_forward)


def use_fp8_experts(experts: Iterable[nn.Module]) -> None:
    """Point the configs of these experts modules at ``"fp8kit"``, remembering on each module the
    implementation it used before (the fallback for modules left in high precision)."""
    register()
    experts = list(experts)
    for module in experts:
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"{type(module).__name__} has no .config: not an ExpertsInterface experts module")
        previous = config._experts_implementation
        if previous != IMPLEMENTATION:
            for other in _sharing(experts, config):
                other._fp8kit_fallback = previous
            config._experts_implementation = IMPLEMENTATION


def _sharing(experts: Iterable[nn.Module], config: object) -> list[nn.Module]:
    return [m for m in experts if getattr(m, "config", None) is config]
