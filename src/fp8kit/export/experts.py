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
``ptq.experts``), so ``gate_proj`` and ``up_proj`` each hold whole tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..ptq.experts import QuantExperts, experts_projections, install_quant_experts, quantize_codes
from ..ptq.schemes import Scheme
from .common import ExportError

__all__ = [
    "checkpoint_key",
    "expert_tensors",
    "experts_naming",
    "fuse_expert_tensors",
    "has_expert_tensors",
    "load_experts",
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
        ),
        (_QWEN2_MOE, "mlp"),
    ),
    **dict.fromkeys(("mixtral", "minimax"), (_MIXTRAL, "block_sparse_moe")),
}


# architectures whose quantized experts no reader takes in a format fp8kit writes, and why
_NO_READER = {
    "gpt_oss": (
        "'gpt_oss' checkpoints keep each layer's biased experts fused (3-D gate_up_proj, gate and up interleaved, "
        "down_proj, *_bias) and transformers 5 reads no quantized layout of them: it has no conversion from "
        "per-expert tensors for 'gpt_oss' (compressed-tensors and ModelOpt name experts one by one), its FP8 "
        "experts take no bias, and on a CPU it dequantizes only '.weight' tensors (the fused layout its "
        "Fp8Quantize writes, gate_up_proj + gate_up_proj_scale_inv, loads as raw codes)"
    ),
}


def experts_naming(model: nn.Module) -> tuple[tuple[str, str, str], str]:
    """``((gate, up, down) linear names, MoE block name on disk)`` for ``model``'s architecture."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _NO_READER:
        raise ExportError(f"{_NO_READER[model_type]}: keep the experts in high precision with module_filter")
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


def _split(module: QuantExperts, p: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Projection ``p`` as ``(linear index (0 gate, 1 up, 2 down), codes (E, out, in), scale (E, out|1, 1))``."""
    codes, scale = module.weight_codes(p), module.weight_scale(p)
    if p == 1:
        return [(2, codes, scale)]
    if not module.has_gate:
        return [(1, codes, scale)]
    if not getattr(module, "is_concatenated", True):
        raise ExportError(f"{type(module).__name__}: interleaved gate/up experts have no per-expert checkpoint layout")
    half = codes.shape[1] // 2
    if module.scheme.weight_strategy == "block":  # tile rows: gate's first, whole tiles (I % block == 0)
        rows = half // module.scheme.block
        return [(0, codes[:, :half], scale[:, :rows]), (1, codes[:, half:], scale[:, rows:])]
    if scale.shape[1] == 1:  # one scale per expert for gate and up together
        return [(0, codes[:, :half], scale), (1, codes[:, half:], scale)]
    return [(0, codes[:, :half], scale[:, :half]), (1, codes[:, half:], scale[:, half:])]


def expert_tensors(
    model: nn.Module, name: str, module: QuantExperts, write: Callable[[str, torch.Tensor, torch.Tensor, Any], None]
) -> None:
    """Call ``write(prefix, codes (out, in), weight_scale, input_scale or None)`` for each expert's linear,
    ``prefix`` its checkpoint name (``model.layers.0.mlp.experts.3.gate_proj``)."""
    if module.has_bias:
        raise ExportError(f"{name}: experts with biases have no per-expert checkpoint layout in fp8kit's exports")
    linears, block = experts_naming(model)
    base = checkpoint_key(f"{name}.", block)
    for p in range(2):
        input_scale = module.input_scale(p)
        for which, codes, scale in _split(module, p):
            for e in range(module.num_experts):
                write(f"{base}{e}.{linears[which]}", codes[e], scale[e], input_scale)


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


def load_experts(
    model: nn.Module,
    path: Any,
    tensors: dict[str, torch.Tensor],
    scheme: Scheme,
    read: Callable[[str, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> list[str]:
    """Make every experts module of ``model`` a ``QuantExperts`` from the per-expert tensors; ``read(prefix,
    out, in)`` pops one linear's ``(codes (out, in), weight_scale, input_scale or None)`` from ``tensors``.
    Per-expert input scales become their max (vLLM's semantics); block weight scales stay per tile
    (``(ceil(out / b), ceil(in / b))`` each). Returns the module names."""
    from ..ptq.experts import find_experts

    found = find_experts(model)
    if not found:
        return []
    linears, block = experts_naming(model)
    names = []
    for name, module in found.items():
        base = checkpoint_key(f"{name}.", block)
        first, second = experts_projections(module)
        w1 = getattr(module, first)
        e = module.num_experts
        inter, hidden = (w1.shape[2], w1.shape[1]) if module.is_transposed else (w1.shape[1], w1.shape[2])
        if module.has_gate:
            inter //= 2
        shapes = {0: (inter, hidden), 1: (inter, hidden), 2: (hidden, inter)}
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
        wanted = (0, 1, 2) if module.has_gate else (1, 2)
        try:
            for which in wanted:
                parts[which] = [read(f"{base}{i}.{linears[which]}", *shapes[which]) for i in range(e)]
        except KeyError as err:
            raise ExportError(f"{path}: tensor {err.args[0]} is missing") from err

        def stack(which: int, k: int, parts=parts) -> torch.Tensor:
            keep = k == 0 or scheme.weight_strategy == "block"
            return torch.stack([part[k] if keep else part[k].reshape(-1, 1) for part in parts[which]])

        new: dict[str, torch.Tensor] = {}
        groups = {first: (0, 1) if module.has_gate else (1,), second: (2,)}
        for proj, whiches in groups.items():
            codes = torch.cat([stack(w, 0) for w in whiches], dim=1)
            scales = [stack(w, 1) for w in whiches]
            if scheme.weight_strategy == "tensor":
                if len(scales) == 2 and not torch.equal(scales[0], scales[1]):
                    # gate and up with their own scales: requantize to one per expert (vLLM does the same)
                    deq = torch.cat([stack(w, 0).float() * s for w, s in zip(whiches, scales, strict=True)], dim=1)
                    codes, scale = quantize_codes(deq, scheme)
                else:
                    scale = scales[0].reshape(e, 1, 1)
            elif scheme.weight_strategy == "block":
                scale = torch.cat(scales, dim=1)  # (E, tile rows of gate + up, tile cols)
            else:
                scale = torch.cat(scales, dim=1).reshape(e, -1, 1)
            new[proj] = codes.to(scheme.weight_format.dtype).contiguous()
            new[f"{proj}_weight_scale"] = scale.float().contiguous()
            if scheme.static_activations:
                ins = [part[2] for w in whiches for part in parts[w]]
                if any(s is None for s in ins):
                    raise ExportError(f"{path}: {base}*.{proj}: static scheme without input_scale")
                new[f"{proj}_input_scale"] = torch.stack([s.float().reshape(()) for s in ins]).max().reshape(1)
        install_quant_experts(module, scheme, new)
        names.append(name)
    return names
