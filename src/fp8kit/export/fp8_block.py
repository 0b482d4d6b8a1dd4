"""The block-FP8 checkpoint (``quant_method: "fp8"``): DeepSeek-V3, Qwen3-*-FP8 and ``transformers``'
``FineGrainedFP8Config``; served by vLLM, SGLang and ``transformers`` (on a CPU it dequantizes).

``config.json`` carries ``quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
"fmt": "e4m3", "weight_block_size": [128, 128], "modules_to_not_convert": [...]}``; for each quantized
``Linear`` named ``NAME`` the safetensors hold ``NAME.weight`` (``float8_e4m3fn``, ``(out, in)``) and
``NAME.weight_scale_inv`` (float32, ``(ceil(out / 128), ceil(in / 128))``): the dequant multiplier of each
128x128 tile, ``real = code * weight_scale_inv`` (the name is DeepSeek's: the inverse of the quantizing
scale). Activations are quantized at run time per 1x128 group (``activation_scheme: "dynamic"``).
Other square tiles (``weight_block_size: [64, 64]``) are written where the readers need them:
``transformers`` derives the tile from the shapes when it dequantizes, so every dimension must be whole
tiles, and vLLM needs whole tiles in the parts of its fused GEMMs (``support.BLOCK_READERS``).

Static FP8 attention (``nn.attention``, per tensor) is written as vLLM's ``fp8`` method reads its attention
scales: ``ATTN.q_proj.output_scale``, ``ATTN.k_proj.output_scale``, ``ATTN.v_proj.output_scale`` and
``ATTN.prob_output_scale`` (float32 scalars, dequantization multipliers; vLLM maps them onto its attention
layer's ``q_scale``, ``k_scale``, ``v_scale`` and ``prob_scale``), and read back into static FP8 attention.

MoE experts (``ptq.experts.QuantExperts`` with ``FP8_BLOCK``) are written per expert in the
architecture's naming (``model.layers.L.mlp.experts.E.gate_proj.weight`` + ``.weight_scale_inv``; see
``export.experts``), as DeepSeek-V3 and Qwen3-MoE-FP8 ship them, and read back into ``QuantExperts``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..ptq.quantized import FP8_BLOCK
from .block_linear import BLOCK, BlockQuantLinear
from .common import ExportError, load_rest, model_from_config, producer, read_tensors, replace_module, stored_codes
from .experts import expert_tensors, experts_naming, has_expert_tensors, load_experts, model_key
from .support import BLOCK_SCHEME

__all__ = ["QUANT_METHOD", "export_tensors", "load", "quantization_config"]

QUANT_METHOD = "fp8"
ATTENTION_SCALE_NAMES = {  # FP8 attention operand -> its tensor under the attention block (vLLM's fp8 method)
    "q": "q_proj.output_scale",
    "k": "k_proj.output_scale",
    "v": "v_proj.output_scale",
    "p": "prob_output_scale",
}


def quantization_config(ignore: list[str], block: int = BLOCK) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for 128x128 (``block``) tiles and dynamic activations."""
    return {
        "quant_method": QUANT_METHOD,
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [block, block],
        "modules_to_not_convert": sorted(ignore),
        "producer": producer(),
    }


def export_tensors(
    model: nn.Module,
    qlayers: dict[str, nn.Module],
    scheme: str,
    ignore: list[str],
    kv: dict[str, nn.Module],
    experts: dict[str, nn.Module] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The ``BlockQuantLinear`` layers' and block-quantized experts' tensors, the static FP8 attention scales
    of the attention blocks ``kv``, and the ``quantization_config``."""
    tensors: dict[str, torch.Tensor] = {}
    tensors.update(attention_tensors(kv))
    experts = experts or {}
    for name, module in experts.items():
        if module.scheme.weight_strategy != "block":
            raise ExportError(f"{name}: experts quantized with {module.scheme.name}; the fp8-block format needs tiles")
    blocks = {q.block for q in qlayers.values()} | {m.scheme.block for m in experts.values()}
    if len(blocks) != 1:
        raise ExportError(f"the fp8-block format has one weight_block_size; the layers use {sorted(blocks)}")
    for name, q in qlayers.items():
        tensors[f"{name}.weight"] = q.weight.contiguous()
        tensors[f"{name}.weight_scale_inv"] = q.weight_scale_inv.float().contiguous()
        if q.bias is not None:
            tensors[f"{name}.bias"] = q.bias.contiguous()

    def write(prefix: str, codes: torch.Tensor, scale: torch.Tensor, input_scale: Any) -> None:
        tensors[f"{prefix}.weight"] = codes.contiguous()
        tensors[f"{prefix}.weight_scale_inv"] = scale.float().contiguous()

    for name, module in experts.items():
        tensors.update(expert_tensors(model, name, module, write, BLOCK_SCHEME))
    return tensors, quantization_config(ignore, blocks.pop())


def attention_tensors(blocks: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The Q, K, V and P scales of the static per-tensor FP8 attention of ``blocks`` (name -> attention block),
    named as vLLM's ``fp8`` method reads them; raises ``ExportError`` for an FP8 KV cache without FP8 attention
    and for per-head scales (the method takes one scale per tensor)."""
    from ..nn.attention import block_static_scales

    tensors = {}
    for name, block in blocks.items():
        scales = block_static_scales(block)
        if scales is None:
            raise ExportError(
                f"{name}: the fp8-block format carries FP8 attention's scales, not an FP8 KV cache alone: write "
                "--format compressed-tensors or modelopt"
            )
        if any(v.numel() > 1 for v in scales.values()):
            raise ExportError(
                f"{name}: per-head FP8 attention scales: vLLM's fp8 method takes one scale per tensor; calibrate "
                "attention='fp8' (per tensor) or write --format compressed-tensors"
            )
        for op, key in ATTENTION_SCALE_NAMES.items():
            tensors[f"{name}.{key}"] = scales[op].float().reshape(())
    return tensors


def load(path: Path, raw: dict[str, Any], dtype: torch.dtype) -> tuple[nn.Module, str, list[str], dict, bool]:
    """A block-FP8 checkpoint (fp8kit's, ``transformers``', DeepSeek's) in ``BlockQuantLinear`` layers
    (dynamic 1x128 activations). Returns the model, the scheme name, the quantized layer names, the static FP8
    attention scales (``{block}.q_scale`` ... ``{block}.p_scale``; empty without them) and ``False`` (no
    FP8 KV cache of its own)."""
    qc = raw["quantization_config"]
    size = qc.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and size[0] == size[1] and isinstance(size[0], int)):
        raise ExportError(f"{path}: weight_block_size {size!r} is not one fp8kit loads (square tiles, e.g. [128, 128])")
    if qc.get("activation_scheme", "dynamic") != "dynamic" or qc.get("scale_fmt", "float") != "float":
        raise ExportError(f"{path}: fp8kit loads dynamic activations with float32 block scales only")
    block = size[0]
    model = model_from_config(path, raw, dtype)
    tensors = read_tensors(path)
    attention = {}
    for key in [k for k in tensors if k.endswith(f".{ATTENTION_SCALE_NAMES['p']}")]:
        attn = key.removesuffix(f".{ATTENTION_SCALE_NAMES['p']}")
        for op, name in ATTENTION_SCALE_NAMES.items():
            if f"{attn}.{name}" not in tensors:
                raise ExportError(f"{path}: {attn} has FP8 attention scales but {attn}.{name} is missing")
            attention[f"{attn}.{op}_scale"] = tensors.pop(f"{attn}.{name}").float().reshape(1)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and f"{n}.weight_scale_inv" in tensors]
    for name in names:
        lin = model.get_submodule(name)
        q = BlockQuantLinear(lin.in_features, lin.out_features, lin.bias is not None, block)
        try:
            codes = stored_codes(tensors.pop(f"{name}.weight"), torch.float8_e4m3fn, f"{path}: {name}.weight")
            q.weight = codes.reshape(q.weight.shape)
            q.weight_scale_inv = tensors.pop(f"{name}.weight_scale_inv").float().reshape(q.weight_scale_inv.shape)
            if lin.bias is not None:
                q.bias = tensors.pop(f"{name}.bias").float()
        except KeyError as err:
            raise ExportError(f"{path}: tensor {err.args[0]} is missing") from err
        except RuntimeError as err:
            raise ExportError(f"{path}: tensors of {name} have the wrong shape ({err})") from err
        replace_module(model, name, q)
    if has_expert_tensors(tensors):
        scheme = dataclasses.replace(FP8_BLOCK, block=block)

        def read(prefix: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, None]:
            tiles = (-(-rows // block), -(-cols // block))
            codes, scale = tensors.pop(f"{prefix}.weight"), tensors.pop(f"{prefix}.weight_scale_inv")
            if tuple(codes.shape) != (rows, cols) or tuple(scale.shape) != tiles:
                raise ExportError(
                    f"{path}: {prefix} has weight {tuple(codes.shape)} and weight_scale_inv {tuple(scale.shape)}; "
                    f"the model's config needs {(rows, cols)} and {tiles} ({block}x{block} tiles)"
                )
            return stored_codes(codes, torch.float8_e4m3fn, f"{path}: {prefix}.weight"), scale.float(), None

        experts = load_experts(model, path, tensors, scheme, read, BLOCK_SCHEME)
        names += experts
        if experts:
            tensors = {model_key(k, experts_naming(model)[1]): v for k, v in tensors.items()}
    load_rest(model, path, tensors, names, dtype)
    return model, BLOCK_SCHEME, names, attention, False
