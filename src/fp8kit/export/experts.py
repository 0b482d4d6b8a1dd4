"""MoE experts in checkpoints: fp8kit's fused ``QuantExperts`` <-> the tensors a Hugging Face checkpoint of the
architecture holds on disk.

``transformers`` >= 5 fuses the experts of a layer into 3-D parameters when it loads a checkpoint; how the
checkpoint holds them is a rule, not a list (``experts_on_disk``): fp8kit runs transformers' own
``revert_weight_conversion`` (what its ``save_pretrained`` writes) on small probes of an experts module whose
values name their expert and row, and reads the layout off the keys and values that come back:

* ``"per_expert"``: one ``nn.Linear``'s worth of tensors per expert, under the names of the architecture's
  ``WeightConverter`` (Qwen2-MoE family ``model.layers.L.mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj``;
  Mixtral and PhiMoE ``model.layers.L.block_sparse_moe.experts.E.w1`` (gate) / ``w3`` (up) / ``w2`` (down),
  ``block_sparse_moe`` being renamed ``mlp`` on load). vLLM's fused-MoE loaders read them through
  ``expert_params_mapping``, transformers merges them.
* ``"fused"``: the fused 3-D tensors under their own ``.weight`` names (GraniteMoE's
  ``block_sparse_moe.input_linear.weight`` ``(E, 2I, H)``; llm-compressor writes its quantized ones back so):
  ``fused_expert_tensors`` writes the codes with ``weight_scale`` ``(E, out | 1, 1)``.
* ``"linearized"``: transformers keeps the module's own 3-D parameters on disk (no conversion: GPT-OSS): fp8kit
  writes llm-compressor's linearized per-expert layout, which vLLM reads.

Gate and up in halves or interleaved, the expert count and whether gate exists come from the module; where the
probes come back reordered, split across prefixes or renamed beyond the MoE block's name, the export refuses
(keep the experts in high precision). transformers 5 reads neither the fused nor the linearized quantized
layout right (``transformers_refusal``): those exports make it refuse instead (``export.compressed_tensors``).

Per expert, each projection gets its own tensors: ``weight`` (codes), ``weight_scale`` (that expert's
scale; the fused ``gate_up`` scale is written to both ``gate`` and ``up``, per tensor, or split by rows, per
channel) and, for static schemes, ``input_scale`` (the layer's shared scale, the same value for every
expert: vLLM takes the max over experts, so it computes what fp8kit does). Reading takes the max over
experts likewise, so a checkpoint from another producer with per-expert input scales loads with vLLM's
semantics. Block FP8 (``fp8-block``): each expert's linear gets ``weight`` and its own 128x128 tiles'
``weight_scale_inv``; the fused ``gate_up`` tiles split at row ``I / 128`` (``I`` a multiple of 128, see
``ptq.experts``), so ``gate_proj`` and ``up_proj`` each hold whole tiles. FP4 (``fp4_expert_tensors``,
``load_fp4_experts``): each expert's linear gets the tensors the format gives a dense FP4 linear (packed
codes, its rows' block scales, NVFP4's per-tensor scale: the fused ``gate_up``'s one written to both
``gate`` and ``up``, and the layer's shared input scale to every expert).

GPT-OSS (``gpt_oss``) keeps gate and up interleaved in its fused ``gate_up_proj`` (gate the even rows of the
``(2I, H)`` weight, up the odd ones) and gives every projection a bias. Its per-expert layout is
llm-compressor's linearized one (``GptOssLinearExperts``): ``model.layers.L.mlp.experts.E.gate_proj.*`` from
the even rows, ``.up_proj.*`` from the odd rows, ``.down_proj.*``, each with its ``bias`` (``gate_up_proj_bias``
split the same way), router ``model.layers.L.mlp.router.*`` in high precision. Reading interleaves the rows
back. A format whose readers take no linearized experts (fp8-block, modelopt) is refused with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..ptq.quantized import QuantExperts, Scheme, experts_projections, install_quant_experts, quantize_codes
from .common import ExportError

__all__ = [
    "checkpoint_key",
    "expert_tensors",
    "fp4_expert_tensors",
    "experts_naming",
    "fuse_expert_tensors",
    "has_expert_tensors",
    "load_experts",
    "load_fp4_experts",
    "model_key",
]

_LINEARIZED = ("gate_proj", "up_proj", "down_proj")  # llm-compressor's per-expert names for fused experts
_PROBE_ROWS = 2  # rows of each of gate and up in the probe (enough to tell halves from interleaved rows)


@dataclass(frozen=True)
class ExpertsOnDisk:
    """How a checkpoint of the model's architecture holds one experts module's weights.

    ``layout``: ``"per_expert"`` (one linear per expert and projection, ``{block}.experts.E.{linear}.weight``:
    transformers merges them on load), ``"fused"`` (the fused 3-D tensors under their own ``.weight`` names,
    ``fused``: each projection's key relative to the MoE block, e.g. GraniteMoE's ``input_linear.weight``), or
    ``"linearized"`` (transformers keeps the module's own 3-D parameters on disk and has no per-expert
    reader: fp8kit writes llm-compressor's linearized per-expert layout, ``gate_proj``/``up_proj``/``down_proj``,
    which vLLM's MoE loaders read). ``linears``: the ``(gate, up, down)`` linear names; ``block``: the MoE block's
    attribute on disk where the model calls it ``mlp`` (Mixtral's ``block_sparse_moe``)."""

    layout: str
    linears: tuple[str, str, str] = _LINEARIZED
    block: str = "mlp"
    fused: tuple[str, str] = ("", "")


def _probe(module: nn.Module, p: int) -> torch.Tensor:
    """A small stand-in for projection ``p`` of ``module`` with its real expert count, whose values name their
    place: ``1000 * expert + row`` (rows of the ``(out, in)`` view: two of each of gate and up) and
    ``1000 * expert + 500 + row`` for down."""
    e = module.num_experts
    rows = 2 * _PROBE_ROWS if p == 0 and module.has_gate else _PROBE_ROWS
    t = (torch.arange(e).view(e, 1, 1) * 1000 + 500 * p + torch.arange(rows).view(1, rows, 1)).double()
    return t.transpose(1, 2) if module.is_transposed else t


def _interleaved_rows(module: nn.Module) -> bool:
    return module.has_gate and not getattr(module, "is_concatenated", True)


def _probe_out(model: nn.Module, name: str, module: nn.Module) -> dict[str, torch.Tensor]:
    """transformers' own ``revert_weight_conversion`` (what its ``save_pretrained`` writes) applied to probes of
    the experts module ``name``: the checkpoint's keys for its weights, with the probe values they hold."""
    from transformers.core_model_loading import revert_weight_conversion

    first, second = experts_projections(module)
    state = {f"{name}.{first}": _probe(module, 0), f"{name}.{second}": _probe(module, 1)}
    return revert_weight_conversion(model, state)


def _which(module: nn.Module, t: torch.Tensor, e: int) -> int | None:
    """The linear (0 gate, 1 up, 2 down) of expert ``e`` that a per-expert probe tensor ``(out, 1)`` holds whole
    and in order, or ``None``."""
    if t.dim() != 2 or t.shape[1] != 1 or not torch.equal(t.reshape(-1) // 1000, torch.full((t.shape[0],), e).double()):
        return None
    rows = t.reshape(-1) % 1000
    if bool((rows >= 500).all()):
        which, want = 2, torch.arange(_PROBE_ROWS) + 500
    elif not module.has_gate:
        which, want = 1, torch.arange(_PROBE_ROWS)
    elif _interleaved_rows(module):
        which = 0 if int(rows[0]) % 2 == 0 else 1
        want = torch.arange(_PROBE_ROWS) * 2 + which
    else:
        which = 0 if int(rows[0]) < _PROBE_ROWS else 1
        want = torch.arange(_PROBE_ROWS) + _PROBE_ROWS * which
    return which if torch.equal(rows, want.double()) else None


def _derive(model: nn.Module, name: str, module: nn.Module) -> ExpertsOnDisk:
    """``ExpertsOnDisk`` of the experts module ``name``, read off transformers' weight-conversion metadata."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)

    def ambiguous(why: str) -> ExportError:
        return ExportError(
            f"fp8kit cannot tell how {model_type!r} checkpoints name the experts of {name} on disk: {why} "
            "(keep the experts in high precision with module_filter)"
        )

    try:
        out = _probe_out(model, name, module)
    except Exception as err:  # transformers' conversion failed on the probe
        raise ambiguous(f"transformers' weight conversion does not revert ({type(err).__name__}: {err})") from err
    first, second = experts_projections(module)
    if set(out) == {f"{name}.{first}", f"{name}.{second}"}:
        return ExpertsOnDisk("linearized")
    parent, _, _ = name.rpartition(".")
    prefix = f"{parent}." if parent else ""
    if len(out) == 2:  # fused on disk, renamed (GraniteMoE's input_linear / output_linear)
        by_p = {}
        for key, t in out.items():
            p = next(
                (p for p in (0, 1) if t.shape == _probe(module, p).shape and torch.equal(t, _probe(module, p))), None
            )
            if p is None or not key.startswith(prefix) or not key.endswith(".weight"):
                raise ambiguous(
                    f"its fused tensors are stored as {list(out)}, reordered or under names fp8kit cannot map"
                )
            by_p[p] = key[len(prefix) :]
        return ExpertsOnDisk("fused", fused=(by_p[0], by_p[1]))
    linears: dict[int, str] = {}
    bases = set()
    for key, t in out.items():
        parts = key.split(".")
        if len(parts) < 4 or parts[-1] != "weight" or not parts[-3].isdigit():
            raise ambiguous(f"key {key!r} is neither per-expert ('...experts.E.linear.weight') nor fused")
        e, linear = int(parts[-3]), parts[-2]
        which = _which(module, t, e)
        if which is None or linears.setdefault(which, linear) != linear:
            raise ambiguous(f"{key!r} does not hold one whole linear of expert {e} as (out, in)")
        bases.add(".".join(parts[:-3]))
    if len(bases) != 1:
        raise ambiguous(f"its experts are stored under several prefixes ({sorted(bases)})")
    base = bases.pop()
    if base == name:
        block = "mlp"
    else:
        model_parts, disk_parts = name.split("."), base.split(".")
        diff = [i for i, (a, b) in enumerate(zip(model_parts, disk_parts, strict=False)) if a != b]
        if len(model_parts) == len(disk_parts) and len(diff) == 1 and model_parts[diff[0]] == "mlp":
            block = disk_parts[diff[0]]
        elif _merged_under_model_names(model, name, [linears[w] for w in sorted(linears)]):
            block = "mlp"  # renamed elsewhere on disk (Nemotron-H's backbone.*), but the model's names merge too
        else:
            raise ambiguous(f"the experts of {name} are stored under {base}, renamed beyond the MoE block's name")
    wanted = (0, 1, 2) if module.has_gate else (1, 2)
    if sorted(linears) != list(wanted):
        raise ambiguous(f"its per-expert linears {sorted(linears.values())} are not one each of gate, up and down")
    names = (linears.get(0, _LINEARIZED[0]), linears[1], linears[2])
    return ExpertsOnDisk("per_expert", names, block)


def _merged_under_model_names(model: nn.Module, name: str, linears: list[str]) -> bool:
    """Whether transformers' per-expert ``WeightConverter`` source patterns match ``{name}.E.{linear}.weight`` for
    every linear: keys under the model's own names load as well as the renamed ones ``save_pretrained`` writes."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    patterns = [
        re.compile(re.escape(p).replace(r"\*", r"\d+") + "$")
        for c in get_model_conversion_mapping(model)
        if isinstance(c, WeightConverter)
        for p in c._original_source_patterns
        if "*" in p
    ]
    return all(any(p.search(f"{name}.0.{linear}.weight") for p in patterns) for linear in linears)


def experts_on_disk(model: nn.Module) -> ExpertsOnDisk:
    """How checkpoints of ``model``'s architecture hold its experts (``ExpertsOnDisk``), derived from the module
    structure and transformers' weight-conversion metadata (``revert_weight_conversion``, what transformers'
    own ``save_pretrained`` writes); every experts module of the model must agree. ``ExportError`` where they do
    not or the metadata is ambiguous."""
    from ..ptq.quantized import find_experts

    found = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)} | find_experts(model)
    if not found:
        return ExpertsOnDisk("per_expert")
    got = set()
    for name, module in found.items():
        if isinstance(module, QuantExperts):
            continue  # quantized: its 3-D parameters are gone; the others (or a copy) tell
        got.add(_derive(model, name, module))
    if not got:
        got = {_derive_quantized(model, found)}
    if len(got) > 1:
        raise ExportError(f"the experts modules of this model are stored in different layouts: {sorted(got, key=str)}")
    return got.pop()


def _derive_quantized(model: nn.Module, found: dict[str, nn.Module]) -> ExpertsOnDisk:
    """``_derive`` for a model whose experts are all quantized: on a stand-in with the module's shape flags."""
    name, module = next(iter(found.items()))
    shapes = {p: getattr(module, p).shape for p in module.projections}
    stand_in = _StandIn(module, shapes)
    swapped = _swap_in(model, name, stand_in)
    try:
        return _derive(model, name, stand_in)
    finally:
        _swap_in(model, name, swapped)


class _StandIn(nn.Module):
    """The flags ``_derive`` reads off an experts module (a quantized one has lost its 3-D parameters)."""

    def __init__(self, module: nn.Module, shapes: dict[str, torch.Size]) -> None:
        super().__init__()
        self.num_experts = module.num_experts
        self.has_gate = module.has_gate
        self.is_transposed = bool(getattr(module, "_fp8kit_was_transposed", False))
        if hasattr(module, "is_concatenated"):
            self.is_concatenated = module.is_concatenated
        for p, shape in shapes.items():
            rows_cols = (shape[2], shape[1]) if self.is_transposed else (shape[1], shape[2])
            self.register_parameter(p, nn.Parameter(torch.empty(shape[0], *rows_cols, device="meta")))


def _swap_in(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    parent, _, attr = name.rpartition(".")
    holder = model.get_submodule(parent) if parent else model
    old = getattr(holder, attr)
    setattr(holder, attr, module)
    return old


def _linearized_refusal(model_type: str | None, fmt: str | None) -> str | None:
    """Why no reader takes linearized experts (transformers stores the module's own 3-D parameters) in ``fmt``."""
    if fmt == "fp8-block":
        return (
            f"transformers 5 reads no quant_method 'fp8' layout of {model_type!r} experts (no weight conversion maps "
            "per-expert tensors onto its fused 3-D parameters, and its fp8 reader dequantizes '.weight' tensors only), "
            "and a 128-row tile of an interleaved gate_up_proj mixes gate and up rows. Quantize with fp8 or "
            "fp8-dynamic and write --format compressed-tensors (llm-compressor's per-expert layout)"
        )
    if fmt == "modelopt":
        return (
            f"ModelOpt writes {model_type!r} experts fused (gate_up_proj, down_proj and their scales, as its "
            "_export_bmm_experts does), a layout fp8kit's modelopt export does not write. Write --format "
            "compressed-tensors (llm-compressor's per-expert layout)"
        )
    return None


def transformers_refusal(model: nn.Module) -> str | None:
    """Why transformers cannot load ``model``'s quantized experts as a compressed-tensors checkpoint holds them
    (``experts_on_disk``), or ``None`` where it can (per-expert tensors its conversion merges)."""
    disk = experts_on_disk(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if disk.layout == "linearized":
        return (
            f"transformers has no weight conversion for {model_type!r} experts: it keeps the fused 3-D parameters "
            "on disk, so the per-expert tensors of this checkpoint (llm-compressor's linearized layout, which vLLM "
            "reads) would be dropped and the experts left at random values. Load it with "
            "fp8kit.export.load_pretrained or serve it with vLLM"
        )
    if disk.layout == "fused":
        return (
            f"transformers renames {model_type!r}'s fused expert tensors ({', '.join(disk.fused)}) onto its 3-D "
            "parameters without dequantizing them, so it would take the FP8/INT8 codes as values. Load it with "
            "fp8kit.export.load_pretrained or serve it with vLLM"
        )
    return None


def experts_naming(model: nn.Module, fmt: str | None = None) -> tuple[tuple[str, str, str], str]:
    """``((gate, up, down) linear names, MoE block name on disk)`` for ``model``'s per-expert checkpoint tensors
    (``experts_on_disk``); ``ExportError`` when no reader takes its quantized experts in the checkpoint format
    ``fmt`` (experts fused on disk go in compressed-tensors only)."""
    disk = experts_on_disk(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    reason = _linearized_refusal(model_type, fmt) if disk.layout == "linearized" else None
    if disk.layout == "fused" and fmt not in (None, QUANT_METHOD_CT):
        reason = (
            f"{model_type!r} checkpoints hold the experts fused ({', '.join(disk.fused)}): fp8kit writes quantized "
            "fused experts in --format compressed-tensors only"
        )
    if reason:
        raise ExportError(f"{reason}, or keep the experts in high precision with module_filter")
    return disk.linears, disk.block


QUANT_METHOD_CT = "compressed-tensors"


def checkpoint_key(key: str, block: str) -> str:
    """A model state-dict key as the checkpoint names it (``.mlp.`` -> ``.block_sparse_moe.`` for Mixtral)."""
    return key if block == "mlp" else key.replace(".mlp.", f".{block}.")


def model_key(key: str, block: str) -> str:
    """Inverse of ``checkpoint_key``."""
    return key if block == "mlp" else key.replace(f".{block}.", ".mlp.")


def _interleaved(module: nn.Module) -> bool:
    """Whether the fused ``gate_up`` holds gate and up in alternate rows (GPT-OSS), not in halves."""
    return module.has_gate and not getattr(module, "is_concatenated", True)


def _gate_up_rows(module: nn.Module, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up rows (dim 1) of a fused ``gate_up`` tensor ``(E, 2I, ...)``."""
    if _interleaved(module):
        return t[:, 0::2], t[:, 1::2]
    half = t.shape[1] // 2
    return t[:, :half], t[:, half:]


def _fuse_rows(module: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_gate_up_rows``."""
    if _interleaved(module):
        return torch.stack([gate, up], dim=2).flatten(1, 2)
    return torch.cat([gate, up], dim=1)


def _split(module: QuantExperts, p: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Projection ``p`` as ``(linear index (0 gate, 1 up, 2 down), codes (E, out, in), scale (E, out|1, 1))``."""
    codes, scale = module.weight_codes(p), module.weight_scale(p)
    if p == 1:
        return [(2, codes, scale)]
    if not module.has_gate:
        return [(1, codes, scale)]
    gate, up = _gate_up_rows(module, codes)
    if module.scheme.weight_strategy == "block":  # tile rows: gate's first, whole tiles (I % block == 0)
        if _interleaved(module):
            raise ExportError(f"{type(module).__name__}: a tile of the interleaved gate/up rows mixes gate and up")
        rows = gate.shape[1] // module.scheme.block
        return [(0, gate, scale[:, :rows]), (1, up, scale[:, rows:])]
    if scale.shape[1] == 1:  # one scale per expert for gate and up together
        return [(0, gate, scale), (1, up, scale)]
    return list(zip((0, 1), (gate, up), _gate_up_rows(module, scale), strict=True))


def _biases(module: QuantExperts) -> dict[int, torch.Tensor]:
    """The experts' biases by linear index (0 gate, 1 up, 2 down), each ``(E, out)``; empty without biases."""
    if not module.has_bias:
        return {}
    first, second = module.projections
    down = getattr(module, f"{second}_bias")
    if not module.has_gate:
        return {1: getattr(module, f"{first}_bias"), 2: down}
    gate, up = _gate_up_rows(module, getattr(module, f"{first}_bias"))
    return {0: gate, 1: up, 2: down}


def expert_tensors(
    model: nn.Module,
    name: str,
    module: QuantExperts,
    write: Callable[[str, torch.Tensor, torch.Tensor, Any], None],
    fmt: str,
) -> dict[str, torch.Tensor]:
    """Call ``write(prefix, codes (out, in), weight_scale, input_scale or None)`` for each expert's linear,
    ``prefix`` its checkpoint name (``model.layers.0.mlp.experts.3.gate_proj``) in the format ``fmt``;
    returns the experts' biases by checkpoint name (``PREFIX.bias``, high precision, written as they are)."""
    linears, block = experts_naming(model, fmt)
    base = checkpoint_key(f"{name}.", block)
    for p in range(2):
        input_scale = module.input_scale(p)
        for which, codes, scale in _split(module, p):
            for e in range(module.num_experts):
                write(f"{base}{e}.{linears[which]}", codes[e], scale[e], input_scale)
    return {
        f"{base}{e}.{linears[which]}.bias": b[e].clone()
        for which, b in _biases(module).items()
        for e in range(module.num_experts)
    }


def _fp4_split(module: QuantExperts, p: int) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """FP4 projection ``p`` as ``(linear index, packed codes (E, out, in / 2), block scales (E, out, in / b),
    NVFP4 per-tensor scales (E,) or None)``; the fused ``gate_up`` splits by rows, each part with its scale."""
    codes, scale, s2 = module.weight_codes(p), module.weight_scale(p), module.weight_scale_2(p)
    first = None if s2 is None else s2[:, 0]
    if p == 1:
        return [(2, codes, scale, first)]
    if not module.has_gate:
        return [(1, codes, scale, first)]
    last = None if s2 is None else s2[:, -1]
    (gate, up), (gate_scale, up_scale) = _gate_up_rows(module, codes), _gate_up_rows(module, scale)
    return [(0, gate, gate_scale, first), (1, up, up_scale, last)]


def fp4_expert_tensors(
    model: nn.Module,
    name: str,
    module: QuantExperts,
    write: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None],
    fmt: str,
) -> dict[str, torch.Tensor]:
    """``expert_tensors`` for FP4 experts: ``write(prefix, packed codes (out, in / 2), block scales,
    weight_scale_2 (0-d, NVFP4) or None, input_scale or None)`` for each expert's linear; returns the biases."""
    linears, block = experts_naming(model, fmt)
    base = checkpoint_key(f"{name}.", block)
    for p in range(2):
        input_scale = module.input_scale(p)
        for which, codes, scale, s2 in _fp4_split(module, p):
            for e in range(module.num_experts):
                write(f"{base}{e}.{linears[which]}", codes[e], scale[e], None if s2 is None else s2[e], input_scale)
    return {
        f"{base}{e}.{linears[which]}.bias": b[e].clone()
        for which, b in _biases(module).items()
        for e in range(module.num_experts)
    }


def expert_targets(model: nn.Module, name: str, fmt: str) -> str:
    """A ``re:`` target matching the per-expert linears of the experts module ``name`` in their checkpoint names
    (``model.layers.0.mlp.experts.E.gate_proj`` ...): how a config group of a mixed export targets it."""
    import re

    disk = experts_on_disk(model)
    if disk.layout == "fused":
        keys = [k.removesuffix(".weight") for k in fused_keys(name, disk)]
        return f"re:^({'|'.join(map(re.escape, keys))})$"
    linears, block = experts_naming(model, fmt)
    return f"re:^{re.escape(checkpoint_key(f'{name}.', block))}\\d+\\.({'|'.join(map(re.escape, linears))})$"


def fused_keys(name: str, disk: ExpertsOnDisk) -> tuple[str, str]:
    """The checkpoint keys of the experts module ``name``'s two fused weights (``"fused"`` layout)."""
    parent = name.rpartition(".")[0]
    return tuple(f"{parent}.{k}" if parent else k for k in disk.fused)  # type: ignore[return-value]


def fused_expert_tensors(name: str, module: QuantExperts, disk: ExpertsOnDisk) -> dict[str, torch.Tensor]:
    """An 8-bit ``QuantExperts``'s tensors in the ``"fused"`` layout: under each projection's checkpoint key
    ``K.weight`` the codes ``(E, out, in)``, ``K.weight_scale`` ``(E, out | 1, 1)`` and, for static schemes,
    ``K.input_scale`` ``(1,)``."""
    scheme = module.scheme
    if (
        scheme.is_fp4
        or scheme.weight_strategy == "block"
        or scheme.export_format == "pack-quantized"
        or module.has_bias
    ):
        raise ExportError(
            f"{name}: the checkpoint holds these experts fused ({', '.join(disk.fused)}); fp8kit writes fused experts "
            f"without biases in the 8-bit fp8/int8 W8A8 schemes only, not {scheme.name}: keep them in high precision "
            "with module_filter"
        )
    out = {}
    for p, key in enumerate(fused_keys(name, disk)):
        base = key.removesuffix("weight")
        out[key] = module.weight_codes(p).contiguous()
        out[f"{key}_scale"] = module.weight_scale(p).float().contiguous()
        if module.input_scale(p) is not None:
            out[f"{base}input_scale"] = module.input_scale(p).float().reshape(1).contiguous()
    return out


def load_fused_experts(
    model: nn.Module, path: Any, tensors: dict[str, torch.Tensor], scheme: Scheme, only: Collection[str] | None = None
) -> list[str]:
    """Make every experts module of ``model`` whose fused quantized tensors ``tensors`` holds (``"fused"`` layout,
    ``fused_expert_tensors``) a ``QuantExperts``, popping them; returns the module names."""
    from ..ptq.quantized import find_experts

    disk = experts_on_disk(model)
    names = []
    for name, module in find_experts(model).items():
        keys = fused_keys(name, disk)
        if (only is not None and name not in only) or f"{keys[0]}_scale" not in tensors:
            continue
        new: dict[str, torch.Tensor] = {}
        for p, key in enumerate(keys):
            proj, want = experts_projections(module)[p], _linear_shapes(module)[2 if p else 0]
            rows = want[0] * (2 if p == 0 and module.has_gate else 1)
            try:
                codes, scale = tensors.pop(key), tensors.pop(f"{key}_scale").float()
            except KeyError as err:
                raise ExportError(f"{path}: tensor {err.args[0]} is missing") from err
            if tuple(codes.shape) != (module.num_experts, rows, want[1]):
                raise ExportError(f"{path}: {key} has shape {tuple(codes.shape)}, the model needs (E, out, in)")
            new[proj] = codes.to(scheme.weight_format.dtype).contiguous()
            new[f"{proj}_weight_scale"] = scale.reshape(module.num_experts, -1, 1).contiguous()
            input_scale = tensors.pop(f"{key.removesuffix('weight')}input_scale", None)
            if scheme.static_activations:
                if input_scale is None:
                    raise ExportError(f"{path}: {key}: static scheme without input_scale")
                new[f"{proj}_input_scale"] = input_scale.float().reshape(1)
        install_quant_experts(module, scheme, new)
        names.append(name)
    return names


def has_expert_tensors(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint holds per-expert tensors (``...experts.0....``)."""
    return any(".experts.0." in k for k in tensors)


def has_fused_expert_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint holds quantized experts in the ``"fused"`` layout of ``model``'s architecture."""
    from ..ptq.quantized import find_experts

    found = find_experts(model)
    if not found:
        return False
    disk = experts_on_disk(model)
    return disk.layout == "fused" and any(f"{fused_keys(n, disk)[0]}_scale" in tensors for n in found)


def fuse_expert_tensors(module: nn.Module, state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Per-expert tensors in ``state`` (names relative to ``module``: ``experts.E.gate_proj.weight`` ...) into the
    fused 3-D parameters of ``module``'s ``transformers`` experts modules (``gate_up_proj`` ``(E, 2I, H)``, gate
    rows first, ``down_proj`` ``(E, H, I)``), in place; ``model`` gives the architecture's naming. Experts
    already fused in ``state`` (GPT-OSS keeps them so on disk) are left as they are."""
    from ..ptq.quantized import find_experts

    for name, m in find_experts(module).items():
        if not any(k.startswith(f"{name}.0.") for k in state):
            continue
        if getattr(m, "is_transposed", False) or not m.has_gate:
            raise ValueError(f"{type(m).__name__}: fp8kit fuses concatenated gate/up experts only")
        (gate, up, down), _ = experts_naming(model)

        def take(e: int, lin: str, name: str = name) -> torch.Tensor:
            return state.pop(f"{name}.{e}.{lin}.weight")

        n = m.num_experts
        state[f"{name}.gate_up_proj"] = torch.stack([torch.cat([take(e, gate), take(e, up)]) for e in range(n)])
        state[f"{name}.down_proj"] = torch.stack([take(e, down) for e in range(n)])


def _stored_experts(model: nn.Module, tensors: dict[str, torch.Tensor], fmt: str, only: Collection[str] | None):
    """The experts modules of ``model`` (``only`` these, if given) that ``tensors`` holds per expert: one kept in
    high precision is stored fused, as its parameters, and is left to the model's own loading."""
    from ..ptq.quantized import find_experts

    found = {n: m for n, m in find_experts(model).items() if only is None or n in only}
    if not found:
        return {}, ((), "mlp")
    linears, block = experts_naming(model, fmt)
    stored = {k.rsplit(".experts.", 1)[0] for k in tensors if ".experts.0." in k}
    kept = {n: m for n, m in found.items() if checkpoint_key(f"{n}.", block).rsplit(".experts.", 1)[0] in stored}
    return kept, (linears, block)


def _linear_shapes(module: nn.Module) -> dict[int, tuple[int, int]]:
    """Each expert linear's ``(out, in)`` by linear index (0 gate, 1 up, 2 down)."""
    w1 = getattr(module, experts_projections(module)[0])
    inter, hidden = (w1.shape[2], w1.shape[1]) if module.is_transposed else (w1.shape[1], w1.shape[2])
    if module.has_gate:
        inter //= 2
    return {0: (inter, hidden), 1: (inter, hidden), 2: (hidden, inter)}


def load_experts(
    model: nn.Module,
    path: Any,
    tensors: dict[str, torch.Tensor],
    scheme: Scheme,
    read: Callable[[str, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    fmt: str,
    only: Collection[str] | None = None,
) -> list[str]:
    """Make every experts module of ``model`` a ``QuantExperts`` from the per-expert tensors of a checkpoint in
    the format ``fmt``; ``read(prefix, out, in)`` pops one linear's ``(codes (out, in), weight_scale,
    input_scale or None)`` from ``tensors``, and the experts' ``PREFIX.bias`` are popped here. Per-expert input
    scales become their max (vLLM's semantics); block weight scales stay per tile (``(ceil(out / b),
    ceil(in / b))`` each). ``only``: just these experts modules (default all; those stored fused in high
    precision are skipped). Returns the module names."""
    found, (linears, block) = _stored_experts(model, tensors, fmt, only)
    names = []
    for name, module in found.items():
        base = checkpoint_key(f"{name}.", block)
        first, second = experts_projections(module)
        e = module.num_experts
        if scheme.weight_strategy == "block" and _interleaved(module):
            raise ExportError(f"{path}: {name}: a tile of the interleaved gate/up rows mixes gate and up")
        shapes = _linear_shapes(module)
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
        biases: dict[int, torch.Tensor] = {}
        wanted = (0, 1, 2) if module.has_gate else (1, 2)
        try:
            for which in wanted:
                prefixes = [f"{base}{i}.{linears[which]}" for i in range(e)]
                parts[which] = [read(prefix, *shapes[which]) for prefix in prefixes]
                if module.has_bias:
                    biases[which] = torch.stack([tensors.pop(f"{prefix}.bias").float() for prefix in prefixes])
        except KeyError as err:
            raise ExportError(f"{path}: tensor {err.args[0]} is missing") from err

        def stack(which: int, k: int, parts=parts) -> torch.Tensor:
            keep = k == 0 or scheme.weight_strategy == "block"
            return torch.stack([part[k] if keep else part[k].reshape(-1, 1) for part in parts[which]])

        def fuse(ts: list[torch.Tensor], module=module) -> torch.Tensor:
            return _fuse_rows(module, *ts) if len(ts) == 2 else ts[0]

        new: dict[str, torch.Tensor] = {}
        groups = {first: (0, 1) if module.has_gate else (1,), second: (2,)}
        for proj, whiches in groups.items():
            codes = fuse([stack(w, 0) for w in whiches])
            scales = [stack(w, 1) for w in whiches]
            if scheme.weight_strategy == "tensor":
                if len(scales) == 2 and not torch.equal(scales[0], scales[1]):
                    # gate and up with their own scales: requantize to one per expert (vLLM does the same)
                    deq = fuse([stack(w, 0).float() * s for w, s in zip(whiches, scales, strict=True)])
                    codes, scale = quantize_codes(deq, scheme)
                else:
                    scale = scales[0].reshape(e, 1, 1)
            elif scheme.weight_strategy == "block":
                scale = torch.cat(scales, dim=1)  # (E, tile rows of gate + up, tile cols)
            else:
                scale = fuse(scales).reshape(e, -1, 1)
            new[proj] = codes.to(scheme.weight_format.dtype).contiguous()
            new[f"{proj}_weight_scale"] = scale.float().contiguous()
            if scheme.static_activations:
                ins = [part[2] for w in whiches for part in parts[w]]
                if any(s is None for s in ins):
                    raise ExportError(f"{path}: {base}*.{proj}: static scheme without input_scale")
                new[f"{proj}_input_scale"] = torch.stack([s.float().reshape(()) for s in ins]).max().reshape(1)
            if module.has_bias:
                new[f"{proj}_bias"] = fuse([biases[w] for w in whiches]).contiguous()
        install_quant_experts(module, scheme, new)
        names.append(name)
    return names


def load_fp4_experts(
    model: nn.Module,
    path: Any,
    tensors: dict[str, torch.Tensor],
    scheme: Scheme,
    read: Callable[[str, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]],
    fmt: str,
    only: Collection[str] | None = None,
) -> list[str]:
    """``load_experts`` for FP4 experts: ``read(prefix, out, in)`` pops one linear's ``(packed codes (out, in / 2),
    block scales, NVFP4 per-tensor weight scale (fp8kit's ``amax / 2688``) or None, input scale or None)``, and the
    experts' ``PREFIX.bias`` are popped here. Gate and up with one per-tensor scale per expert keep ``(E, 1)``, with
    two ``(E, 2)`` (``ptq.experts``); per-expert input scales become their max (vLLM's semantics). ``only``: just
    these experts modules (default all; those stored fused in high precision are skipped). Returns the module
    names."""
    found, (linears, block) = _stored_experts(model, tensors, fmt, only)
    names = []
    for name, module in found.items():
        base = checkpoint_key(f"{name}.", block)
        first, second = experts_projections(module)
        e = module.num_experts
        shapes = _linear_shapes(module)
        new: dict[str, torch.Tensor] = {}
        groups = {first: (0, 1) if module.has_gate else (1,), second: (2,)}
        for proj, whiches in groups.items():
            prefixes = [[f"{base}{i}.{linears[w]}" for i in range(e)] for w in whiches]
            try:
                parts = [[read(prefix, *shapes[w]) for prefix in ps] for w, ps in zip(whiches, prefixes, strict=True)]
                biases = (
                    [torch.stack([tensors.pop(f"{prefix}.bias").float() for prefix in ps]) for ps in prefixes]
                    if module.has_bias
                    else []
                )
            except KeyError as err:
                raise ExportError(f"{path}: tensor {err.args[0]} is missing") from err

            def fuse(ts: list[torch.Tensor], module=module) -> torch.Tensor:
                return _fuse_rows(module, *ts) if len(ts) == 2 else ts[0]

            new[proj] = fuse([torch.stack([x[0] for x in part]) for part in parts]).contiguous()
            new[f"{proj}_weight_scale"] = fuse([torch.stack([x[1] for x in part]) for part in parts]).contiguous()
            if scheme.weight_strategy == "nvfp4":
                s2 = torch.stack([torch.stack([x[2].float().reshape(()) for x in part]) for part in parts], dim=1)
                new[f"{proj}_weight_scale_2"] = s2[:, :1].contiguous() if torch.equal(s2[:, :1], s2[:, -1:]) else s2
            if scheme.static_activations:
                ins = [x[3] for part in parts for x in part]
                if any(s is None for s in ins):
                    raise ExportError(f"{path}: {base}*.{proj}: static scheme without input scales")
                new[f"{proj}_input_scale"] = torch.stack([s.float().reshape(()) for s in ins]).max().reshape(1)
            if biases:
                new[f"{proj}_bias"] = fuse(biases).contiguous()
        install_quant_experts(module, scheme, new)
        names.append(name)
    return names


def _patch_table(quant_method: str, model: nn.Module) -> dict[str, nn.Module]:
    """transformers' quantization patch table (``MODULES_TO_PATCH_FOR_QUANTIZATION``): the modules of ``model``
    it replaces before it loads a ``quant_method`` checkpoint, each with the module it builds instead (on meta)."""
    try:
        from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION as table
    except ImportError:
        return {}
    out = {}
    for name, module in model.named_modules():
        spec = table.get(type(module).__name__)
        if spec and quant_method in spec["quantization_methods"]:
            with torch.device("meta"):
                out[name] = spec["module_name"](model.config.get_text_config())
    return out


def _patched_linears(name: str, module: nn.Module, patched: nn.Module) -> tuple[list[str], bool]:
    """The per-expert linear names ``(gate, up, down)`` of the module transformers builds in place of the experts
    module ``name``, and whether its fused ``gate_up_proj`` is stored ``(E, H, 2I)`` (transposed)."""
    linears = [(n, m) for n, m in patched[0].named_modules() if isinstance(m, nn.Linear)]
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if len(linears) != 3 or not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise ExportError(
            f"{name}: transformers replaces it by {type(patched).__name__}, whose layout fp8kit cannot map"
        )
    (g, gate), (u, up), (d, dn) = linears
    inter, hidden = gate.out_features, gate.in_features
    if (hidden, 2 * inter) == (2 * inter, hidden) or (up.out_features, dn.out_features) != (inter, hidden):
        raise ExportError(f"{name}: square or mismatched expert weights: fp8kit cannot tell their orientation")
    if tuple(gate_up.shape[1:]) not in ((hidden, 2 * inter), (2 * inter, hidden)):
        raise ExportError(f"{name}: gate_up_proj {tuple(gate_up.shape)} does not fit {type(patched).__name__}")
    return [g, u, d], tuple(gate_up.shape[1:]) == (hidden, 2 * inter)


def unfuse_patched_experts(model: nn.Module, tensors: dict[str, torch.Tensor], quant_method: str) -> list[str]:
    """High-precision experts modules that transformers replaces by per-expert linears before loading a
    ``quant_method`` checkpoint (its patch table; Llama 4's ``Llama4TextExperts`` under compressed-tensors): their
    fused ``gate_up_proj`` / ``down_proj`` in ``tensors`` become ``NAME.E.<gate|up|down linear>.weight`` as that
    module names them, in place. Returns the ``ignore`` targets for them (one ``re:`` per module name pattern)."""
    import re

    patterns = []
    for name, patched in _patch_table(quant_method, model).items():
        key = f"{name}.gate_up_proj"
        if key not in tensors:
            continue  # quantized by fp8kit, or not stored here
        module = model.get_submodule(name)
        (g, u, d), transposed = _patched_linears(name, module, patched)
        gate_up, down = tensors.pop(key), tensors.pop(f"{name}.down_proj")
        for e in range(gate_up.shape[0]):
            w = gate_up[e].t() if transposed else gate_up[e]  # (2I, H): gate rows, then up rows
            half = w.shape[0] // 2
            tensors[f"{name}.{e}.{g}.weight"] = w[:half].contiguous()
            tensors[f"{name}.{e}.{u}.weight"] = w[half:].contiguous()
            tensors[f"{name}.{e}.{d}.weight"] = (down[e].t() if transposed else down[e]).contiguous()
        pattern = "\\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split("."))
        patterns.append(f"re:^{pattern}\\.\\d+\\.({g}|{u}|{d})$")
    return list(dict.fromkeys(patterns))


def fuse_patched_experts(model: nn.Module, tensors: dict[str, torch.Tensor], quant_method: str) -> None:
    """Inverse of ``unfuse_patched_experts``, in place, for the experts modules whose per-expert tensors are there."""
    for name, patched in _patch_table(quant_method, model).items():
        module = model.get_submodule(name)
        (g, u, d), transposed = _patched_linears(name, module, patched)
        if f"{name}.0.{g}.weight" not in tensors:
            continue
        n = module.gate_up_proj.shape[0]
        try:
            w = [
                torch.cat([tensors.pop(f"{name}.{e}.{g}.weight"), tensors.pop(f"{name}.{e}.{u}.weight")])
                for e in range(n)
            ]
            down = [tensors.pop(f"{name}.{e}.{d}.weight") for e in range(n)]
        except KeyError as err:
            raise ExportError(f"tensor {err.args[0]} is missing") from err
        tensors[f"{name}.gate_up_proj"] = torch.stack([x.t() if transposed else x for x in w])
        tensors[f"{name}.down_proj"] = torch.stack([x.t() if transposed else x for x in down])
