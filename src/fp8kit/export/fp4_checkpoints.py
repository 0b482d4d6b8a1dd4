"""FP4 checkpoints of other producers read in as plain high-precision weights, to fine-tune or re-quantize.

``fp4_layout(path)`` tells the FP4 layouts apart from ``config.json``; ``FP4Layout.dequantize`` turns a
layer's stored tensors into the weights of the plain model, each FP4 weight dequantized exactly in float32 with
its producer's formula (the E2M1 codes and E8M0 scales decoded by ``formats``, the bytes unpacked by
``state_dict.unpack_fp4``, element ``2i`` in the low nibble):

* GPT-OSS MXFP4 (``quant_method: "mxfp4"``, as openai/gpt-oss ships its experts): ``P_blocks`` uint8
  ``(E, out, in / 32, 16)`` and ``P_scales`` uint8 E8M0 ``(E, out, in / 32)`` for ``P`` = ``gate_up_proj``,
  ``down_proj``; value ``code * 2**(scale - 127)``, the weight transposed to ``(E, in, out)`` as
  ``GptOssExperts`` holds it (transformers' ``convert_moe_packed_tensors``).
* compressed-tensors ``nvfp4-pack-quantized`` (llm-compressor's NVFP4): ``N.weight_packed`` uint8
  ``(out, in / 2)``, ``N.weight_scale`` E4M3 ``(out, in / 16)``, ``N.weight_global_scale`` ``(1,)``; value
  ``code * (weight_scale / weight_global_scale)`` (compressed-tensors' ``dequantize``);
  ``mxfp4-pack-quantized``: ``N.weight_scale`` uint8 E8M0 ``(out, in / 32)``, value ``code * 2**(scale - 127)``.
* ModelOpt ``NVFP4`` / ``W4A16_NVFP4``: ``N.weight`` uint8 ``(out, in / 2)``, ``N.weight_scale`` E4M3
  ``(out, in / 16)``, ``N.weight_scale_2`` ``()``; value ``code * (weight_scale * weight_scale_2)`` (ModelOpt's
  ``NVFP4QTensor.dequantize``).

MoE experts stored one by one (``experts.E.gate_proj``...) are dequantized expert by expert and fused into the
model's 3-D parameters (``experts.fuse_expert_tensors``). Activation scales (``input_global_scale``,
``input_scale``) and k/v cache scales are dropped: the plain model computes in high precision. A
quantization config that names FP4 in a layout not listed here raises ``ExportError`` with one line naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..numerics.formats import e2m1_decode, e8m0_decode
from ..numerics.state_dict import unpack_fp4
from .common import ExportError, load_rest, model_from_config, read_tensors

__all__ = ["FP4Layout", "fp4_dequantized_model", "fp4_layout"]

GPT_OSS = "gpt-oss-mxfp4"
COMPRESSED_TENSORS = "compressed-tensors"
MODELOPT = "modelopt"
_CT_FP4 = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}  # format -> block size
_MODELOPT_FP4 = ("NVFP4", "W4A16_NVFP4")
NVFP4_BLOCK, MXFP4_BLOCK = 16, 32

# kind -> (suffix that marks a quantized weight, suffix of the plain weight, companion suffixes, dropped suffixes)
_RULES: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...]]] = {
    GPT_OSS: ("_blocks", "", ("_scales",), ()),
    COMPRESSED_TENSORS: (
        ".weight_packed",
        ".weight",
        (".weight_scale", ".weight_global_scale", ".input_global_scale"),
        (".k_scale", ".v_scale"),
    ),
    MODELOPT: (
        ".weight_scale_2",
        ".weight",
        (".weight", ".weight_scale", ".input_scale", ".pre_quant_scale"),
        (".k_scale", ".v_scale"),
    ),
}


@dataclass(frozen=True)
class FP4Layout:
    """One FP4 checkpoint layout (module doc): ``kind`` (``"gpt-oss-mxfp4"``, ``"compressed-tensors"``,
    ``"modelopt"``), the folder it was read from, and the compressed-tensors block size (16 or 32)."""

    kind: str
    where: Path
    block: int = NVFP4_BLOCK
    name: str = field(default="", compare=False)  # the producer's name for it, for messages

    def sources(self, keys: Iterable[str]) -> dict[str, tuple[str, ...]]:
        """Each plain tensor's name -> the stored tensors it is made from (itself for a tensor kept as stored);
        activation scales go with their layer's weight, k/v cache scales are left out."""
        marker, plain, companions, dropped = _RULES[self.kind]
        keys = list(keys)
        present = set(keys)
        out: dict[str, tuple[str, ...]] = {}
        taken: set[str] = set()
        for k in keys:
            if k.endswith(marker):
                prefix = k[: -len(marker)]
                group = (k, *(prefix + s for s in companions if prefix + s in present))
                out[prefix + plain] = group
                taken.update(group)
        for k in keys:
            if k not in taken and not k.endswith(dropped):
                out[k] = (k,)
        return out

    def fp4_weights(self, keys: Iterable[str]) -> list[str]:
        """The plain names of the FP4 weights among the stored tensors ``keys``."""
        marker = _RULES[self.kind][0]
        return [k for k, group in self.sources(keys).items() if group != (k,) and group[0].endswith(marker)]

    def dequantize(
        self,
        stored: Mapping[str, torch.Tensor],
        keys: Iterable[str] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, torch.Tensor]:
        """The plain tensors (``keys``, default all) made from ``stored``, which holds their ``sources``: FP4
        weights dequantized exactly in float32, each then cast to ``dtype``; the rest as stored."""
        srcs = self.sources(stored)
        out = {}
        for key in srcs if keys is None else keys:
            group = srcs[key]
            out[key] = stored[key] if group == (key,) else self._weight(key, group, stored).to(dtype)
        return out

    def _weight(self, key: str, group: tuple[str, ...], stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.kind == GPT_OSS:
            return _gpt_oss_weight(key, stored[group[0]], stored.get(f"{key}_scales"), self.where)
        if self.kind == COMPRESSED_TENSORS:
            return _ct_weight(key.removesuffix(".weight"), stored, self.block, self.where)
        return _modelopt_weight(key.removesuffix(".weight"), stored, self.where)


def _need(t: torch.Tensor | None, dtype: torch.dtype, what: str, where: Path) -> torch.Tensor:
    if t is None:
        raise ExportError(f"{where}: tensor {what} is missing")
    if t.dtype != dtype:
        raise ExportError(f"{where}: {what} holds {t.dtype}, not the {dtype} of this FP4 layout")
    return t


def _e8m0(codes: torch.Tensor, what: str, where: Path) -> torch.Tensor:
    """E8M0 block scales as float32 powers of two; the NaN code 255 is refused."""
    if bool((codes == 255).any()):
        raise ExportError(f"{where}: {what} holds the E8M0 NaN code 255; the checkpoint is corrupted")
    return e8m0_decode(codes)


def _blocks_times(codes: torch.Tensor, scale: torch.Tensor, block: int, what: str, where: Path) -> torch.Tensor:
    """E2M1 codes ``(..., n)`` times one float32 multiplier per 1 x ``block`` block ``scale`` ``(..., n / block)``."""
    if codes.shape[-1] != scale.shape[-1] * block or codes.shape[:-1] != scale.shape[:-1]:
        raise ExportError(
            f"{where}: {what} holds {tuple(codes.shape)} E2M1 codes and {tuple(scale.shape)} block scales, "
            f"which do not fit blocks of {block}"
        )
    values = e2m1_decode(codes).unflatten(-1, (-1, block)) * scale.unsqueeze(-1)
    return values.flatten(-2)


def _gpt_oss_weight(key: str, blocks: torch.Tensor, scales: torch.Tensor | None, where: Path) -> torch.Tensor:
    blocks = _need(blocks, torch.uint8, f"{key}_blocks", where)
    scales = _need(scales, torch.uint8, f"{key}_scales", where)
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ExportError(
            f"{where}: {key}_blocks {tuple(blocks.shape)} / _scales {tuple(scales.shape)} are not GPT-OSS's MXFP4 "
            "experts layout ((E, out, in/32, 16) uint8 and (E, out, in/32) E8M0)"
        )
    codes = unpack_fp4(blocks).flatten(-2)  # (E, out, in)
    w = _blocks_times(codes, _e8m0(scales, f"{key}_scales", where), MXFP4_BLOCK, key, where)
    return w.transpose(1, 2).contiguous()  # (E, in, out): GptOssExperts' layout


def _ct_weight(prefix: str, stored: Mapping[str, torch.Tensor], block: int, where: Path) -> torch.Tensor:
    packed = _need(stored.get(f"{prefix}.weight_packed"), torch.uint8, f"{prefix}.weight_packed", where)
    scale = stored.get(f"{prefix}.weight_scale")
    if block == NVFP4_BLOCK:
        scale = _need(scale, torch.float8_e4m3fn, f"{prefix}.weight_scale", where)
        g = _need(stored.get(f"{prefix}.weight_global_scale"), torch.float32, f"{prefix}.weight_global_scale", where)
        mult = scale.float() / g.float().reshape(())  # compressed-tensors: code * (scale / global_scale)
    else:
        mult = _e8m0(_need(scale, torch.uint8, f"{prefix}.weight_scale", where), f"{prefix}.weight_scale", where)
    return _blocks_times(unpack_fp4(packed), mult, block, prefix, where)


def _modelopt_weight(prefix: str, stored: Mapping[str, torch.Tensor], where: Path) -> torch.Tensor:
    packed = _need(stored.get(f"{prefix}.weight"), torch.uint8, f"{prefix}.weight", where)
    scale = _need(stored.get(f"{prefix}.weight_scale"), torch.float8_e4m3fn, f"{prefix}.weight_scale", where)
    scale_2 = _need(stored.get(f"{prefix}.weight_scale_2"), torch.float32, f"{prefix}.weight_scale_2", where)
    pre = stored.get(f"{prefix}.pre_quant_scale")
    if pre is not None and not torch.all(pre.float() == 1):
        raise ExportError(
            f"{where}: {prefix}.pre_quant_scale is not all ones (ModelOpt's AWQ / SmoothQuant input scaling): fp8kit "
            "reads NVFP4 checkpoints without it"
        )
    mult = scale.float() * scale_2.float().reshape(())  # ModelOpt: code * (weight_scale * weight_scale_2)
    return _blocks_times(unpack_fp4(packed), mult, NVFP4_BLOCK, prefix, where)


# ---- telling the layouts apart -------------------------------------------------------------------------


def _refuse(where: Path, found: str) -> ExportError:
    return ExportError(
        f"{where}: {found} is an FP4 layout fp8kit does not read (it reads GPT-OSS MXFP4 experts, compressed-tensors "
        "nvfp4-pack-quantized / mxfp4-pack-quantized and ModelOpt NVFP4 / W4A16_NVFP4)"
    )


def _ct_layout(where: Path, qc: dict[str, Any]) -> FP4Layout | None:
    groups = list((qc.get("config_groups") or {}).values())
    formats = {g.get("format") or qc.get("format") for g in groups} or {qc.get("format")}
    fp4 = formats & set(_CT_FP4)
    if not fp4:
        weights = [g.get("weights") or {} for g in groups]
        if any(w.get("num_bits") == 4 and w.get("type") == "float" for w in weights):
            raise _refuse(where, f"compressed-tensors 4-bit float weights in format {sorted(map(str, formats))}")
        return None
    if len(formats) != 1:
        return _ct_mix(where, qc, formats)
    fmt = fp4.pop()
    block = _CT_FP4[fmt]
    for g in groups:
        w = g.get("weights") or {}
        if w.get("group_size") != block or not w.get("symmetric", True) or w.get("num_bits") != 4:
            raise _refuse(where, f"compressed-tensors {fmt} weights {w}")
    return FP4Layout(COMPRESSED_TENSORS, where, block, fmt)


def _ct_mix(where: Path, qc: dict[str, Any], formats: set[str]) -> None:
    """A compressed-tensors config whose groups differ in format (fp8kit's and llm-compressor's per-layer mixes,
    ``"mixed-precision"``): not one FP4 layout, but ``load_pretrained`` reads each group in its own scheme, so
    ``None`` when it reads every group; refused (one line) otherwise."""
    from .compressed_tensors import MIXED_PRECISION, _scheme_of

    for key, g in (qc.get("config_groups") or {}).items():
        fmt = g.get("format") or qc.get("format")
        try:
            if fmt == MIXED_PRECISION:
                raise ExportError(f"group {key} has no format of its own")
            _scheme_of(g, fmt)
        except ExportError as err:
            raise _refuse(where, f"compressed-tensors with mixed formats {sorted(map(str, formats))} ({err})") from None
    return None


def _modelopt_layout(where: Path, raw: dict[str, Any]) -> FP4Layout | None:
    f = where / "hf_quant_config.json"
    try:
        q = json.loads(f.read_text())["quantization"] if f.is_file() else raw["quantization_config"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ExportError(f"{f} is not a ModelOpt quantization config: {err}") from err
    algo = str(q.get("quant_algo"))
    if algo in _MODELOPT_FP4:
        if q.get("group_size", NVFP4_BLOCK) != NVFP4_BLOCK:
            raise _refuse(where, f"ModelOpt {algo} with group_size {q.get('group_size')}")
        return FP4Layout(MODELOPT, where, NVFP4_BLOCK, algo)
    if algo == "MIXED_PRECISION":  # a quant_algo per layer: load_pretrained reads each layer in its own
        from .modelopt import _layer_schemes

        try:
            _layer_schemes(where, q)
        except ExportError as err:
            if "FP4" in json.dumps(q).upper():
                raise _refuse(where, f"ModelOpt MIXED_PRECISION ({err})") from None
        return None
    if "FP4" in algo.upper():
        raise _refuse(where, f"ModelOpt quant_algo {algo!r}")
    return None


def fp4_layout(path: str | Path, raw: dict[str, Any] | None = None) -> FP4Layout | None:
    """The FP4 layout of the Hugging Face folder ``path`` (``raw``: its ``config.json``, read when not given), or
    ``None`` when it holds no FP4 weights (or no ``config.json``), or mixes schemes per layer in a way
    ``load_pretrained`` reads (a compressed-tensors config whose groups differ in format, ModelOpt's
    ``MIXED_PRECISION``). A quantization config that names FP4 in a
    layout fp8kit does not read raises ``ExportError`` with one line naming it."""
    where = Path(path)
    if raw is None:
        cfg = where / "config.json"
        if not cfg.is_file():
            return None
        raw = json.loads(cfg.read_text())
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":
        if raw.get("model_type") != "gpt_oss":
            raise _refuse(where, f"quant_method 'mxfp4' on a {raw.get('model_type')!r} model")
        return FP4Layout(GPT_OSS, where, MXFP4_BLOCK, "mxfp4")
    if method == COMPRESSED_TENSORS:
        return _ct_layout(where, qc)
    if method == MODELOPT:
        return _modelopt_layout(where, raw)
    text = json.dumps(qc).lower()
    if any(word in text for word in ("fp4", "e2m1", "float4")):
        raise _refuse(where, f"quant_method {method!r} ({json.dumps(qc)[:120]})")
    return None


def plain_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dequantized checkpoint's tensors under ``model``'s state-dict names: per-expert tensors renamed from the
    architecture's MoE block on disk and fused into the 3-D experts parameters (``experts.fuse_expert_tensors``)."""
    from .experts import experts_naming, fuse_expert_tensors, has_expert_tensors, model_key

    if not has_expert_tensors(tensors):
        return tensors
    block = experts_naming(model)[1]
    state = {model_key(k, block): v for k, v in tensors.items()}
    fuse_expert_tensors(model, state, model)
    return state


def fp4_dequantized_model(path: str | Path, layout: FP4Layout, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The plain causal LM of the FP4 checkpoint at ``path`` in ``dtype``: every FP4 weight dequantized exactly in
    float32 (module doc) and rounded once to ``dtype``, the other tensors as stored."""
    from .common import read_config

    path = Path(path)
    raw = read_config(path)
    model = model_from_config(path, raw, dtype)
    tensors = read_tensors(path)
    if not layout.fp4_weights(tensors):
        raise _refuse(path, f"a {layout.name} config over tensors without FP4 weights ({next(iter(tensors))}, ...)")
    state = plain_state_dict(model, layout.dequantize(tensors, dtype=dtype))
    del tensors
    load_rest(model, path, state, [], dtype)
    model.config.__dict__.pop("quantization_config", None)
    return model
