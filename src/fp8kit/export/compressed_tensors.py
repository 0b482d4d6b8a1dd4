"""Save and load quantized models as Hugging Face directories in the compressed-tensors format.

This is the format vLLM serves and ``transformers`` (with the ``compressed-tensors`` package) loads:
``config.json`` carries a ``quantization_config`` with ``quant_method: "compressed-tensors"``, and
the safetensors files hold, for each quantized ``Linear`` named ``NAME``:

* ``float-quantized`` (FP8): ``NAME.weight`` (F8_E4M3), ``NAME.weight_scale`` (float32, ``(1,)`` per
  tensor or ``(out, 1)`` per channel) and, for static activations, ``NAME.input_scale`` (``(1,)``);
* ``int-quantized`` (INT8 W8A8): the same with an int8 ``NAME.weight``;
* ``pack-quantized`` (INT8 weight-only): ``NAME.weight_packed`` (int32, four offset-by-128 bytes per
  word, little-endian), ``NAME.weight_scale`` and ``NAME.weight_shape``;
* ``nvfp4-pack-quantized`` (``nvfp4``, ``nvfp4-weight-only``): ``NAME.weight_packed`` (uint8, two E2M1
  codes per byte, element ``2i`` in the low nibble), ``NAME.weight_scale`` (float8_e4m3fn, one per 1x16
  block), ``NAME.weight_global_scale`` and, for ``nvfp4``, ``NAME.input_global_scale`` (float32 ``(1,)``);
* ``mxfp4-pack-quantized`` (``mxfp4-weight-only``): ``NAME.weight_packed`` and ``NAME.weight_scale``
  (uint8 E8M0 exponents, one per 1x32 block).

An FP4 MoE expert's projection gets the same tensors under its per-expert name (``export.experts``).

A model whose layers mix schemes (``ptq.quantize(..., "auto")``) gets one config group per scheme, each targeting
its layers by their exact module names (an experts module: a ``re:`` over its per-expert linears' checkpoint
names), with its own ``format``; the top-level ``format`` is ``"mixed-precision"``
when the groups' formats differ. Loading gives each layer the scheme of the group that targets it.

compressed-tensors' global scales are the reciprocals of fp8kit's (and ModelOpt's) per-tensor dequant
multipliers: ``weight_global_scale = 2688 / amax = 1 / weight_scale_2`` and ``input_global_scale = 1 /
input_scale``, each a float32 reciprocal; dequantization is ``code * (weight_scale / weight_global_scale)``.
Reading one back takes the float32 reciprocal again, which returns fp8kit's value exactly when that value is
itself a float32 reciprocal (about 87% of values) and one ulp away otherwise.

Scales are dequant multipliers (``amax / 448`` for E4M3, ``amax / 127`` for INT8). An FP8 KV cache adds
``kv_cache_scheme`` and per-layer ``self_attn.k_scale`` / ``self_attn.v_scale``. Static FP8 attention
(``ptq.quantize(..., attention="fp8")``) is written as llm-compressor writes its attention scheme: a config group
``"attention"`` targeting the attention class (e.g. ``LlamaAttention``) with no weights and FP8 static
``input_activations`` (strategy ``tensor`` or ``attn_head``), the same arguments as ``kv_cache_scheme``, and
``self_attn.q_scale`` / ``k_scale`` / ``v_scale`` (``(1,)`` per tensor, ``(heads, 1, 1)`` per head: Q per query
head, K and V per key/value head), what vLLM's ``CompressedTensorsKVCacheMethod`` loads. The format has no P
scale. Loading reads JSON and safetensors only (nothing is unpickled).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..nn.linear_like import is_conv1d, linear_dims
from ..ptq.quantized import FP4_SCHEMES, SCHEMES, QuantLinear, Scheme
from .common import ExportError, load_layer, load_rest, model_from_config, producer, read_tensors, stored_codes
from .experts import (
    checkpoint_key,
    experts_naming,
    experts_on_disk,
    fuse_patched_experts,
    fused_expert_tensors,
    fused_keys,
    has_expert_tensors,
    has_fused_expert_tensors,
    load_experts,
    load_fp4_experts,
    load_fused_experts,
    model_key,
    transformers_refusal,
)

ATTENTION_GROUP = "attention"  # llm-compressor's name for the config group of its attention scheme

__all__ = [
    "MIXED_PRECISION",
    "QUANT_METHOD",
    "export_tensors",
    "load",
    "pack_int8",
    "quantization_config",
    "unpack_int8",
]

QUANT_METHOD = "compressed-tensors"


def _fp4_args(scheme: Scheme, which: str) -> dict[str, Any]:
    """An FP4 scheme's ``weights`` / ``input_activations`` as compressed-tensors 0.20 serializes its ``NVFP4``,
    ``NVFP4A16`` and ``MXFP4A16`` presets."""
    nvfp4 = scheme.weight_strategy == "nvfp4"
    args: dict[str, Any] = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 16 if nvfp4 else 32,
        "strategy": "tensor_group" if nvfp4 else "group",
        "dynamic": False,
        "scale_dtype": "torch.float8_e4m3fn" if nvfp4 else "torch.uint8",
    }
    if which != "weights":  # static per-tensor (global) scale, block scales at run time
        args.update(dynamic="local", observer="static_minmax")
    return args


def _args(scheme: Scheme, which: str) -> dict[str, Any] | None:
    fmt = scheme.weight_format if which == "weights" else scheme.act_format
    if fmt is None:
        return None
    if scheme.is_fp4:
        return _fp4_args(scheme, which)
    strategy = scheme.weight_strategy if which == "weights" else scheme.act_strategy
    dynamic = which != "weights" and strategy == "token"
    return {
        "num_bits": 8,
        "type": "float" if fmt.kind == "float" else "int",
        "symmetric": True,
        "strategy": strategy,
        "dynamic": dynamic,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": None if dynamic else "minmax",
        "observer_kwargs": {},
    }


TRANSFORMERS_REFUSAL = "transformers_cannot_load"  # config-group field: why transformers would load it wrong
MIXED_PRECISION = "mixed-precision"  # compressed-tensors' top-level format when the groups' formats differ


def _group(scheme: Scheme, targets: list[str]) -> dict[str, Any]:
    return {
        "targets": targets,
        "weights": _args(scheme, "weights"),
        "input_activations": _args(scheme, "input"),
        "output_activations": None,
        "format": scheme.export_format,
    }


def quantization_config(
    scheme: Scheme | Mapping[str, Scheme],
    ignore: list[str],
    kv_cache: bool,
    classes: tuple[str, ...] = ("Linear",),
    dequantize: bool = False,
    refusal: str | None = None,
    attention: tuple[list[str], str] | None = None,
) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json``: for one ``scheme`` (or a ``{layer: scheme}`` map whose
    layers share one group entry) one group targeting every layer of the ``classes`` (``Linear``, and ``Conv1D``
    where the model's quantized layers include ``transformers``' ``Conv1D``); for a map of several, one group per
    distinct entry (``group_0``, ``group_1``, ... in the order the layers come), each targeting its layers by
    their exact module names, with its own ``format``; the top-level ``format`` is the groups' one format, or
    ``"mixed-precision"`` when they differ (compressed-tensors' ``CompressionFormat.mixed_precision``).

    ``dequantize``: write ``dequantize: true``, which makes transformers dequantize every ``K.weight`` with its
    ``K.weight_scale`` as it loads (in the checkpoint's layout) instead of building compressed-tensors modules.
    The export sets it where quantized weights sit outside ``Linear`` modules (``Conv1D``'s ``(in, out)``
    weights, experts fused on disk): compressed-tensors quantizes ``Linear`` and ``Embedding`` modules only,
    and transformers would load those codes as raw values.

    ``refusal``: why transformers cannot load the checkpoint right, written at the top level as
    ``TRANSFORMERS_REFUSAL``, with the readers that can in the same field of every config group. compressed-tensors' ``QuantizationScheme`` forbids fields it does not know, so
    transformers (and any reader that validates the groups with compressed-tensors) stops with an error that
    quotes the reason, where it would otherwise load the weights wrong without a word; fp8kit's reader and
    readers that take a group's ``weights`` / ``input_activations`` field by field are unaffected.

    ``attention``: ``(attention classes, strategy)`` of static FP8 attention: adds llm-compressor's
    ``"attention"`` group (no weights, FP8 static input activations with ``strategy``), which ``kv_cache_scheme``
    repeats."""
    kv = None
    if kv_cache or attention:
        strategy = attention[1] if attention else "tensor"
        kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    layers = {"": scheme} if isinstance(scheme, Scheme) else dict(scheme)
    by_entry: dict[str, tuple[Scheme, list[str]]] = {}
    for name, s in layers.items():
        by_entry.setdefault(json.dumps(_group(s, [])), (s, []))[1].append(name)
    if not by_entry:
        raise ExportError("quantization_config needs at least one quantized layer")
    if len(by_entry) == 1:
        groups = [_group(next(iter(by_entry.values()))[0], list(classes))]
    else:
        groups = [_group(s, names) for s, names in by_entry.values()]
    if refusal:  # pydantic quotes at most ~50 characters of the value: the full reason goes at the top level
        groups = [{**g, TRANSFORMERS_REFUSAL: "use fp8kit load_pretrained or vLLM"} for g in groups]
    formats = {g["format"] for g in groups}
    flags = {"dequantize": True} if dequantize else {}
    config_groups: dict[str, Any] = {f"group_{i}": g for i, g in enumerate(groups)}
    if attention:
        config_groups[ATTENTION_GROUP] = {
            "targets": sorted(attention[0]),
            "weights": None,
            "input_activations": dict(kv),  # type: ignore[arg-type]
            "output_activations": None,
        }
    return {
        "quant_method": QUANT_METHOD,
        "format": formats.pop() if len(formats) == 1 else MIXED_PRECISION,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": kv,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "producer": producer(),
        **flags,
        **({TRANSFORMERS_REFUSAL: refusal} if refusal else {}),
    }


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``pack-quantized`` for 8 bits: ``code + 128`` bytes, four per int32 word."""
    rows, cols = codes.shape
    u = (codes.to(torch.int16) + 128).to(torch.uint8)
    pad = (-cols) % 4
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    return u.contiguous().view(torch.int32)


def unpack_int8(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of ``pack_int8`` (little-endian bytes of each int32 word)."""
    u = packed.contiguous().view(torch.uint8)[:, :cols]
    return (u.to(torch.int16) - 128).to(torch.int8)


def _matches(name: str, module: nn.Module, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p in {c.__name__ for c in type(module).__mro__} or name == p or name.endswith(f".{p}"):
            return True
    return False


def _fp4_scheme_of(w: dict[str, Any], a: dict[str, Any] | None, fmt: str) -> Scheme:
    """The FP4 scheme of an ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` group (weights as compressed-tensors'
    NVFP4 / MXFP4 presets; activations none, or NVFP4's static global scale with dynamic local scales)."""
    nvfp4 = fmt == "nvfp4-pack-quantized"
    want = ("tensor_group", 16) if nvfp4 else ("group", 32)
    if (w.get("type"), w.get("strategy"), w.get("group_size")) != ("float", *want) or not w.get("symmetric", True):
        raise ExportError(
            f"unsupported {fmt} weights {w}: fp8kit loads symmetric E2M1 in {want[0]} blocks of {want[1]}"
        )
    if a is None:
        return FP4_SCHEMES["nvfp4-weight-only" if nvfp4 else "mxfp4-weight-only"]
    fits = (a.get("num_bits"), a.get("type"), a.get("strategy"), a.get("group_size"), a.get("dynamic"))
    if nvfp4 and fits == (4, "float", "tensor_group", 16, "local"):
        return FP4_SCHEMES["nvfp4"]
    raise ExportError(
        f"unsupported {fmt} activations {a}: fp8kit loads none or NVFP4 (a static global scale, dynamic local scales)"
    )


def _scheme_of(group: dict[str, Any], fmt: str) -> Scheme:
    w, a = group.get("weights"), group.get("input_activations")
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized") and w:
        return _fp4_scheme_of(w, a, fmt)
    if (
        not w
        or w.get("num_bits") != 8
        or not w.get("symmetric", True)
        or w.get("strategy") not in ("tensor", "channel")
    ):
        raise ExportError(f"unsupported weight quantization {w}: fp8kit loads 8-bit symmetric per-tensor/channel")
    wtype = w.get("type")
    for s in SCHEMES.values():
        if (s.weight_format.kind == wtype) and s.export_format == fmt:
            if a is None and s.act_format is None:
                return dataclasses.replace(s, weight_strategy=w["strategy"])
            if a is not None and s.act_format is not None and a.get("type") == s.act_format.kind:
                strat = "token" if a.get("dynamic") else a.get("strategy")
                if strat == s.act_strategy:
                    return Scheme(
                        s.name, s.weight_format, w["strategy"], s.act_format, strat, s.smooth, fmt, s.description
                    )
    raise ExportError(f"unsupported compressed-tensors scheme (format {fmt!r}, weights {w}, activations {a})")


def _write_linear(
    tensors: dict[str, torch.Tensor],
    scheme: Scheme,
    name: str,
    codes: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
) -> None:
    """One quantized linear's tensors under ``name`` (``weight`` or ``weight_packed`` + ``weight_shape``,
    ``weight_scale`` ``(1,)`` or ``(out, 1)``, ``input_scale`` ``(1,)``); ``codes`` as the checkpoint stores them
    (``(in, out)`` for a ``Conv1D``, whose scheme there is per tensor)."""
    out_features, in_features = codes.shape
    if scheme.export_format == "pack-quantized":
        tensors[f"{name}.weight_packed"] = pack_int8(codes)
        tensors[f"{name}.weight_shape"] = torch.tensor([out_features, in_features])
    else:
        tensors[f"{name}.weight"] = codes.clone(memory_format=torch.contiguous_format)  # experts: own storage
    per_channel = scheme.weight_strategy == "channel"
    shape = (out_features, 1) if per_channel else (1,)
    tensors[f"{name}.weight_scale"] = weight_scale.float().reshape(shape).clone()
    if input_scale is not None:
        tensors[f"{name}.input_scale"] = input_scale.float().reshape(1).clone()


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """The float32 reciprocal of a ``(1,)`` per-tensor scale: compressed-tensors' global scale <-> fp8kit's."""
    return (1.0 / t.float()).reshape(1).contiguous()


def _write_fp4(
    tensors: dict[str, torch.Tensor],
    name: str,
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    weight_scale_2: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> None:
    """One FP4 linear's tensors under ``name`` (module doc; a ``QuantLinear`` or one expert's projection): the
    packed codes and block scales as held, the per-tensor scales as compressed-tensors' reciprocal global scales."""
    tensors[f"{name}.weight_packed"] = packed.clone(memory_format=torch.contiguous_format)  # experts: own storage
    tensors[f"{name}.weight_scale"] = block_scales.clone(memory_format=torch.contiguous_format)
    if weight_scale_2 is not None:
        tensors[f"{name}.weight_global_scale"] = _reciprocal(weight_scale_2)
    if input_scale is not None:
        tensors[f"{name}.input_global_scale"] = _reciprocal(input_scale)


def _read_fp4(
    tensors: dict[str, torch.Tensor], name: str, codes_shape: tuple, scale_dtype: torch.dtype, where: Path
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``_write_fp4``'s tensors under ``name`` (or another producer's of the layout): ``(packed codes, block
    scales, weight_scale_2 or None, input_scale or None)``, the per-tensor scales as fp8kit's multipliers."""
    packed = stored_codes(tensors.pop(f"{name}.weight_packed"), torch.uint8, f"{where}: {name}.weight_packed")
    scale = stored_codes(tensors.pop(f"{name}.weight_scale"), scale_dtype, f"{where}: {name}.weight_scale")
    rows, cols = codes_shape
    block = 16 if scale_dtype == torch.float8_e4m3fn else 32
    if tuple(packed.shape) != (rows, cols // 2) or tuple(scale.shape) != (rows, cols // block):
        raise ExportError(
            f"{where}: {name} holds codes {tuple(packed.shape)} and scales {tuple(scale.shape)}; the layer needs "
            f"{(rows, cols // 2)} and {(rows, cols // block)}"
        )
    s2, s_in = tensors.pop(f"{name}.weight_global_scale", None), tensors.pop(f"{name}.input_global_scale", None)
    return packed, scale, None if s2 is None else _reciprocal(s2), None if s_in is None else _reciprocal(s_in)


def _read_fp4_linear(tensors: dict[str, torch.Tensor], name: str, q: QuantLinear, where: Path) -> None:
    """Fill an FP4 ``QuantLinear`` from ``_write_fp4``'s tensors."""
    shape = (q.out_features, q.in_features)
    q.weight, q.weight_scale, s2, s_in = _read_fp4(tensors, name, shape, q.weight_scale.dtype, where)
    if q.weight_scale_2 is not None:
        if s2 is None:
            raise KeyError(f"{name}.weight_global_scale")
        q.weight_scale_2 = s2
    if q.scheme.static_activations:
        if s_in is None:
            raise KeyError(f"{name}.input_global_scale")
        q.input_scale = s_in


def export_tensors(
    model: nn.Module,
    qlayers: dict[str, QuantLinear],
    ignore: list[str],
    kv: dict[str, nn.Module],
    experts: dict[str, nn.Module] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The quantized layers' tensors, each in its own scheme's layout, the MoE experts' per-expert tensors in the
    architecture's checkpoint naming (``export.experts``), the attention blocks' k/v scales (``kv``: FP8 KV
    cache) and the ``quantization_config`` (one group per scheme, ``quantization_config``)."""
    from .experts import expert_targets, expert_tensors, fp4_expert_tensors

    experts = experts or {}
    schemes = {name: m.scheme for name, m in qlayers.items()}
    schemes.update({expert_targets(model, name, QUANT_METHOD): m.scheme for name, m in experts.items()})
    tensors: dict[str, torch.Tensor] = {}
    for name, q in qlayers.items():
        if q.scheme.is_fp4:
            _write_fp4(tensors, name, q.weight, q.weight_scale, q.weight_scale_2, q.input_scale)
        else:
            codes = q.weight.t() if getattr(q, "checkpoint_transposed", False) else q.weight  # Conv1D: (in, out)
            _write_linear(tensors, q.scheme, name, codes, q.weight_scale, q.input_scale)
        if q.bias is not None:
            tensors[f"{name}.bias"] = q.bias.contiguous()
    fused = bool(experts) and experts_on_disk(model).layout == "fused"
    for name, m in experts.items():
        if fused:
            tensors.update(fused_expert_tensors(name, m, experts_on_disk(model)))
        elif m.scheme.is_fp4:
            tensors.update(fp4_expert_tensors(model, name, m, partial(_write_fp4, tensors), QUANT_METHOD))
        else:
            tensors.update(expert_tensors(model, name, m, partial(_write_linear, tensors, m.scheme), QUANT_METHOD))
    attention = _attention_tensors(tensors, kv)
    for name, m in kv.items():
        if attention is None:
            tensors[f"{name}.k_scale"] = m.k_scale.float().reshape(1).contiguous()
            tensors[f"{name}.v_scale"] = m.v_scale.float().reshape(1).contiguous()
    conv1d = any(getattr(q, "checkpoint_transposed", False) for q in qlayers.values())
    classes = ("Linear", "Conv1D") if conv1d else ("Linear",)
    refusal = transformers_refusal(model) if experts else None
    return tensors, quantization_config(
        schemes, ignore, bool(kv), classes, dequantize=conv1d, refusal=refusal, attention=attention
    )


def _attention_tensors(tensors: dict[str, torch.Tensor], kv: dict[str, nn.Module]) -> tuple[list[str], str] | None:
    """Write the static FP8 attention blocks' ``q_scale`` / ``k_scale`` / ``v_scale`` into ``tensors``; return
    ``(attention classes, strategy)``, or None where no block of ``kv`` has static FP8 attention."""
    from ..nn.attention import block_static_scales

    static = {name: block_static_scales(m) for name, m in kv.items()}
    if not any(v is not None for v in static.values()):
        return None
    if any(v is None for v in static.values()):
        raise ExportError("some attention blocks have static FP8 attention and others an FP8 KV cache only: use one")
    strategies = {"attn_head" if v["q"].numel() > 1 else "tensor" for v in static.values() if v is not None}
    if len(strategies) > 1:
        raise ExportError("the attention blocks mix per-tensor and per-head scales: compressed-tensors takes one")
    strategy = strategies.pop()
    for name, scales in static.items():
        for op in ("q", "k", "v"):
            d = scales[op].float()  # type: ignore[index]
            tensors[f"{name}.{op}_scale"] = d.reshape((-1, 1, 1) if strategy == "attn_head" else (1,)).contiguous()
    return sorted({type(m).__name__ for m in kv.values()}), strategy


def _rank(name: str, module: nn.Module, target: str) -> int | None:
    """How closely ``target`` matches the layer ``name``, as compressed-tensors ranks a layer's matching targets:
    0 its exact name, 1 a ``re:`` regex, 2 its class name (or, leniently, a ``.``-suffix of its name); ``None``
    when it does not match."""
    if target == name:
        return 0
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) else None
    return 2 if _matches(name, module, [target]) else None


def _layer_groups(model: nn.Module, groups: list[tuple[list[str], Scheme]], ignore: list[str]) -> dict[str, Scheme]:
    """Each ``nn.Linear`` or ``Conv1D`` a config group targets (and ``ignore`` does not) -> that group's scheme; a
    layer several
    groups target takes the most specific match (``_rank``), the later group among equals (compressed-tensors'
    target -> scheme map keeps the last)."""
    out: dict[str, Scheme] = {}
    for name, m in model.named_modules():
        if not (isinstance(m, nn.Linear) or is_conv1d(m)) or _matches(name, m, ignore):
            continue
        scheme = _group_of(name, m, groups)
        if scheme is not None:
            out[name] = scheme
    return out


def _group_of(name: str, module: nn.Module, groups: list[tuple[list[str], Scheme]]) -> Scheme | None:
    """The scheme of the config group whose targets match ``name`` most specifically (``_rank``), the later group
    among equals (compressed-tensors' target -> scheme map keeps the last); ``None`` if none matches."""
    best: tuple[int, Scheme] | None = None
    for targets, scheme in groups:
        ranks = [r for r in (_rank(name, module, t) for t in targets) if r is not None]
        if ranks and (best is None or min(ranks) <= best[0]):
            best = (min(ranks), scheme)
    return None if best is None else best[1]


def load(path: Path, raw: dict[str, Any], dtype: torch.dtype) -> tuple[nn.Module, str, list[str], dict, bool]:
    """A compressed-tensors directory (fp8kit's or another tool's) in ``QuantLinear``s, each layer in the scheme of
    the config group that targets it: returns the model, the scheme name (``"auto"`` when the layers' schemes
    differ), the quantized layer names, the k/v (and static attention's q) scales by attention block and whether
    the export has an FP8 KV cache."""
    qc = raw["quantization_config"]
    top = qc.get("format")
    groups = []
    for key, g in (qc.get("config_groups") or {}).items():
        if g.get("weights") is None and g.get("input_activations") is not None:
            continue  # an attention group (llm-compressor's): its q/k/v scales load as FP8 attention
        fmt = g.get("format") or top
        if fmt == MIXED_PRECISION:
            raise ExportError(f"{path}: config group {key} has no format of its own under the {MIXED_PRECISION} format")
        groups.append((g.get("targets") or ["Linear"], _scheme_of(g, fmt)))
    if not groups:
        raise ExportError(f"{path}: the compressed-tensors config has no config_groups (nothing is quantized)")
    model = model_from_config(path, raw, dtype)
    tensors = read_tensors(path)
    layer_schemes = _layer_groups(model, groups, qc.get("ignore") or [])
    names = list(layer_schemes)
    used = {s.name for _, s in groups}

    def build(name: str, lin: nn.Module) -> QuantLinear:
        scheme = layer_schemes[name]
        in_features, out_features = linear_dims(lin)
        q = QuantLinear(in_features, out_features, lin.bias is not None, scheme)
        transposed = q.checkpoint_transposed = is_conv1d(lin)  # Conv1D: stored (in, out)
        if transposed and (scheme.is_fp4 or scheme.weight_strategy != "tensor"):
            raise ExportError(
                f"{path}: {name} is a Conv1D (weight stored (in, out)) in a {scheme.weight_strategy} weight group: "
                "fp8kit reads Conv1D weights with one scale per tensor"
            )
        if scheme.is_fp4:
            _read_fp4_linear(tensors, name, q, path)
            if lin.bias is not None:
                q.bias = tensors.pop(f"{name}.bias").float()
            return q
        if scheme.export_format == "pack-quantized":
            q.weight = unpack_int8(tensors.pop(f"{name}.weight_packed"), out_features if transposed else in_features)
            tensors.pop(f"{name}.weight_shape", None)
        else:
            q.weight = stored_codes(tensors.pop(f"{name}.weight"), scheme.weight_format.dtype, f"{path}: {name}.weight")
        if transposed:
            q.weight = q.weight.t().contiguous()
        q.weight_scale = tensors.pop(f"{name}.weight_scale").float().reshape(q.weight_scale.shape)
        if scheme.static_activations:
            q.input_scale = tensors.pop(f"{name}.input_scale").float().reshape(1)
        if lin.bias is not None:
            q.bias = tensors.pop(f"{name}.bias").float()
        return q

    for name in names:
        load_layer(model, path, name, lambda lin, name=name: build(name, lin))
    experts: list[str] = []
    for scheme, modules in _experts_groups(model, groups, tensors).items():
        experts += _load_experts(model, path, tensors, scheme, modules)
    names += experts
    if experts:
        _, block = experts_naming(model)
        tensors = {model_key(k, block): v for k, v in tensors.items()}
    kv_scales = {k: tensors.pop(k) for k in list(tensors) if k.endswith((".k_scale", ".v_scale", ".q_scale"))}
    for k in [k for k in tensors if k.endswith((".k_zero_point", ".v_zero_point", ".q_zero_point"))]:
        del tensors[k]  # symmetric scales: llm-compressor may write zeros
    fuse_patched_experts(model, tensors, QUANT_METHOD)
    load_rest(model, path, tensors, names, dtype)
    return model, used.pop() if len(used) == 1 else "auto", names, kv_scales, bool(qc.get("kv_cache_scheme"))


def _experts_groups(
    model: nn.Module, groups: list[tuple[list[str], Scheme]], tensors: dict[str, torch.Tensor]
) -> dict[Scheme, list[str]]:
    """The MoE experts modules with per-expert tensors, by the scheme of the config group that targets their
    per-expert linears (one group: every experts module; a mix: as ``_layer_groups`` ranks the targets of expert
    0's first linear, in its checkpoint name)."""
    from ..ptq.quantized import find_experts

    stored = has_expert_tensors(tensors) or has_fused_expert_tensors(model, tensors)
    found = find_experts(model) if stored else {}
    if not found:
        return {}
    if len(groups) == 1:
        return {groups[0][1]: list(found)}
    disk = experts_on_disk(model)
    linears, block = experts_naming(model, QUANT_METHOD)
    probe = nn.Linear(1, 1, bias=False)  # a per-expert linear: class targets ("Linear") match it
    out: dict[Scheme, list[str]] = {}
    for name in found:
        key = f"{checkpoint_key(f'{name}.', block)}0.{linears[-1]}"
        if disk.layout == "fused":
            key = fused_keys(name, disk)[1].removesuffix(".weight")
        scheme = _group_of(key, probe, groups)
        if scheme is not None:
            out.setdefault(scheme, []).append(name)
    return out


def _load_experts(model: nn.Module, path: Path, tensors: dict[str, torch.Tensor], scheme: Scheme, only: list[str]):
    """The experts modules ``only`` as ``QuantExperts`` in ``scheme``, from their per-expert (or fused) tensors."""
    fmt = scheme.export_format
    if has_fused_expert_tensors(model, tensors):
        return load_fused_experts(model, path, tensors, scheme, only)

    def read_expert(key: str, out_features: int, in_features: int):
        if fmt == "pack-quantized":
            codes = unpack_int8(tensors.pop(f"{key}.weight_packed"), in_features)
            tensors.pop(f"{key}.weight_shape", None)
        else:
            codes = stored_codes(tensors.pop(f"{key}.weight"), scheme.weight_format.dtype, f"{path}: {key}.weight")
        if tuple(codes.shape) != (out_features, in_features):
            raise ExportError(
                f"{path}: {key} has shape {tuple(codes.shape)}, the model needs {(out_features, in_features)}"
            )
        scale = tensors.pop(f"{key}.weight_scale").float()
        input_scale = tensors.pop(f"{key}.input_scale", None)
        return codes, scale, input_scale

    def read_fp4_expert(key: str, out_features: int, in_features: int):
        scale_dtype = torch.float8_e4m3fn if scheme.weight_strategy == "nvfp4" else torch.uint8
        return _read_fp4(tensors, key, (out_features, in_features), scale_dtype, path)

    if scheme.is_fp4:
        return load_fp4_experts(model, path, tensors, scheme, read_fp4_expert, QUANT_METHOD, only)
    return load_experts(model, path, tensors, scheme, read_expert, QUANT_METHOD, only)
