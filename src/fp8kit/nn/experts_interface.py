"""The one dispatcher of fp8kit's MoE experts forwards through ``transformers``' ``ExpertsInterface``.

Since transformers 5 an experts module's forward is looked up by name in
``transformers.integrations.moe.ExpertsInterface`` from ``config._experts_implementation`` (``"eager"``,
``"grouped_mm"``, ...). fp8kit registers its forwards there by name: ``"fp8kit"``
(``fp8kit.nn.experts.fp8_experts_forward``, the FP8 training experts) and ``"fp8kit_ptq"``
(``fp8kit.ptq.experts.quant_experts_forward``, the quantized inference experts). ``use_implementation``
switches the configs of the experts modules to one of them: one registered function serves every
architecture that uses the registry (Qwen3-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3, ...), with no patch
per model. Each module records the implementation its config named before; an experts module that fp8kit
did not convert (filtered out, or inside ``fp8kit.autocast(enabled=False)``) runs that one
(``fallback_forward``), and ``restore_implementation`` points the config back at it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

__all__ = ["IMPLEMENTATION", "fallback_forward", "register", "restore_implementation", "use_implementation"]

IMPLEMENTATION = "fp8kit"
_RECORDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules holding a ``_fp8kit_fallbacks`` record


def register(name: str, forward: Callable[..., torch.Tensor]) -> None:
    """Register ``forward`` as ``name`` in ``transformers``' ``ExpertsInterface`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, forward)


def _config(module: nn.Module) -> object:
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"{type(module).__name__} has no .config: not an ExpertsInterface experts module")
    return config


def _sharing(module: nn.Module, name: str) -> list[nn.Module]:
    """The modules with a record for ``name`` whose config is ``module``'s."""
    config = getattr(module, "config", None)
    return [m for m in _RECORDED if getattr(m, "config", None) is config and name in m._fp8kit_fallbacks]


def _previous(module: nn.Module, name: str) -> str | None:
    """The implementation ``module``'s config named before ``name``: its record, else a sibling's."""
    own = getattr(module, "_fp8kit_fallbacks", {})
    if name in own:
        return own[name]
    return next((m._fp8kit_fallbacks[name] for m in _sharing(module, name)), None)


def use_implementation(experts: Iterable[nn.Module], name: str, forward: Callable[..., torch.Tensor]) -> None:
    """Register ``forward`` as ``name`` and point the configs of these experts modules at it; each module
    records the implementation its config named before (a config already pointing at ``name`` passes
    on a sibling's record)."""
    register(name, forward)
    for module in list(experts):
        config = _config(module)
        previous = config._experts_implementation
        if previous == name:
            previous = _previous(module, name)
        module.__dict__.setdefault("_fp8kit_fallbacks", {})[name] = previous
        _RECORDED.add(module)
        config._experts_implementation = name


def fallback_forward(module: nn.Module, name: str = IMPLEMENTATION) -> Callable[..., torch.Tensor]:
    """The experts forward of ``module`` under the implementation its config named before ``name``:
    the class's own (eager) forward for ``"eager"``, else the ``ExpertsInterface`` function
    (``"grouped_mm"`` where nothing was recorded)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = getattr(type(module).forward, "__wrapped__", None)
    previous = _previous(module, name)
    if previous in (None, "eager", name):
        if original is not None:
            return original
        previous = "grouped_mm"
    return ALL_EXPERTS_FUNCTIONS.get_interface(previous, original)


def restore_implementation(module: nn.Module, name: str) -> None:
    """Drop ``module``'s record for ``name``; when no module sharing its config holds one, point the config
    back at the implementation it named before (``"grouped_mm"`` if none)."""
    previous = getattr(module, "_fp8kit_fallbacks", {}).pop(name, None)
    config = _config(module)
    if not _sharing(module, name) and config._experts_implementation == name:
        config._experts_implementation = previous or "grouped_mm"
