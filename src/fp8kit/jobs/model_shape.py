"""The shape of a model as the cost estimate reads it: parameters, bytes, dims and the (in, out) of each GEMM,
from a checkpoint's safetensors headers, a ``transformers`` config or a module on the ``meta`` device."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ModelShape", "linear_dims", "model_shape", "module_shape", "shape_from_config"]

_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "I32": 4}
_DTYPE_BYTES |= {"I64": 8, "I16": 2, "BOOL": 1, "F8_E8M0": 1, "U32": 4, "F4": 1}


@dataclass(frozen=True)
class ModelShape:
    """A model's size without its weights: parameters, bytes on disk, and the dims activations scale with."""

    params: int
    checkpoint_bytes: int
    hidden: int
    layers: int
    vocab: int
    gemms: tuple[tuple[int, int], ...] = ()  # (in_features, out_features) of each Linear, the output head included


def model_shape(folder: str | Path) -> ModelShape:
    """The ``ModelShape`` of a Hugging Face folder: parameters and bytes from its safetensors headers (no
    tensor is read), dims from ``config.json``; a folder without safetensors counts an empty-weights model
    built from its config."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        from transformers import AutoConfig

        return shape_from_config(AutoConfig.from_pretrained(folder))
    from safetensors import safe_open

    params = nbytes = 0
    gemms: list[tuple[int, int]] = []
    head = False
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                dims = part.get_shape()
                n = 1
                for d in dims:
                    n *= d
                params += n
                nbytes += n * _DTYPE_BYTES.get(part.get_dtype(), 4)
                if len(dims) == 2 and key.endswith(".weight") and "embed" not in key and "norm" not in key:
                    gemms.append((int(dims[1]), int(dims[0])))
                    head = head or "lm_head" in key
    hidden, layers, vocab = _dims(config)
    if not head and hidden and vocab:  # tied embeddings: the head still runs
        gemms.append((hidden, vocab))
    return ModelShape(params, nbytes, hidden, layers, vocab, tuple(gemms))


def _dims(config: dict[str, Any]) -> tuple[int, int, int]:
    return int(config.get("hidden_size", 0)), int(config.get("num_hidden_layers", 0)), int(config.get("vocab_size", 0))


def shape_from_config(config: Any) -> ModelShape:
    """The ``ModelShape`` of a ``transformers`` config: the model built on the ``meta`` device (no memory),
    its parameters counted, 4 bytes each."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    text = getattr(config, "text_config", config)
    dims = _dims(text.to_dict())
    return ModelShape(params, 4 * params, *dims, linear_dims(model))


def module_shape(model: torch.nn.Module) -> ModelShape:
    """The ``ModelShape`` of a module built on the ``meta`` device (the demo model)."""
    params = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    dims = _dims(config.to_dict()) if config is not None else (0, 0, 0)
    return ModelShape(params, 4 * params, *dims, linear_dims(model))


def linear_dims(model: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    """``(in_features, out_features)`` of every ``nn.Linear`` of ``model``, and one per 3-D experts weight
    (what a token's routed expert computes)."""
    dims = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            dims.append((module.in_features, module.out_features))
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() == 3 and "expert" in f"{name}.{pname}":
                dims.append((int(p.shape[2]), int(p.shape[1])))
    return tuple(dims)
