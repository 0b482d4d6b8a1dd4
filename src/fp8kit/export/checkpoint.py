"""``save_pretrained`` / ``load_pretrained``: one entry point over the three checkpoint formats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..nn.convert import CHECKPOINT_TILES
from ..nn.linear import Linear as FP8Linear
from ..nn.towers import ignore_patterns
from ..ptq.quantized import QuantExperts, QuantLinear, dequantize_experts_module
from .block_linear import BlockQuantLinear
from .common import (
    ExportError,
    check_export_dir,
    hf_config_dict,
    kept_tensors,
    read_config,
    replace_module,
    write_export,
)
from .compressed_tensors import QUANT_METHOD as CT_METHOD
from .compressed_tensors import export_tensors as ct_tensors
from .compressed_tensors import load as ct_load
from .experts import checkpoint_key, experts_naming, unfuse_patched_experts
from .fp4_checkpoints import fp4_dequantized_model, fp4_layout
from .fp8_block import QUANT_METHOD as BLOCK_METHOD
from .fp8_block import export_tensors as block_tensors
from .fp8_block import load as block_load
from .modelopt import QUANT_METHOD as MODELOPT_METHOD
from .modelopt import export_tensors as modelopt_tensors
from .modelopt import load as modelopt_load
from .serve import serving_layers
from .shards import DEFAULT_MAX_SHARD_SIZE
from .support import BLOCK_SCHEME, FORMATS, check_mix_format, check_scheme_format, choose_block

__all__ = ["dequantized_model", "format_tensors", "load_pretrained", "save_pretrained"]

_READERS = {CT_METHOD: ct_load, MODELOPT_METHOD: modelopt_load, BLOCK_METHOD: block_load}


def _kv_blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m
        for n, m in model.named_modules()
        if hasattr(m, "k_scale") and hasattr(m, "v_scale") and hasattr(m, "k_proj")
    }


def _attention_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The attention blocks with static FP8 attention (``nn.attention.set_static_scales``), whose Q, K, V
    scales the formats write; raises ``ExportError`` where a block's FP8 attention has no static scales."""
    from ..nn.attention import STATE_NAME, attention_states, static_scales

    blocks = {}
    for name, state in attention_states(model).items():
        if state.attention_recipe.hadamard:
            raise ExportError(
                f"{name}: Hadamard-rotated FP8 attention quantizes rotated queries and keys, which no serving "
                "engine's attention or KV cache computes: export attention calibrated without hadamard"
            )
        if static_scales(state) is None:
            raise ExportError(
                f"{name}: FP8 attention without static scales (current scaling or MXFP8, or never calibrated) has "
                "none for a serving engine: quantize with attention='fp8' or 'fp8-head' (calibrated), or leave "
                "attention in high precision"
            )
        block = name.removesuffix(f".{STATE_NAME}")
        blocks[block] = model.get_submodule(block)
    return blocks


def save_pretrained(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer: Any = None,
    *,
    format: str = "compressed-tensors",  # noqa: A002 - the name users know from the CLI (--format)
    overwrite: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a quantized (or ``fp8kit.convert``-ed training) model as a Hugging Face checkpoint in ``format``.

    The export is written into a temporary sibling folder and renamed into place, so ``out_dir`` is
    either the complete new export or left as it was. An existing ``out_dir`` is replaced only if fp8kit
    wrote everything in it (see ``check_export_dir``), or with ``overwrite=True``. A scheme the format
    cannot carry raises ``ExportError`` naming the formats that can, before anything is written. The
    weights are sharded as ``transformers`` shards them (``max_shard_size``, e.g. ``"5GB"``).
    """
    if format not in FORMATS:
        raise ExportError(f"unknown checkpoint format {format!r}; accepted: {', '.join(FORMATS)}")
    qlayers = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, BlockQuantLinear))}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    report = getattr(model, "ptq_report", None)
    attention_only = False  # static FP8 attention and no separate FP8 KV cache: fp8-block carries that too
    if (qlayers or experts) and report is not None:
        scheme, ignore = report.scheme, list(report.skipped)
        kv = _kv_blocks(model) if report.kv_cache else {}
        attention = _attention_blocks(model)
        attention_only = bool(attention) and not kv
        kv.update(attention)  # static FP8 attention: its K/V scales are the KV cache's
    elif any(isinstance(m, FP8Linear) for m in model.modules()):
        scheme, qlayers, ignore = serving_layers(model, format)
        experts = {n: m for n, m in qlayers.items() if isinstance(m, QuantExperts)}  # block recipe's FP8Experts
        qlayers = {n: m for n, m in qlayers.items() if n not in experts}
        kv = {}
    else:
        raise ExportError(
            "save_pretrained takes a model quantized by fp8kit.ptq.quantize or converted for training by "
            "fp8kit.convert (none of its layers are)"
        )
    used = layer_schemes({**qlayers, **experts})
    with_kv = "+kv" if kv and not (attention_only and format == "fp8-block") else ""
    try:
        if len(used) > 1:
            check_mix_format([s + with_kv for s in used], format)
        else:
            check_scheme_format(scheme + with_kv, format)
    except ValueError as err:
        raise ExportError(str(err)) from None
    if experts and len(used) > 1 and format != "compressed-tensors":
        raise ExportError(
            f"this model mixes schemes ({', '.join(used)}) and has quantized MoE experts: the {format} export "
            "writes experts in one-scheme models only; write the mix as --format compressed-tensors"
        )
    _check_block_readers(format, {**qlayers, **experts})
    if experts and format == "modelopt" and scheme == BLOCK_SCHEME:
        raise ExportError(
            "the modelopt export does not carry block-FP8 MoE experts yet: write --format fp8-block, "
            "or keep the experts in high precision with module_filter"
        )
    block = experts_naming(model, format)[1] if experts else "mlp"  # the MoE block's name on disk (Mixtral's differs)
    # the checkpoint's names (vLLM's modules) and, where they differ, the model's (transformers matches those)
    ignore = list(dict.fromkeys(k for n in ignore for k in (checkpoint_key(n, block), n)))
    ignore += ignore_patterns(model, [*qlayers, *experts], format)  # the towers kept whole, under any prefix
    cfg = hf_config_dict(model)
    out = check_export_dir(out_dir, overwrite)
    tensors = kept_tensors(model, [*qlayers, *experts])
    for name in kv:  # each format names the k/v scales its own way
        tensors.pop(f"{name}.k_scale", None)
        tensors.pop(f"{name}.v_scale", None)
    from ..nn.attention import STATE_NAME

    tensors = {k: v for k, v in tensors.items() if f".{STATE_NAME}." not in k}  # FP8 attention's scaling state
    tensors = {checkpoint_key(k, block): v for k, v in tensors.items()}
    if format == "compressed-tensors":  # experts transformers replaces by per-expert linears to load this format
        ignore += unfuse_patched_experts(model, tensors, format)
    qtensors, qc, extra = format_tensors(format, model, qlayers, scheme, ignore, kv, experts)
    tensors.update(qtensors)
    cfg["quantization_config"] = qc
    return write_export(out, model, tensors, cfg, tokenizer, extra, max_shard_size)


def _check_block_readers(fmt: str, layers: dict[str, nn.Module]) -> None:
    """Raise ``ExportError`` (the reader, the layer, the rule) when a reader ``fmt`` is written for cannot load
    the block-FP8 layers among ``layers`` in their tiles (``support.block_problem``)."""
    from .serve import block_shapes

    tiles: dict[int, dict[str, nn.Module]] = {}
    for name, m in layers.items():
        block = m.block if isinstance(m, BlockQuantLinear) else getattr(getattr(m, "scheme", None), "block", None)
        if block is not None and (isinstance(m, BlockQuantLinear) or m.scheme.weight_strategy == "block"):
            tiles.setdefault(block, {})[name] = m
    for block, group in tiles.items():
        try:
            choose_block(fmt, block_shapes(group), block)
        except ValueError as err:
            raise ExportError(str(err)) from None


def layer_schemes(layers: dict[str, nn.Module]) -> list[str]:
    """The distinct scheme names of quantized ``layers`` (``QuantLinear``, ``QuantExperts``: their ``scheme``;
    ``BlockQuantLinear``: ``fp8-block``), sorted."""
    return sorted({m.scheme.name if hasattr(m, "scheme") else BLOCK_SCHEME for m in layers.values()})


def format_tensors(
    format: str,  # noqa: A002 - the name users know from the CLI (--format)
    model: nn.Module,
    qlayers: dict[str, nn.Module],
    scheme: str,
    ignore: list[str],
    kv: dict[str, nn.Module],
    experts: dict[str, nn.Module],
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, dict[str, Any]] | None]:
    """The quantized layers', experts' and k/v scales' tensors in ``format``, its ``quantization_config`` and
    its extra JSON files; ``model`` gives the architecture (its config and module types, weights unused)."""
    if format == "compressed-tensors":
        tensors, qc = ct_tensors(model, qlayers, ignore, kv, experts)
        return tensors, qc, None
    if format == "modelopt":
        return modelopt_tensors(model, qlayers, scheme, ignore, kv, experts)
    tensors, qc = block_tensors(model, qlayers, scheme, ignore, kv, experts)
    return tensors, qc, None


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a ``compressed-tensors``, ``modelopt`` or ``fp8-block`` checkpoint (fp8kit's or another
    producer's) into fp8kit's inference layers (``QuantLinear``, ``BlockQuantLinear``, FP8 KV cache);
    ``model.ptq_report`` says what was loaded."""
    path = Path(path)
    raw = read_config(path)
    qc = raw.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in _READERS:
        hint = "; fp8kit.export.dequantized_model reads it as a plain model" if method == "mxfp4" else ""
        raise ExportError(
            f"{path} is not a compressed-tensors, modelopt or fp8-block checkpoint (quant_method {method!r}){hint}"
        )
    model, scheme, names, kv_scales, kv = _READERS[method](path, raw, dtype)
    if any(k.endswith(".q_scale") for k in kv_scales):
        _load_static_attention(model, path, kv_scales)
    elif kv:
        from ..ptq.quantized import enable_fp8_kv

        for name, m in enable_fp8_kv(model, "quantize").items():
            for which in ("k", "v"):
                key = next(
                    (k for k in (f"{name}.{which}_scale", f"{name}.{which}_proj.{which}_scale") if k in kv_scales), None
                )
                if key is None:
                    raise ExportError(f"{path}: the checkpoint has an FP8 KV cache but {name}.{which}_scale is missing")
                m.register_buffer(f"{which}_scale", kv_scales[key].float().reshape(1))
    from ..ptq.quantized import PTQReport

    experts = [n for n in names if isinstance(model.get_submodule(n), QuantExperts)]
    report = PTQReport(scheme, quantized=[n for n in names if n not in experts], kv_cache=kv, experts=experts)
    report.schemes = {n: model.get_submodule(n).scheme.name for n in names if hasattr(model.get_submodule(n), "scheme")}
    report.skipped = {
        n: "not quantized in the checkpoint"
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, FP8Linear)
    }
    object.__setattr__(model, "ptq_report", report)
    return model.eval()


def _load_static_attention(model: nn.Module, path: Path, scales: dict[str, torch.Tensor]) -> None:
    """Static FP8 attention (``nn.attention``) on every attention block, with the checkpoint's Q, K, V scales
    (one element per tensor, or one per head) and P's where it has one, else P's from its bound
    (``calibrate_fp8_attention``)."""
    from ..nn.attention import (
        P_STATIC_DEQUANT,
        STATE_NAME,
        AttentionRecipe,
        enable_fp8_attention,
        set_static_scales,
    )

    head = any(v.numel() > 1 for k, v in scales.items() if k.endswith(".q_scale"))
    for name in enable_fp8_attention(model, AttentionRecipe("delayed", "head" if head else "tensor")):
        found = {}
        for op in ("q", "k", "v"):
            key = next((k for k in (f"{name}.{op}_scale", f"{name}.{op}_proj.{op}_scale") if k in scales), None)
            if key is None:
                raise ExportError(f"{path}: the checkpoint has static FP8 attention but {name}.{op}_scale is missing")
            found[op] = scales[key].float().reshape(-1)
        p = scales.get(f"{name}.p_scale")  # the block-FP8 format writes P's; the others have no field for it
        found["p"] = p.float().reshape(-1) if p is not None else torch.full_like(found["q"], P_STATIC_DEQUANT)
        set_static_scales(model.get_submodule(f"{name}.{STATE_NAME}").eval(), found)


def dequantized_model(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The FP8 (or INT8) checkpoint at ``path`` (any format ``load_pretrained`` reads) as a plain model:
    each quantized layer becomes an ``nn.Linear`` whose weight is ``code * scale`` (exact in float32). An FP4
    checkpoint (GPT-OSS MXFP4, compressed-tensors NVFP4 / MXFP4, ModelOpt NVFP4; ``fp4_checkpoints``) is read
    with its producer's dequantization formula, its per-expert tensors fused into the model's experts.

    A layer read from 128x128 tiles (``fp8-block``) also keeps them, ``(codes, scale_inv, block)``, as its
    ``fp8_checkpoint_tiles`` attribute: ``fp8kit.convert(model, "block")`` then computes with those exact
    codes until the weight is first updated, instead of rounding ``code * scale`` a second time onto its own
    power-of-two tiles (``fp8kit.nn.Linear.seed_fp8_weight``)."""
    layout = fp4_layout(path)
    if layout is not None:
        return fp4_dequantized_model(path, layout, dtype)
    model = load_pretrained(path, dtype=torch.float32)
    for name, m in list(model.named_modules()):
        if isinstance(m, (QuantLinear, BlockQuantLinear)):
            lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                lin.weight.copy_(m.dequantized_weight())
                if m.bias is not None:
                    lin.bias.copy_(m.bias)
            if isinstance(m, BlockQuantLinear):
                setattr(lin, CHECKPOINT_TILES, (m.weight, m.weight_scale_inv.float(), (m.block, m.block)))
            replace_module(model, name, lin)
    for m in list(model.modules()):
        if isinstance(m, QuantExperts):
            dequantize_experts_module(m)
    model.__dict__.pop("ptq_report", None)
    model.config.__dict__.pop("quantization_config", None)
    return model.to(dtype)
