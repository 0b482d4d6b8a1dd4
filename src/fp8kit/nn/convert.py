"""``fp8kit.convert``: swap the eligible ``nn.Linear`` layers of any model for FP8 ones, in place."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn as nn

from ..recipes import DelayedScaling, Recipe
from .linear import Linear

__all__ = ["ConversionReport", "convert", "default_module_filter"]

log = logging.getLogger("fp8kit")
HARDWARE_MULTIPLE = 16  # FP8 tensor-core GEMMs need K and N multiples of 16


@dataclass
class ConversionReport:
    """What ``convert`` did: qualified names converted, and skipped names with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fp8kit.convert: {len(self.converted)} layer(s) converted, {len(self.skipped)} skipped"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def _output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            return get()
        except (NotImplementedError, AttributeError):
            return None
    return None


def is_output_head(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """Predicate ``(name, module) -> bool``: the model's output embeddings, or a layer named ``lm_head``."""
    head = _output_head(model)
    return lambda name, module: module is head or name == "lm_head" or name.endswith(".lm_head")


def default_module_filter(model: nn.Module) -> Callable[[str, nn.Module], str | None]:
    """Reason to skip a layer, or ``None`` to convert it: the output head and FP8-unfriendly shapes."""
    head = is_output_head(model)

    def why_skip(name: str, module: nn.Module) -> str | None:
        if head(name, module):
            return "output head (kept in high precision, as Transformer Engine and torchao do)"
        assert isinstance(module, nn.Linear)
        if module.in_features % HARDWARE_MULTIPLE or module.out_features % HARDWARE_MULTIPLE:
            return (
                f"dims {module.in_features}x{module.out_features} are not multiples of {HARDWARE_MULTIPLE} "
                "(FP8 tensor cores need them)"
            )
        return None

    return why_skip


def convert(
    model: nn.Module,
    recipe: Recipe | None = None,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    *,
    save_fp8_activations: bool = True,
    verbose: bool = False,
) -> nn.Module:
    """Replace eligible ``nn.Linear`` layers of ``model`` with ``fp8kit.nn.Linear`` in place.

    Parameters stay the same objects, so an optimizer built before or after conversion keeps working.
    ``module_filter(name, module) -> bool`` picks layers by qualified name (it replaces the default
    filter, which skips the output head and dims that are not multiples of 16). The report is stored
    as ``model.fp8_conversion_report`` and logged (printed with ``verbose=True``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}")
    recipe = recipe if recipe is not None else DelayedScaling()
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be an fp8kit recipe, got {recipe!r}")
    if type(model) is nn.Linear:
        raise ValueError(
            "convert() replaces layers inside a model, not the model itself: wrap the Linear in "
            "nn.Sequential, or use fp8kit.nn.Linear.from_linear(layer, recipe)"
        )
    report = ConversionReport()
    default = default_module_filter(model)
    targets: list[tuple[str, nn.Linear]] = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if module_filter is not None:
            reason = None if module_filter(name, module) else "excluded by module_filter"
        else:
            reason = default(name, module)
        if reason:
            report.skipped[name] = reason
        else:
            targets.append((name, module))
    for name, module in targets:
        new = Linear.from_linear(module, recipe, name=name, save_fp8_activations=save_fp8_activations)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        report.converted.append(name)
    object.__setattr__(model, "fp8_conversion_report", report)
    (print if verbose else log.info)(str(report))
    return model
