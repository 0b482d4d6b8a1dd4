"""MoE experts in checkpoints: fp8kit's fused ``QuantExperts`` <-> the per-expert tensors a Hugging Face
checkpoint of the architecture holds on disk.

``transformers`` >= 5 fuses the experts of a layer into 3-D parameters when it loads a checkpoint, but
the checkpoints (and vLLM's fused-MoE loaders, which read them through ``expert_params_mapping``) keep
one ``nn.Linear``'s worth of tensors per expert:

* Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V2/V3 family: ``model.layers.L.mlp.experts.E.gate_proj.*``,
  ``.up_proj.*``, ``.down_proj.*`` (router ``model.layers.L.mlp.gate.weight``);
* Mixtral family: ``model.layers.L.block_sparse_moe.experts.E.w1.*`` (gate), ``.w3.*`` (up), ``.w2.*``
  (down), router ``model.layers.L.block_sparse_moe.gate.weight`` (``transformers`` renames
  ``block_sparse_moe`` to ``mlp`` on load).

These are the ``WeightConverter`` source patterns of ``transformers.conversion_mapping`` for those model
types. Each expert's projection gets its own tensors: ``weight`` (codes), ``weight_scale`` (that expert's
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
back. A format whose readers take no quantized GPT-OSS experts is refused with the reason (``_NO_READER``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn as nn

from ..ptq.experts import QuantExperts, experts_projections, install_quant_experts, quantize_codes
from ..ptq.schemes import Scheme
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

_QWEN2_MOE = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL = ("w1", "w3", "w2")
# model_type -> (linear names of (gate, up, down), the MoE block's attribute on disk)
_NAMING: dict[str, tuple[tuple[str, str, str], str]] = {
    **dict.fromkeys(
        (
            "qwen2_moe",
            "qwen3_moe",
            "olmoe",
            "flex_olmo",
            "deepseek_v2",
            "deepseek_v3",
            "glm4_moe",
            "dots1",
            "ernie4_5_moe",
            "hunyuan_v1_moe",
            "qwen3_next",
            "gpt_oss",
        ),
        (_QWEN2_MOE, "mlp"),
    ),
    **dict.fromkeys(("mixtral", "minimax"), (_MIXTRAL, "block_sparse_moe")),
}


# model_type -> {format: why no reader takes that architecture's quantized experts as fp8kit writes them}
_NO_READER: dict[str, dict[str, str]] = {
    "gpt_oss": {
        "fp8-block": (
            "transformers 5 reads no quant_method 'fp8' layout of 'gpt_oss' experts (biased, gate and up "
            "interleaved): its conversion mapping has no 'gpt_oss' entry, so on a CPU (dequantize) Fp8Dequantize "
            "never runs on the fused gate_up_proj + gate_up_proj_scale_inv that its Fp8Quantize writes (they load as "
            "raw codes) and per-expert tensors do not load at all; its GPU FP8Experts refuses biases and splits "
            "gate/up by halves, not interleaved; and a 128-row tile of the interleaved gate_up_proj mixes gate and "
            "up rows. Quantize with fp8 or fp8-dynamic and write --format compressed-tensors (llm-compressor's "
            "per-expert layout)"
        ),
        "modelopt": (
            "ModelOpt writes 'gpt_oss' experts fused (gate_up_proj, down_proj and their scales, as its "
            "_export_bmm_experts does), a layout fp8kit's modelopt export does not write. Write --format "
            "compressed-tensors (llm-compressor's per-expert layout)"
        ),
    },
}


def experts_naming(model: nn.Module, fmt: str | None = None) -> tuple[tuple[str, str, str], str]:
    """``((gate, up, down) linear names, MoE block name on disk)`` for ``model``'s architecture; ``ExportError``
    when no reader takes its quantized experts in the checkpoint format ``fmt``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    reason = _NO_READER.get(model_type, {}).get(fmt)
    if reason:
        raise ExportError(f"{reason}, or keep the experts in high precision with module_filter")
    if model_type not in _NAMING:
        raise ExportError(
            f"fp8kit does not know how {model_type!r} checkpoints name their experts on disk (it knows "
            f"{', '.join(sorted(_NAMING))}): keep the experts in high precision with module_filter"
        )
    return _NAMING[model_type]


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

    linears, block = experts_naming(model, fmt)
    return f"re:^{re.escape(checkpoint_key(f'{name}.', block))}\\d+\\.({'|'.join(map(re.escape, linears))})$"


def has_expert_tensors(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a checkpoint holds per-expert tensors (``...experts.0....``)."""
    return any(".experts.0." in k for k in tensors)


def fuse_expert_tensors(module: nn.Module, state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Per-expert tensors in ``state`` (names relative to ``module``: ``experts.E.gate_proj.weight`` ...) into the
    fused 3-D parameters of ``module``'s ``transformers`` experts modules (``gate_up_proj`` ``(E, 2I, H)``, gate
    rows first, ``down_proj`` ``(E, H, I)``), in place; ``model`` gives the architecture's naming. Experts
    already fused in ``state`` (GPT-OSS keeps them so on disk) are left as they are."""
    from ..ptq.experts import find_experts

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
    from ..ptq.experts import find_experts

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
