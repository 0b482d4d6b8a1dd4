"""From training (or a checkpoint) to serving layers and back, with no calibration pass.

* ``serving_layers`` / ``serving_model``: a model converted by ``fp8kit.convert`` gets the inference
  layers of the scheme its recipe trained: delayed scaling -> ``fp8`` (per-tensor weights; the static
  input scale is the one the recipe's amax history gives, ``reduce(history) * 2**margin / 448``),
  row-wise -> ``fp8-dynamic`` (per-channel weights, per-token activations), current scaling ->
  ``fp8-dynamic`` (its dynamic activations at finer, per-token granularity), block -> ``fp8-block`` (the
  recipe's own 128x128 weight tiles and power-of-two scales, dynamic 1x128 activations, or the Linear
  layers tiled again where the format's readers reject 128x128 tiles; MoE experts trained by
  ``FP8Experts`` too, as ``QuantExperts`` with each expert's own tiles). MXFP8 has no serving format here.
* ``quantize_block``: post-training block FP8 (no calibration: square weight tiles, 128x128 or the largest
  every reader of the format loads (``support.BLOCK_READERS``), dynamic activations), of the ``nn.Linear``
  layers and of the MoE experts (``ptq.experts.QuantExperts`` with ``FP8_BLOCK``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.nn as nn

from ..nn.linear import Linear as FP8Linear
from ..ptq.quantized import QuantLinear
from .block_linear import BlockQuantLinear
from .common import ExportError, replace_module
from .support import BLOCK_SCHEME

__all__ = ["block_shapes", "block_size_for", "check_train_export", "quantize_block", "serving_layers", "serving_model"]

_SCHEME_OF_RECIPE = {"delayed": "fp8", "rowwise": "fp8-dynamic", "current": "fp8-dynamic", "block": BLOCK_SCHEME}


def _high_precision(m: nn.Module) -> bool:
    """A Linear layer left in high precision (``nn.Linear``, or a subclass such as ``BF16Linear``)."""
    return isinstance(m, nn.Linear) and not isinstance(m, FP8Linear)


def _history_amax(layer: FP8Linear) -> float:
    """The input amax delayed scaling would scale the next step with (``max`` or ``most_recent``), times
    ``2**margin``."""
    recipe = layer.recipe
    if int(layer.fp8_seen[0]) == 0:
        raise ExportError(
            f"{layer.fp8_name} has no input amax history (it never ran a forward): train (or run) the "
            "converted model before exporting it"
        )
    hist = layer.fp8_amax_history[0]
    amax = hist.max() if recipe.amax_compute_algo == "max" else hist[0]
    pending = layer.fp8_amax_pending[0]
    if recipe.amax_compute_algo == "max" and pending >= 0:
        amax = torch.maximum(amax, pending)
    return float(amax) * 2.0**recipe.margin


def _block_experts(module: nn.Module, name: str) -> nn.Module:
    """A ``QuantExperts`` (not dispatched: the training model's config is shared) holding the 128x128 tiles
    a block-recipe ``FP8Experts`` computes with, per expert."""
    from dataclasses import replace

    from ..ptq.quantized import FP8_BLOCK, experts_projections, install_quant_experts, shallow_copy

    new: dict[str, torch.Tensor] = {}
    for p, proj in enumerate(experts_projections(module)):
        wq = module.fp8_expert_weights(p, module.recipe)[0]  # (E, out, in) codes, (E, tiles, tiles) scales
        block = wq.block[0]
        if p == 0 and module.has_gate and wq.data.shape[1] // 2 % block:
            raise ExportError(
                f"{name}: intermediate size {wq.data.shape[1] // 2} is not a multiple of {block}; the fp8-block "
                "format splits the fused gate_up tiles into gate_proj and up_proj"
            )
        new[proj], new[f"{proj}_weight_scale"] = wq.data.contiguous(), wq.scale_inv.float().contiguous()
        bias = getattr(module, f"{proj}_bias", None) if module.has_bias else None
        if bias is not None:
            new[f"{proj}_bias"] = bias.detach().float().clone()
    q = shallow_copy(module)
    install_quant_experts(q, replace(FP8_BLOCK, block=block), new, dispatch=False)
    return q


def serving_layers(
    model: nn.Module,
    format: str | None = None,  # noqa: A002 - the name users know from save_pretrained
) -> tuple[str, dict[str, nn.Module], list[str]]:
    """``(scheme, {name: inference layer}, names of the Linear layers left in high precision)`` for a
    model converted by ``fp8kit.convert`` (the model itself is not changed). With the block recipe, the
    MoE experts modules it trained (``FP8Experts``) are among the layers, as ``QuantExperts``; when a reader
    of ``format`` cannot load the recipe's 128x128 tiles (``support.BLOCK_READERS``, e.g. SmolLM2's 576 and
    192 dims), the Linear layers are tiled again from their trained weights in the largest tile every reader
    loads (``support.fitting_block``), with the recipe's scale rounding."""
    from ..nn.experts import FP8Experts

    trained = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, FP8Experts)}
    if not trained and not experts:
        raise ExportError("serving_layers takes a model converted by fp8kit.convert (none of its layers are)")
    kinds = {m.recipe.kind for m in (*trained.values(), *experts.values())}
    if len(kinds) != 1:
        raise ExportError(f"the model mixes FP8 recipes ({', '.join(sorted(kinds))}); a checkpoint has one scheme")
    kind = kinds.pop()
    if kind not in _SCHEME_OF_RECIPE:
        raise ExportError(
            f"the {kind} recipe has no serving format in fp8kit; train with delayed, current, rowwise or block"
        )
    scheme = _SCHEME_OF_RECIPE[kind]
    layers: dict[str, nn.Module] = {}
    with torch.no_grad():
        for name, m in trained.items():
            if scheme == BLOCK_SCHEME:
                layers[name] = BlockQuantLinear.from_tiles(m.fp8_weights(m.recipe)[0], m.bias)  # what it computes with
            elif scheme == "fp8":
                layers[name] = QuantLinear.from_linear(m, scheme, input_amax=_history_amax(m))
            else:
                layers[name] = QuantLinear.from_linear(m, scheme)
        if scheme == BLOCK_SCHEME:  # other recipes' experts have no serving layers here yet
            layers.update({name: _block_experts(m, name) for name, m in experts.items()})
        if scheme == BLOCK_SCHEME and format is not None:
            _fit_trained_tiles(layers, trained, format)
    kept = [n for n, m in model.named_modules() if _high_precision(m)]
    return scheme, layers, kept


def _fit_trained_tiles(layers: dict[str, nn.Module], trained: dict[str, FP8Linear], fmt: str) -> None:
    """Re-tile the block recipe's Linear serving layers in place when a reader of ``fmt`` rejects their tiles
    and a smaller tile fits every one of them (experts keep their tiles: ``save_pretrained`` then says why)."""
    from .support import block_problem, fitting_block

    dense = {n: m for n, m in layers.items() if isinstance(m, BlockQuantLinear)}
    shapes = block_shapes(dense)
    block = next(iter(dense.values())).block if dense else None
    fits = fitting_block(fmt, shapes)
    if block is None or fits is None or block_problem(fmt, shapes, block) is None:
        return
    for name in dense:
        m = trained[name]
        layers[name] = BlockQuantLinear.from_linear(m, fits, power_of_two=m.recipe.power_of_two_scales)


def _report(
    model: nn.Module, scheme: str, names: list[str], why: str, experts: list[str] | None = None, **skipped: str
) -> None:
    from ..ptq.quantized import PTQReport

    report = PTQReport(scheme, quantized=list(names), experts=list(experts or []))
    report.skipped = {n: why for n, m in model.named_modules() if _high_precision(m)} | skipped
    object.__setattr__(model, "ptq_report", report)


def serving_model(
    model: nn.Module,
    inplace: bool = False,
    format: str | None = None,  # noqa: A002 - the name users know from save_pretrained
) -> nn.Module:
    """The inference model of a ``fp8kit.convert``-ed training model (a copy unless ``inplace``): what
    ``save_pretrained(model, format=format)`` writes, to evaluate before exporting."""
    from ..ptq.quantized import QuantExperts, dispatch_quant_experts

    model = model if inplace else copy.deepcopy(model)
    scheme, layers, _ = serving_layers(model, format)
    experts = [n for n, m in layers.items() if isinstance(m, QuantExperts)]
    for name, layer in layers.items():
        replace_module(model, name, layer)
        if name in experts:
            dispatch_quant_experts(layer)
    _report(model, scheme, [n for n in layers if n not in experts], "not converted to FP8 for training", experts)
    return model.eval()


def block_shapes(layers: Mapping[str, nn.Module]) -> dict[str, tuple[int, int]]:
    """``{layer: (out, in)}`` of Linear layers (``nn.Linear``, ``BlockQuantLinear``) and, per projection as the
    checkpoint writes them (``NAME.gate_proj``, ``NAME.up_proj``, ``NAME.down_proj``), of experts modules
    (quantized or not), from ``{name: module}``: what ``support.block_problem`` checks."""
    from ..ptq.quantized import QuantExperts, experts_projections

    shapes: dict[str, tuple[int, int]] = {}
    for name, m in layers.items():
        if hasattr(m, "out_features"):
            shapes[name] = (m.out_features, m.in_features)
            continue
        if isinstance(m, QuantExperts):
            (_, up_out, hidden), (_, down_out, inter) = (tuple(m.weight_codes(p).shape) for p in (0, 1))
        else:
            up, down = (tuple(getattr(m, p).shape[1:]) for p in experts_projections(m))
            (up_out, hidden), (down_out, inter) = (up[::-1], down[::-1]) if m.is_transposed else (up, down)
        parts = ("gate_proj", "up_proj") if m.has_gate else ("up_proj",)
        shapes.update({f"{name}.{p}": (up_out // len(parts), hidden) for p in parts})
        shapes[f"{name}.down_proj"] = (down_out, inter)
    return shapes


def _block_targets(
    model: nn.Module, module_filter: Callable[[str, nn.Module], bool] | None, block: int
) -> tuple[list[str], list[str], dict[str, str]]:
    """The ``nn.Linear`` layers and experts modules ``quantize_block`` quantizes in ``block`` tiles, and the
    experts it keeps in high precision with the reason (a fused gate_up not whole tiles)."""
    from ..nn.convert import default_module_filter
    from ..ptq.quantized import block_tiling_problem, find_experts

    default = default_module_filter(model)
    keep = module_filter or (lambda n, m: default(n, m) is None)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and keep(n, m)]
    found = find_experts(model)
    if module_filter is not None:
        return names, [n for n, m in found.items() if module_filter(n, m)], {}
    untileable = {n: why for n, m in found.items() if (why := block_tiling_problem(m, block))}
    return names, [n for n in found if n not in untileable], untileable


def block_size_for(
    model: nn.Module,
    format: str | None = "fp8-block",  # noqa: A002 - the name users know from save_pretrained
    block: int | None = None,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> int:
    """The tile edge ``quantize_block(model, module_filter, block, format)`` quantizes with: ``block`` when every
    reader of ``format`` (``support.BLOCK_READERS``) loads every layer in it, else, with ``block=None``, the
    largest edge they all load (``format=None``: ``block`` or 128, unchecked). Raises ``ExportError`` (the
    reader, the layer, the rule) before any layer is quantized."""
    from .support import BLOCK_EDGES, choose_block

    if format is None:
        return block or BLOCK_EDGES[0]
    if block is None:  # every experts module counts: a smaller tile may make a fused gate_up whole
        names, experts, _ = _block_targets(model, module_filter, 1)
        try:
            return choose_block(format, block_shapes({n: model.get_submodule(n) for n in [*names, *experts]}))
        except ValueError:
            block = BLOCK_EDGES[0]  # no edge fits them all: the error below names a layer at the default edge
    names, experts, _ = _block_targets(model, module_filter, block)
    try:
        return choose_block(format, block_shapes({n: model.get_submodule(n) for n in [*names, *experts]}), block)
    except ValueError as err:
        raise ExportError(str(err)) from None


def quantize_block(
    model: nn.Module,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    block: int | None = None,
    format: str | None = "fp8-block",  # noqa: A002 - the name users know from save_pretrained
) -> nn.Module:
    """Post-training block FP8 in place: eligible ``nn.Linear`` layers (default: ``fp8kit.convert``'s
    filter, which keeps the output head) become ``BlockQuantLinear`` (``block`` x ``block`` weight tiles with
    ``amax / 448`` scales, dynamic 1 x ``block`` activations) and eligible MoE experts modules
    (``module_filter`` sees them too) ``ptq.experts.QuantExperts`` with the same layout per expert; no
    calibration data needed. ``block=None`` picks the largest tile edge every reader of ``format`` loads
    (``block_size_for``: 128 when every dimension is whole 128 tiles, 64 for SmolLM2); a ``block`` or a model
    those readers cannot load raises ``ExportError`` before any layer changes (``format=None``: no check, 128
    by default). By default, experts whose fused gate_up cannot be cut into whole gate and up tiles stay in
    high precision (``ptq_report.skipped`` says why); a ``module_filter`` that selects them gets the error."""
    from dataclasses import replace

    from ..ptq.quantized import FP8_BLOCK, quantize_experts_module

    block = block_size_for(model, format, block, module_filter)
    names, experts, untileable = _block_targets(model, module_filter, block)
    if not names and not experts:
        raise ExportError("quantize_block found no eligible nn.Linear layer or MoE experts module")
    scheme = replace(FP8_BLOCK, block=block)
    with torch.no_grad():
        for name in experts:
            quantize_experts_module(model.get_submodule(name), scheme, name=name)
        for name in names:
            replace_module(model, name, BlockQuantLinear.from_linear(model.get_submodule(name), block))
    _report(model, BLOCK_SCHEME, names, "kept in high precision", experts, **untileable)
    return model.eval()


def check_train_export(recipes: list[str], fmt: str, out: str | Path, hf_model: bool) -> list[Path]:
    """Validate ``fp8kit train --export-format FMT`` before training: each FP8 recipe's serving scheme fits
    ``fmt``, the model is a Hugging Face one, and ``OUT/serving/fp8-<recipe>`` can be written. Returns
    those folders; raises ``ValueError`` (one line naming the fix)."""
    from .common import check_export_dir
    from .support import check_scheme_format

    if not hf_model:
        raise ValueError("--export-format writes a Hugging Face checkpoint: give --model smollm2 or a local directory")
    folders = []
    for recipe in recipes:
        if recipe not in _SCHEME_OF_RECIPE:
            raise ValueError(f"the {recipe} recipe has no serving format: train delayed, current, rowwise or block")
        try:
            check_scheme_format(_SCHEME_OF_RECIPE[recipe], fmt)
        except ValueError as err:
            raise ValueError(f"recipe {recipe} trains the {_SCHEME_OF_RECIPE[recipe]} scheme: {err}") from None
        folders.append(check_export_dir(Path(out) / "serving" / f"fp8-{recipe}"))
    return folders
