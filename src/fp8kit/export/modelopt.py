"""NVIDIA ModelOpt's unified Hugging Face checkpoint (``quant_method: "modelopt"``): what TensorRT-LLM
builds engines from, and what vLLM and SGLang load.

The layout follows what ``modelopt.torch.export.export_hf_checkpoint`` (ModelOpt 0.47) writes for the
same model (the tests hold the two side by side). For each quantized ``Linear`` named ``NAME``:

============================  =============================  ======================================
fp8kit scheme                 ``quant_algo``                 tensors beside ``NAME.weight``
============================  =============================  ======================================
``fp8``                       ``FP8``                        ``weight_scale`` ``()``, ``input_scale`` ``()``
``fp8-dynamic``               ``FP8_PER_CHANNEL_PER_TOKEN``  ``weight_scale`` ``(out,)``
``int8-smoothquant``          ``W8A8_SQ_PER_CHANNEL``        ``weight_scale`` ``(out,)``, ``input_scale`` ``()``,
                                                             ``pre_quant_scale`` ``(in,)``
``int8-weight-only``          ``W8A16``                      ``weight_scale`` ``(out,)``
``fp8-block``                 ``fp8_pb_wo``                  ``weight_scale`` ``(out/128, 1, in/128, 1)``
``nvfp4``                     ``NVFP4``                      ``weight_scale`` ``(out, in/16)`` E4M3,
                                                             ``weight_scale_2`` ``()``, ``input_scale`` ``()``
``nvfp4-weight-only``         ``W4A16_NVFP4``                ``weight_scale`` ``(out, in/16)`` E4M3,
                                                             ``weight_scale_2`` ``()``
============================  =============================  ======================================

Weights are ``float8_e4m3fn`` (FP8) or ``int8``; every scale is a float32 dequant multiplier
(``amax / 448``, ``amax / 127``). NVFP4 weights are uint8, two E2M1 codes per byte (element ``2i`` in the low
nibble), with E4M3 block scales under the per-tensor ``weight_scale_2 = amax / 2688``; W4A4's
``input_scale`` is the activations' per-tensor scale ``amax / 2688`` (the 1x16 block scales are computed at
run time); ``hf_quant_config.json`` adds ``"group_size": 16``. MXFP4 is not written: ModelOpt's ``mxfp4``
also quantizes the activations, which ``mxfp4-weight-only`` does not. ``pre_quant_scale`` multiplies the input before it is quantized:
fp8kit folds SmoothQuant into the preceding layer, so it writes ones. ``fp8_pb_wo`` is ModelOpt's only
128x128-block FP8 format and is weight-only: serving keeps the activations in high precision. An FP8 KV
cache adds ``ATTN.k_proj.k_scale`` and ``ATTN.v_proj.v_scale`` (``()``, ``amax / 448``); static FP8 attention
(per tensor) adds ``ATTN.q_scale`` (``()``): ModelOpt's own export drops its ``q_bmm_quantizer`` amax (only the K
and V quantizers' become ``k_scale`` / ``v_scale``), and vLLM maps ``self_attn.q_scale`` to its attention
layer's ``q_scale`` under any quantization method. MoE experts get
the same tensors per expert (``export.experts``), NVFP4 included.

``hf_quant_config.json`` holds ``{"producer", "quantization": {"quant_algo", "kv_cache_quant_algo",
"exclude_modules"}}`` and ``config.json``'s ``quantization_config`` the same in ModelOpt's
compressed-tensors-like form (``config_groups`` for ``FP8`` only, ``ignore``, ``kv_cache_scheme``). A model
whose layers mix schemes (``ptq.quantize(..., "auto")``) is written as ModelOpt writes ``auto_quantize``'s:
``"quant_algo": "MIXED_PRECISION"`` and ``"quantized_layers": {NAME: {"quant_algo", "group_size" (NVFP4)}}``,
each layer's tensors as above, ``config.json`` a config group per distinct layer config.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..nn.attention import block_static_scales
from ..ptq.quantized import SCHEMES, QuantLinear, get_scheme
from .block_linear import BlockQuantLinear
from .common import ExportError, load_layer, load_rest, model_from_config, producer, read_tensors, stored_codes
from .experts import experts_naming, has_expert_tensors, load_experts, load_fp4_experts, model_key
from .support import BLOCK_SCHEME, MODELOPT_ALGOS

__all__ = ["HF_QUANT_CONFIG", "QUANT_METHOD", "export_tensors", "hf_quant_config", "load", "quantization_config"]

QUANT_METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"
_SCHEME_OF = {algo: scheme for scheme, algo in MODELOPT_ALGOS.items()}
_NVFP4 = ("nvfp4", "nvfp4-weight-only")
NVFP4_GROUP = 16
MIXED_PRECISION = "MIXED_PRECISION"  # ModelOpt's quant_algo for a scheme per layer (auto_quantize)


def hf_quant_config(scheme: str | Mapping[str, str], exclude: list[str], kv: bool) -> dict[str, Any]:
    """``hf_quant_config.json`` (the file TensorRT-LLM reads) for one ``scheme``, or for a ``{layer: scheme}`` map:
    one scheme as that scheme; several as ModelOpt writes an ``auto_quantize`` mix (``MIXED_PRECISION``, each
    layer's ``quant_algo`` and NVFP4's ``group_size`` under ``quantized_layers``, no ``exclude_modules``)."""
    layers = {} if isinstance(scheme, str) else dict(scheme)
    used = set(layers.values()) or {scheme}
    if len(used) == 1:
        one = used.pop()
        return {
            "producer": producer(),
            "quantization": {
                "quant_algo": MODELOPT_ALGOS[one],
                "kv_cache_quant_algo": "FP8" if kv else None,
                **({"group_size": NVFP4_GROUP} if one in _NVFP4 else {}),
                "exclude_modules": sorted(exclude),
            },
        }
    return {
        "producer": producer(),
        "quantization": {
            "quant_algo": MIXED_PRECISION,
            "kv_cache_quant_algo": "FP8" if kv else None,
            "quantized_layers": {
                name: {"quant_algo": MODELOPT_ALGOS[s], **({"group_size": NVFP4_GROUP} if s in _NVFP4 else {})}
                for name, s in layers.items()
            },
        },
    }


# quant_algo -> its compressed-tensors-like config group, as ModelOpt 0.47's ``_quant_algo_to_group_config``
_FP8_ARGS = {"dynamic": False, "num_bits": 8, "type": "float"}
_FP4_ARGS = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
_INT8_CHANNEL = {"dynamic": False, "num_bits": 8, "type": "int", "strategy": "channel"}
_GROUP_OF_ALGO: dict[str, dict[str, Any]] = {
    "FP8": {"input_activations": _FP8_ARGS, "weights": _FP8_ARGS},
    "FP8_PER_CHANNEL_PER_TOKEN": {"input_activations": _FP8_ARGS, "weights": {**_FP8_ARGS, "strategy": "channel"}},
    "W8A16": {"weights": {"dynamic": False, "num_bits": 8, "type": "int"}},
    "W8A8_SQ_PER_CHANNEL": {
        "input_activations": {"dynamic": False, "num_bits": 8, "type": "int"},
        "weights": _INT8_CHANNEL,
    },
    "NVFP4": {"input_activations": _FP4_ARGS, "weights": _FP4_ARGS},
    "W4A16_NVFP4": {"weights": _FP4_ARGS},
}


def quantization_config(hf_quant: dict[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``, as ModelOpt derives it from ``hf_quant_config.json``
    (``MIXED_PRECISION``: a config group per distinct layer config, targeting its layers, and the
    ``quantized_layers`` themselves)."""
    q = hf_quant["quantization"]
    out: dict[str, Any] = {}
    if q["quant_algo"] == "FP8":
        fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
        out["config_groups"] = {"group_0": {"input_activations": fp8, "weights": dict(fp8), "targets": ["Linear"]}}
    elif q["quant_algo"] in ("NVFP4", "W4A16_NVFP4"):
        fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP}
        group: dict[str, Any] = {"input_activations": dict(fp4)} if q["quant_algo"] == "NVFP4" else {}
        out["config_groups"] = {"group_0": {**group, "weights": fp4, "targets": ["Linear"]}}
    elif q["quant_algo"] == MIXED_PRECISION:
        by_cfg: dict[str, list[str]] = {}
        for name, cfg in q["quantized_layers"].items():
            by_cfg.setdefault(json.dumps(sorted(cfg.items())), []).append(name)
        out["config_groups"] = {
            f"group_{i}": {
                **copy.deepcopy(_GROUP_OF_ALGO[q["quantized_layers"][names[0]]["quant_algo"]]),
                "targets": sorted(names),
            }
            for i, names in enumerate(by_cfg.values())
        }
        out["quantized_layers"] = q["quantized_layers"]
    out["ignore"] = list(q.get("exclude_modules") or [])
    out["quant_algo"] = q["quant_algo"]
    if q.get("kv_cache_quant_algo") == "FP8":
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = QUANT_METHOD
    return out


def _write_linear(
    tensors: dict[str, torch.Tensor],
    scheme: str,
    name: str,
    codes: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
) -> None:
    """One ``QuantLinear``'s tensors under ``name`` (also one expert's projection): ``weight``, ``weight_scale``
    (``()`` per tensor, ``(out,)`` per channel) and ``input_scale`` ``()``."""
    tensors[f"{name}.weight"] = codes.clone(memory_format=torch.contiguous_format)  # experts: own storage
    per_channel = weight_scale.numel() > 1
    tensors[f"{name}.weight_scale"] = weight_scale.float().reshape(-1 if per_channel else ()).clone()
    if input_scale is not None:
        tensors[f"{name}.input_scale"] = input_scale.float().reshape(()).clone()


def _write_nvfp4(
    tensors: dict[str, torch.Tensor],
    name: str,
    packed: torch.Tensor,
    block_scales: torch.Tensor,
    weight_scale_2: torch.Tensor,
    input_scale: torch.Tensor | None,
) -> None:
    """One NVFP4 linear's tensors under ``name`` (a ``QuantLinear`` or one expert's projection): ``weight``
    (packed), ``weight_scale`` (E4M3 blocks), ``weight_scale_2`` ``()`` and W4A4's ``input_scale`` ``()``."""
    tensors[f"{name}.weight"] = packed.clone(memory_format=torch.contiguous_format)  # experts: own storage
    tensors[f"{name}.weight_scale"] = block_scales.clone(memory_format=torch.contiguous_format)
    tensors[f"{name}.weight_scale_2"] = weight_scale_2.float().reshape(()).clone()
    if input_scale is not None:
        tensors[f"{name}.input_scale"] = input_scale.float().reshape(()).clone()


def export_tensors(
    model: nn.Module,
    qlayers: dict[str, nn.Module],
    scheme: str,
    ignore: list[str],
    kv: dict[str, nn.Module],
    experts: dict[str, nn.Module] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, dict[str, Any]]]:
    """The quantized layers' tensors, each in its own scheme's layout, the MoE experts' per-expert tensors
    (``export.experts``; ModelOpt writes the same names), ``config.json``'s ``quantization_config`` and the extra
    JSON files (``MIXED_PRECISION`` when the layers' schemes differ)."""
    from .experts import expert_tensors, fp4_expert_tensors

    experts = experts or {}
    layers = {n: getattr(m, "scheme", None) for n, m in {**qlayers, **experts}.items()}
    layers = {n: BLOCK_SCHEME if s is None else s.name for n, s in layers.items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, q in qlayers.items():
        if isinstance(q, QuantLinear) and q.scheme.is_fp4:
            _write_nvfp4(tensors, name, q.weight, q.weight_scale, q.weight_scale_2, q.input_scale)
        elif isinstance(q, BlockQuantLinear):
            tensors[f"{name}.weight"] = q.weight.contiguous()
            r, c = q.weight_scale_inv.shape
            tensors[f"{name}.weight_scale"] = q.weight_scale_inv.float().reshape(r, 1, c, 1).contiguous()
        else:
            _write_linear(tensors, layers[name], name, q.weight, q.weight_scale, getattr(q, "input_scale", None))
            if layers[name] == "int8-smoothquant":  # ModelOpt writes it for Linear layers (not for experts)
                tensors[f"{name}.pre_quant_scale"] = torch.ones(q.in_features)
        if q.bias is not None:
            tensors[f"{name}.bias"] = q.bias.contiguous()
    for name, m in experts.items():
        if scheme in _NVFP4:
            tensors.update(fp4_expert_tensors(model, name, m, partial(_write_nvfp4, tensors), QUANT_METHOD))
        else:
            tensors.update(expert_tensors(model, name, m, partial(_write_linear, tensors, scheme), QUANT_METHOD))
    for name, m in kv.items():
        k_scale, v_scale = getattr(m, "k_scale", None), getattr(m, "v_scale", None)
        static = block_static_scales(m)
        if static is not None:
            if static["q"].numel() > 1:
                raise ExportError(
                    f"{name}: the modelopt format carries per-tensor attention scales (k_scale, v_scale, q_scale are "
                    "scalars): calibrate with attention='fp8', or write per-head scales as --format compressed-tensors"
                )
            tensors[f"{name}.q_scale"] = static["q"].float().reshape(()).contiguous()
            k_scale, v_scale = static["k"], static["v"]
        tensors[f"{name}.k_proj.k_scale"] = k_scale.float().reshape(()).contiguous()
        tensors[f"{name}.v_proj.v_scale"] = v_scale.float().reshape(()).contiguous()
    embeddings = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    one = len(set(layers.values())) <= 1
    hf_quant = hf_quant_config(scheme if one else layers, sorted(set(ignore) | set(embeddings)), bool(kv))
    return tensors, quantization_config(hf_quant), {HF_QUANT_CONFIG: hf_quant}


def _quant_section(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """``quant_algo``, ``kv_cache_quant_algo`` and ``exclude_modules``, from ``hf_quant_config.json`` when
    present, else from ``config.json``'s ``quantization_config``."""
    f = path / HF_QUANT_CONFIG
    if f.is_file():
        try:
            return json.loads(f.read_text())["quantization"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ExportError(f"{f} is not a ModelOpt quantization config: {err}") from err
    qc = raw["quantization_config"]
    kv = qc.get("kv_cache_scheme")
    return {
        "quant_algo": qc.get("quant_algo"),
        "kv_cache_quant_algo": "FP8" if isinstance(kv, dict) and kv.get("type") == "float" else kv,
        "exclude_modules": qc.get("ignore") or [],
    }


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or name.startswith(f"{p}.") for p in patterns)


def _layer_schemes(path: Path, q: dict[str, Any]) -> dict[str, str] | None:
    """``MIXED_PRECISION``'s ``quantized_layers`` as ``{layer: fp8kit scheme}`` (``None`` for one ``quant_algo``);
    ``ExportError`` naming a layer config fp8kit does not load."""
    if q.get("quant_algo") != MIXED_PRECISION:
        return None
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise ExportError(f"{path}: ModelOpt {MIXED_PRECISION} without quantized_layers (each layer's quant_algo)")
    out = {}
    for name, cfg in layers.items():
        algo = cfg.get("quant_algo") if isinstance(cfg, dict) else None
        scheme = _SCHEME_OF.get(algo)
        if scheme is None or scheme == BLOCK_SCHEME:
            loads = ", ".join(a for a, s in _SCHEME_OF.items() if s != BLOCK_SCHEME)
            raise ExportError(
                f"{path}: {name}'s ModelOpt quant_algo {algo!r} is not one fp8kit loads per layer ({loads})"
            )
        if scheme in _NVFP4 and cfg.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
            raise ExportError(
                f"{path}: {name} is NVFP4 with group_size {cfg.get('group_size')}; fp8kit loads {NVFP4_GROUP}"
            )
        out[name] = scheme
    return out


def load(path: Path, raw: dict[str, Any], dtype: torch.dtype) -> tuple[nn.Module, str, list[str], dict, bool]:
    """A ModelOpt checkpoint (ModelOpt's own or fp8kit's) in ``QuantLinear`` / ``BlockQuantLinear``
    layers, with the producer's semantics (``fp8_pb_wo`` is weight-only; ``MIXED_PRECISION``: each layer in its
    ``quantized_layers`` entry's scheme). Returns the model, the scheme name (``"auto"`` for a mix), the quantized
    layer names, the k/v (and static attention's q) scale tensors and whether it has an FP8 KV cache."""
    q = _quant_section(path, raw)
    algo = q.get("quant_algo")
    per_layer = _layer_schemes(path, q)
    if per_layer is None and algo not in _SCHEME_OF:
        raise ExportError(
            f"{path}: ModelOpt quant_algo {algo!r} is not one fp8kit loads ({', '.join([*_SCHEME_OF, MIXED_PRECISION])})"
        )
    kv_algo = q.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise ExportError(f"{path}: KV cache {kv_algo!r} is not one fp8kit loads (FP8 only)")
    used = set(per_layer.values()) if per_layer else {_SCHEME_OF[algo]}
    scheme = next(iter(used)) if len(used) == 1 else "auto"
    if scheme in _NVFP4 and q.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise ExportError(f"{path}: NVFP4 with group_size {q.get('group_size')}; fp8kit loads blocks of {NVFP4_GROUP}")
    exclude = list(q.get("exclude_modules") or [])
    model = model_from_config(path, raw, dtype)
    tensors = read_tensors(path)
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and not _excluded(n, exclude)
        and f"{n}.weight" in tensors
        and (per_layer is None or n in per_layer)
    ]
    for name in names:
        s = scheme if per_layer is None else per_layer[name]
        load_layer(model, path, name, lambda lin, name=name, s=s: _layer(tensors, name, lin, s))
    if has_expert_tensors(tensors) and per_layer is not None:
        raise ExportError(
            f"{path}: fp8kit loads MoE experts from one-scheme ModelOpt checkpoints, not {MIXED_PRECISION}"
        )
    if has_expert_tensors(tensors) and scheme in _NVFP4:

        def read_fp4_expert(key: str, out_features: int, in_features: int):
            packed = stored_codes(tensors.pop(f"{key}.weight"), torch.uint8, f"{path}: {key}.weight")
            scale = stored_codes(tensors.pop(f"{key}.weight_scale"), torch.float8_e4m3fn, f"{path}: {key}.weight_scale")
            want = ((out_features, in_features // 2), (out_features, in_features // NVFP4_GROUP))
            if (tuple(packed.shape), tuple(scale.shape)) != want:
                raise ExportError(
                    f"{path}: {key} holds NVFP4 codes {tuple(packed.shape)} and block scales {tuple(scale.shape)}, "
                    f"not {want[0]} and {want[1]}"
                )
            s2 = tensors.pop(f"{key}.weight_scale_2").float()
            return packed, scale, s2, tensors.pop(f"{key}.input_scale", None)

        names += load_fp4_experts(model, path, tensors, get_scheme(scheme), read_fp4_expert, QUANT_METHOD)
        tensors = {model_key(k, experts_naming(model)[1]): v for k, v in tensors.items()}
    elif has_expert_tensors(tensors):
        if scheme == BLOCK_SCHEME:
            raise ExportError(f"{path}: fp8kit does not load {scheme} MoE experts yet")

        def read_expert(key: str, out_features: int, in_features: int):
            codes = stored_codes(
                tensors.pop(f"{key}.weight"), SCHEMES[scheme].weight_format.dtype, f"{path}: {key}.weight"
            )
            if tuple(codes.shape) != (out_features, in_features):
                raise ExportError(f"{path}: {key} has shape {tuple(codes.shape)}, not {(out_features, in_features)}")
            pre = tensors.pop(f"{key}.pre_quant_scale", None)
            if pre is not None and not torch.all(pre.float() == 1):
                raise ExportError(f"{key}.pre_quant_scale is not all ones: fp8kit loads folded SmoothQuant only")
            return codes, tensors.pop(f"{key}.weight_scale").float(), tensors.pop(f"{key}.input_scale", None)

        experts = load_experts(model, path, tensors, SCHEMES[scheme], read_expert, QUANT_METHOD)
        names += experts
        if experts:
            block = experts_naming(model)[1]
            tensors = {model_key(k, block): v for k, v in tensors.items()}
    kv_scales = {
        k: tensors.pop(k) for k in list(tensors) if k.endswith((".k_proj.k_scale", ".v_proj.v_scale", ".q_scale"))
    }
    load_rest(model, path, tensors, names, dtype)
    return model, scheme, names, kv_scales, kv_algo == "FP8"


def _fp4_layer(
    tensors: dict[str, torch.Tensor], name: str, new: QuantLinear, weight: torch.Tensor, scale: torch.Tensor
) -> None:
    """Fill an NVFP4 ``QuantLinear`` from its packed codes, E4M3 block scales and per-tensor scales."""
    new.weight = stored_codes(weight, torch.uint8, f"{name}.weight")
    new.weight_scale = stored_codes(scale, torch.float8_e4m3fn, f"{name}.weight_scale")
    if new.weight.shape[0] != new.out_features or new.weight_scale.shape != (new.out_features, new.in_features // 16):
        raise ExportError(
            f"{name}: NVFP4 codes {tuple(new.weight.shape)} and block scales {tuple(new.weight_scale.shape)} do not "
            f"fit a ({new.out_features}, {new.in_features}) layer"
        )
    new.weight_scale_2 = tensors.pop(f"{name}.weight_scale_2").float().reshape(1)
    if new.scheme.static_activations:
        new.input_scale = tensors.pop(f"{name}.input_scale").float().reshape(1)


def _layer(tensors: dict[str, torch.Tensor], name: str, lin: nn.Linear, scheme: str) -> nn.Module:
    weight = tensors.pop(f"{name}.weight")
    scale = tensors.pop(f"{name}.weight_scale")
    bias = tensors.pop(f"{name}.bias", None) if lin.bias is not None else None
    if lin.bias is not None and bias is None:
        raise KeyError(f"{name}.bias")
    if scheme == BLOCK_SCHEME:
        new: nn.Module = BlockQuantLinear(lin.in_features, lin.out_features, lin.bias is not None)
        new.weight = stored_codes(weight, torch.float8_e4m3fn, f"{name}.weight")
        new.weight_scale_inv = scale.float().reshape(new.weight_scale_inv.shape)
        new.dynamic_activations = False  # fp8_pb_wo: weight-only
    else:
        new = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, scheme)
        if new.scheme.is_fp4:
            _fp4_layer(tensors, name, new, weight, scale)
        else:
            new.weight = stored_codes(weight, new.scheme.weight_format.dtype, f"{name}.weight")
            new.weight_scale = scale.float().reshape(new.weight_scale.shape)
        if new.scheme.static_activations and not new.scheme.is_fp4:
            new.input_scale = tensors.pop(f"{name}.input_scale").float().reshape(1)
        pre = tensors.pop(f"{name}.pre_quant_scale", None)
        if pre is not None and not torch.all(pre.float() == 1):
            raise ExportError(
                f"{name}.pre_quant_scale is not all ones: fp8kit loads SmoothQuant folded into the preceding "
                "layer only (export with ModelOpt's smoothing folded, or use the compressed-tensors format)"
            )
    if bias is not None:
        new.bias = bias.float()
    return new
