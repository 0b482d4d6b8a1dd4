"""``fp8kit.convert``: turn the eligible linear layers of any model into FP8 ones, in place.

Linear layers are ``nn.Linear``, its subclasses that keep ``nn.Linear.forward``, and ``transformers``'
``Conv1D`` (GPT-2's, weight stored ``(in, out)``; ``nn.linear_like``). Each is converted where it stands, by
swapping its class to ``fp8kit.nn.Linear`` (``FP8<Class>(fp8kit.nn.Linear, Class)`` for a subclass,
``FP8Conv1D`` for a ``Conv1D``, still instances of their class) and adding the FP8 scaling state: the module object, its parameters, its hooks (forward, backward, state-dict) and
every attribute a user or library set on it stay as they were. Two kinds of instance-level
``forward`` are re-pointed at the FP8 forward: a bound ``nn.Linear.forward`` stored in the instance
(``layer.forward = layer.forward``), and accelerate's ``_old_forward`` (``add_hook_to_module``). A
layer whose forward cannot be followed, or whose weight is computed by ``torch.nn.utils.parametrize``,
is left in high precision and listed in the report with the reason.

Mixture-of-Experts: a ``transformers`` experts module (3-D expert weights, forward chosen through
``ExpertsInterface``) is converted in place to ``fp8kit.nn.experts.FP8Experts`` (per-expert FP8 scaling
state, grouped FP8 GEMMs) and its config switched to the ``"fp8kit"`` experts implementation. The
router beside it stays in high precision and is listed in the report. Experts built from separate
``nn.Linear`` modules convert as dense layers.
"""

from __future__ import annotations

import logging
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..numerics.recipes import DelayedScaling, Recipe, recipe_from_name
from .class_swap import mixin_class
from .experts import convert_experts, experts_why_not, fp8_experts_forward, is_experts_module
from .linear import Linear
from .linear_like import (
    Conv1DLinear,
    is_conv1d,
    is_linear_like,
    linear_dims,
    linear_like_why_not,
    weights_read_outside,
)
from .towers import find_towers

if TYPE_CHECKING:
    from .attention import AttentionRecipe

__all__ = [
    "ConversionReport",
    "ConversionTargets",
    "conversion_targets",
    "convert",
    "convert_layer",
    "default_module_filter",
]

log = logging.getLogger("fp8kit")

# Attribute of an ``nn.Linear`` read from an FP8 checkpoint: ``(codes, scale_inv, (br, bc))``, its weight
# tiles as stored; ``convert_layer`` seeds the FP8 layer's weight with them (``Linear.seed_fp8_weight``).
CHECKPOINT_TILES = "fp8_checkpoint_tiles"
HARDWARE_MULTIPLE = 16  # FP8 tensor-core GEMMs need K and N multiples of 16
_LORA_ADAPTER = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")  # PEFT's adapter layers


@dataclass
class ConversionReport:
    """What ``convert`` did: qualified names converted, and skipped names with the reason.

    ``experts`` lists the converted MoE experts modules (also in ``converted``), each holding
    ``num_experts`` x 2 expert GEMM weights; routers kept in high precision are in ``skipped``."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fp8kit.convert: {len(self.converted)} layer(s) converted, {len(self.skipped)} skipped"]
        if self.experts:
            lines.append(f"  MoE experts in FP8 (grouped GEMMs): {', '.join(self.experts)}")
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


def decoder_blocks(model: nn.Module) -> tuple[str, int] | None:
    """``(qualified name, length)`` of the model's stack of blocks: its longest ``nn.ModuleList`` of at least
    two modules of one class that hold ``nn.Linear`` layers (``model.layers`` of a Llama), or None."""
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(m) for m in module}) != 1:
            continue
        if not any(is_linear_like(m) for m in module[0].modules()):
            continue
        if best is None or len(module) > best[1]:
            best = (name, len(module))
    return best


def default_module_filter(
    model: nn.Module, recipe: Recipe | None = None, *, towers: bool = False
) -> Callable[[str, nn.Module], str | None]:
    """Reason to skip a layer, or ``None`` to convert it: the output head, a multimodal model's vision/audio
    towers and projectors (``nn.towers``; unless ``towers``), FP8-unfriendly shapes, and the decoder blocks
    ``recipe`` keeps in high precision (``Recipe.high_precision_blocks``; NVFP4's first and last blocks)."""
    head = is_output_head(model)
    kept_block = _kept_blocks(model, recipe)
    found = None if towers else find_towers(model)

    def why_skip(name: str, module: nn.Module) -> str | None:
        if head(name, module):
            return "output head (kept in high precision, as Transformer Engine and torchao do)"
        in_tower = found.why_kept(name) if found is not None else None
        if in_tower:
            return in_tower
        kept_why = kept_block(name)
        if kept_why:
            return kept_why
        if _LORA_ADAPTER.search(f".{name}."):
            return "LoRA adapter (rank-r GEMMs: little FP8 gain, and the low-rank update needs the precision)"
        in_features, out_features = linear_dims(module)
        if in_features % HARDWARE_MULTIPLE or out_features % HARDWARE_MULTIPLE:
            return (
                f"dims {in_features}x{out_features} are not multiples of {HARDWARE_MULTIPLE} "
                "(FP8 tensor cores need them)"
            )
        return None

    return why_skip


def _kept_blocks(model: nn.Module, recipe: Recipe | None) -> Callable[[str], str | None]:
    """``name -> reason`` for a module inside a decoder block that ``recipe`` keeps in high precision
    (``Recipe.high_precision_blocks``), else ``None``: the dense layers and the MoE experts alike."""
    blocks = decoder_blocks(model)
    if recipe is None or blocks is None:
        return lambda name: None
    kept, why = recipe.high_precision_blocks(blocks[1])
    prefixes = tuple(f"{blocks[0]}.{i}." if blocks[0] else f"{i}." for i in kept)
    return lambda name: why if prefixes and f"{name}.".startswith(prefixes) else None


def _is_linear_forward(fn: object, module: nn.Module, cls: type | None = None) -> bool:
    """``fn`` is the class forward of ``module`` (``cls``'s, default its own class's) bound to it: what
    ``module.forward`` was before the swap."""
    return (
        isinstance(fn, types.MethodType)
        and fn.__self__ is module
        and getattr(fn, "__func__", None) is (cls or type(module)).forward
    )


def _why_not_convertible(module: nn.Module) -> str | None:
    """Reason a linear layer (``nn.Linear``, parametrized or a subclass, or a ``Conv1D``) cannot keep its
    behaviour in FP8, or ``None``."""
    why = linear_like_why_not(module)
    if why:
        return why
    parametrizations = getattr(module, "parametrizations", None)
    if isinstance(parametrizations, nn.ModuleDict) and len(parametrizations):
        return (
            f"torch.nn.utils.parametrize on {', '.join(parametrizations)} (the weight is computed on every access; "
            "remove_parametrizations(..., leave_parametrized=True) first to convert it)"
        )
    inst = module.__dict__
    if "forward" in inst and not _is_linear_forward(inst["forward"], module) and "_old_forward" not in inst:
        return "its forward is replaced on the instance by code fp8kit cannot follow (convert before patching it)"
    if "_old_forward" in inst and not _is_linear_forward(inst["_old_forward"], module):
        return "accelerate's _old_forward is not nn.Linear.forward (another wrapper sits below the hook)"
    hook = inst.get("_hf_hook")
    if hook is not None and getattr(hook, "offload_buffers", False) and getattr(hook, "weights_map", None) is not None:
        return "dispatched with offload_buffers=True (the FP8 scaling buffers would be missing from the offload map)"
    return None


def _fp8_class(cls: type) -> type:
    """The FP8 class a linear layer of class ``cls`` takes in place (``nn.Linear`` -> ``fp8kit.nn.Linear``)."""
    if cls is nn.Linear:
        return Linear
    if issubclass(cls, nn.Linear):
        return mixin_class(Linear, cls, "FP8")
    return mixin_class(Conv1DLinear, cls, "FP8")


def convert_layer(
    module: nn.Module, recipe: Recipe | None = None, *, save_fp8_activations: bool = True, name: str = ""
) -> Linear:
    """Turn ``module`` (an ``nn.Linear``, a subclass keeping its forward, or a ``transformers`` ``Conv1D``) into
    an ``fp8kit.nn.Linear`` in place and return it.

    The object keeps its identity, parameters, hooks and attributes; only its class changes and the FP8
    scaling state is added. Raises ``ValueError`` (with the reason) where that would change what the
    layer computes, e.g. a parametrized weight.
    """
    if isinstance(module, Linear) or not is_linear_like(module):
        raise TypeError(f"convert_layer takes an nn.Linear or a Conv1D not yet converted, got {type(module).__name__}")
    why = _why_not_convertible(module)
    if why:
        raise ValueError(f"cannot convert {name or 'this layer'} to FP8: {why}")
    weight = module._parameters["weight"]
    old = type(module)
    if is_conv1d(module):
        module.in_features, module.out_features = linear_dims(module)
    module.__class__ = _fp8_class(old)
    try:
        if weight is not None and weight.device.type == "meta":
            # offloaded (accelerate): the FP8 state goes where the layer computes, not on the meta device
            module._parameters["weight"] = _placeholder(weight, _execution_device(module))
        module._init_fp8(recipe, save_fp8_activations, name)
    except BaseException:
        module.__class__ = old
        raise
    finally:
        module._parameters["weight"] = weight
    inst = module.__dict__
    for key in ("forward", "_old_forward"):
        if key in inst and _is_linear_forward(inst[key], module, old):
            inst[key] = types.MethodType(Linear.forward, module)
    tiles = inst.pop(CHECKPOINT_TILES, None)  # left by fp8kit.export.dequantized_model: the checkpoint's codes
    if tiles is not None:
        why = module.seed_fp8_weight(*tiles)
        done = "computes with the checkpoint's FP8 weight tiles until its first update"
        log.info("%s: %s", name or "layer", f"not seeded from the checkpoint's FP8 tiles: {why}" if why else done)
    return module


def _execution_device(module: nn.Module) -> torch.device:
    hook = module.__dict__.get("_hf_hook")
    dev = getattr(hook, "execution_device", None)
    return torch.device(dev if dev is not None else "cpu")


def _placeholder(weight: torch.Tensor, device: torch.device) -> nn.Parameter:
    """A zero-cost stand-in with the weight's shape and dtype on ``device`` (a zero-stride expand)."""
    return nn.Parameter(torch.zeros((), dtype=weight.dtype, device=device).expand(weight.shape), requires_grad=False)


@dataclass
class ConversionTargets:
    """What ``convert`` would convert in a model: ``experts`` (transformers experts modules) and ``linears``
    (linear layers: ``nn.Linear``, its subclasses, ``Conv1D``), by qualified name in module order; ``found_experts`` every experts module (converted
    or not); ``skipped`` the rest, with the reason."""

    experts: list[tuple[str, nn.Module]] = field(default_factory=list)
    found_experts: list[tuple[str, nn.Module]] = field(default_factory=list)
    linears: list[tuple[str, nn.Module]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def conversion_targets(
    model: nn.Module,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    recipe: Recipe | None = None,
    *,
    towers: bool = False,
) -> ConversionTargets:
    """The layers ``convert(model, recipe, module_filter, towers=towers)`` converts, and those it skips with the
    reason (``recipe``: one recipe for the whole model, whose kept blocks and experts support count; ``None``: a
    plan)."""
    out = ConversionTargets()
    out.found_experts = [(name, m) for name, m in model.named_modules() if is_experts_module(m)]
    kept_block = _kept_blocks(model, recipe) if module_filter is None else (lambda name: None)
    found = None if towers or module_filter is not None else find_towers(model)
    for name, module in out.found_experts:
        excluded = module_filter is not None and not module_filter(name, module)
        reason = "excluded by module_filter" if excluded else kept_block(name)
        reason = reason or (found.why_kept(name) if found is not None else None)
        reason = reason or experts_why_not(module, HARDWARE_MULTIPLE)
        reason = reason or (recipe.converts_experts if recipe is not None else None)
        if reason:
            out.skipped[name] = reason
        else:
            out.experts.append((name, module))
    routers = _routers(model, out.found_experts)
    default = default_module_filter(model, recipe, towers=towers)
    read_outside = weights_read_outside(model)
    for name, module in model.named_modules():
        if name in routers:
            out.skipped[name] = routers[name]
            continue
        if not is_linear_like(module) or type(module).__module__.startswith("fp8kit."):
            continue  # not linear, or fp8kit's own layer (FP8, BF16, tensor-parallel)
        if module_filter is not None:
            reason = None if module_filter(name, module) else "excluded by module_filter"
        else:
            reason = default(name, module)
        reason = reason or _why_not_convertible(module) or _read_outside_why(read_outside.get(name))
        if reason:
            out.skipped[name] = reason
        else:
            out.linears.append((name, module))
    return out


def _read_outside_why(why: str | None) -> str | None:
    """The conversion's reason for a layer whose weight the model reads itself: those GEMMs would bypass FP8."""
    return None if why is None else why.replace("a quantized layer would hand it codes", "it would not run in FP8")


KEPT_BY_PLAN = "kept in high precision by the per-layer plan"


def _one_recipe(recipe: object) -> Recipe | None:
    """The recipe of a whole-model conversion (a recipe, its name, ``None``: delayed), or ``None`` for a
    per-layer plan (a mapping ``name -> recipe or name or "bf16"``, or an object with one as ``per_layer``)."""
    if isinstance(getattr(recipe, "per_layer", recipe), Mapping):
        return None
    one = recipe_from_name(recipe) if isinstance(recipe, str) else recipe
    one = one if one is not None else DelayedScaling()
    if not isinstance(one, Recipe):
        raise TypeError(
            f"recipe must be an fp8kit recipe, its name (e.g. 'delayed') or a per-layer plan, got {recipe!r}"
        )
    return one


def _plan_recipes(plan: object, targets: ConversionTargets) -> Callable[[str], Recipe | None]:
    """``name -> Recipe`` (``None``: keep the layer) of a per-layer plan, checked against ``targets``."""
    per_layer = getattr(plan, "per_layer", plan)
    chosen: dict[str, Recipe | None] = {}
    for name, r in per_layer.items():
        if isinstance(r, str):
            r = None if r.lower() == "bf16" else recipe_from_name(r)
        if r is not None and not isinstance(r, Recipe):
            raise TypeError(f"the plan gives layer {name!r} {r!r}: give a recipe, its name or 'bf16'")
        chosen[name] = r
    known = {name for name, _ in targets.experts + targets.linears}
    unknown = sorted(set(chosen) - known)
    if unknown:
        raise ValueError(
            f"the plan names layers convert cannot convert in this model: {', '.join(unknown[:5])}"
            f"{' ...' if len(unknown) > 5 else ''} (a plan made for another model?)"
        )
    return chosen.get


def convert(
    model: nn.Module,
    recipe: Recipe | str | Mapping[str, Recipe | str] | None = None,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    *,
    save_fp8_activations: bool = True,
    verbose: bool = False,
    smooth_swiglu: bool = False,
    swiglu_limit: float | None = None,
    attention: AttentionRecipe | str | bool | None = None,
    attention_filter: Callable[[str, nn.Module], bool] | None = None,
    towers: bool = False,
) -> nn.Module:
    """Turn eligible ``nn.Linear`` layers of ``model`` into ``fp8kit.nn.Linear`` in place.

    ``recipe`` is a recipe object or its name (``"delayed"``, ``"current"``, ``"rowwise"``, ``"block"``,
    ``"mxfp8"``, ``"nvfp4"``; default delayed scaling), or a per-layer plan: ``fp8kit.autotune``'s ``Plan`` or a mapping
    ``layer name -> recipe, its name or "bf16"`` (layers given ``"bf16"`` or absent stay in high
    precision). Layers keep their identity, parameters, hooks and attributes,
    so an optimizer built before or after conversion keeps working and accelerate/PEFT/user hooks still
    fire. ``module_filter(name, module) -> bool`` picks layers by qualified name (it replaces the default
    filter, which skips the output head, dims that are not multiples of 16 and the decoder blocks the recipe
    keeps in high precision). A multimodal model's vision/audio towers and projectors (``nn.towers``: the
    modules outside its language model) stay in high precision unless ``towers=True``. The report is stored as
    ``model.fp8_conversion_report`` and logged (printed with ``verbose=True``). ``smooth_swiglu=True`` and
    ``swiglu_limit=L`` give every SwiGLU MLP Smooth-SwiGLU and clamped SwiGLU (``fp8kit.nn.swiglu``). ``attention`` (an
    ``nn.attention.AttentionRecipe`` or its name, e.g. ``"fp8"``; default None: high precision) runs the
    attention blocks in FP8 too (``nn.attention.enable_fp8_attention``), whatever the Linear recipe;
    ``attention_filter(name, block) -> bool`` picks those blocks (the others keep high-precision attention).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert() takes an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear) and type(model) is nn.Linear:
        raise ValueError(
            "convert() replaces layers inside a model, not the model itself: wrap the Linear in "
            "nn.Sequential, or use fp8kit.nn.Linear.from_linear(layer, recipe)"
        )
    if smooth_swiglu or swiglu_limit is not None:
        from .swiglu import apply_swiglu_options

        apply_swiglu_options(model, smooth=smooth_swiglu, limit=swiglu_limit)
    if attention_filter is not None and attention is None:
        raise ValueError("attention_filter picks the blocks of FP8 attention: give attention= too")
    if towers and module_filter is not None:
        raise ValueError(
            "towers=True changes the default layer choice, which module_filter replaces: give one of them "
            "(module_filter alone chooses the towers' layers too)"
        )
    uniform = _one_recipe(recipe)
    targets = conversion_targets(model, module_filter, uniform, towers=towers)
    recipe_for = (lambda _name: uniform) if uniform is not None else _plan_recipes(recipe, targets)
    report = ConversionReport(skipped=dict(targets.skipped))
    experts = [(name, m, recipe_for(name)) for name, m in targets.experts]
    if any(r is not None for _, _, r in experts):
        from .experts_interface import IMPLEMENTATION, use_implementation

        use_implementation([m for _, m in targets.found_experts], IMPLEMENTATION, fp8_experts_forward)
    for name, module, r in experts:
        if r is None:
            report.skipped[name] = KEPT_BY_PLAN
            continue
        convert_experts(module, r, save_fp8_activations=save_fp8_activations, name=name)
        report.converted.append(name)
        report.experts.append(name)
    for name, module in targets.linears:
        r = recipe_for(name)
        if r is None:
            report.skipped[name] = KEPT_BY_PLAN
            continue
        convert_layer(module, r, save_fp8_activations=save_fp8_activations, name=name)
        report.converted.append(name)
    if attention is not None:
        from .attention import enable_fp8_attention

        enable_fp8_attention(model, attention, attention_filter)
    object.__setattr__(model, "fp8_conversion_report", report)
    (print if verbose else log.info)(str(report))
    return model


_ROUTER = "MoE router (kept in high precision, as DeepSeek-V3 does: routing decisions are sensitive to rounding)"


def _routers(model: nn.Module, experts: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """The routers beside experts modules: siblings whose weight has one row per expert."""
    out = {}
    for name, module in experts:
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        for child_name, child in parent.named_children():
            weight = getattr(child, "weight", None)
            if child is module or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
                continue
            if weight.shape[0] == module.num_experts:
                out[f"{parent_name}.{child_name}" if parent_name else child_name] = _ROUTER
    return out
