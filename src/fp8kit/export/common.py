"""What every checkpoint format shares: the output folder's safety rules, atomic writing, reading
safetensors and ``config.json``, and rebuilding the model skeleton the tensors go into.

Writing: the export is written into a temporary sibling folder and renamed into place, so ``out_dir``
is either the complete new export or left as it was. An existing ``out_dir`` is replaced only if an
earlier fp8kit export wrote everything in it (``MANIFEST`` lists those files), or with ``overwrite``.
Reading: JSON and safetensors only (nothing is unpickled).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..nn.linear_like import linear_dims
from ..numerics.state_dict import tied_aliases
from .shards import DEFAULT_MAX_SHARD_SIZE, ShardWriter

__all__ = [
    "stored_codes",
    "MANIFEST",
    "ExportError",
    "check_export_dir",
    "export_folder",
    "hf_config_dict",
    "kept_tensors",
    "load_rest",
    "model_from_config",
    "producer",
    "read_config",
    "read_tensors",
    "replace_module",
    "write_export",
    "write_metadata",
]

MANIFEST = ".fp8kit-export"  # the files an export wrote: a later export may replace them, nothing else


class ExportError(ValueError):
    """A directory that is not a (supported) checkpoint, or a model that cannot be saved in a format."""


def producer() -> dict[str, str]:
    """The ``producer`` entry of every ``quantization_config`` fp8kit writes: ``{"name": "fp8kit", "version": ...}``,
    the shape ModelOpt writes and vLLM reads (``quant_cfg.get("producer", {}).get("name")``); compressed-tensors'
    ``QuantizationConfig`` and transformers' quantization configs ignore the key."""
    from ..version import __version__

    return {"name": "fp8kit", "version": __version__}


def stored_codes(t: torch.Tensor, dtype: torch.dtype, where: str) -> torch.Tensor:
    """A checkpoint tensor that must hold 8-bit codes of ``dtype`` (``where`` names it in the error): returned
    as is, or refused when it holds another dtype (a cast would round high-precision values into codes
    without their scales)."""
    if t.dtype != dtype:
        raise ExportError(
            f"{where} holds {t.dtype} values, not {dtype} codes; this is not a checkpoint of that format. Load "
            "the high-precision model and quantize it with fp8kit.ptq.quantize (block FP8: "
            "fp8kit.export.quantize_block), or re-export it with fp8kit.export.save_pretrained"
        )
    return t


def _foreign_entries(path: Path) -> list[str]:
    """Entries of the folder ``path`` that an earlier fp8kit export did not write (all of them if none did)."""
    entries = sorted(p.name for p in path.iterdir())
    try:
        written = set(json.loads((path / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return entries
    return [e for e in entries if e not in written and e != MANIFEST]


def check_export_dir(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Validate ``out_dir`` for ``save_pretrained`` before any work; returns it as an absolute path.

    Accepted: a new path, an empty folder, or an earlier fp8kit export holding only its own files. A
    folder with anything else is refused unless ``overwrite`` (then it is replaced as a whole); a file,
    the current directory or one of its parents is always refused. Raises ``ExportError``.
    """
    out = Path(out_dir).expanduser().absolute()
    cwd = Path.cwd().absolute()
    if out == cwd or out in cwd.parents or out.parent == out:
        raise ExportError(
            f"{out_dir} is the current folder or one of its parents: give a new folder for the export, "
            "e.g. --out quantized-model"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out_dir} is a file, not a folder: give a new folder for the export")
    if out.is_dir() and not overwrite:
        foreign = _foreign_entries(out)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ExportError(
                f"{out_dir} already holds files fp8kit did not write ({shown}): give a new or empty folder, "
                "or pass --overwrite (overwrite=True) to replace the whole folder"
            )
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{out_dir} cannot be created: {parent} is not a writable folder")
    return out


def hf_config_dict(model: nn.Module) -> dict[str, Any]:
    """``model.config`` as the ``config.json`` dict, without fp8kit's run-time attention settings; its
    ``architectures`` names the model's class where it is a ``transformers`` class (as transformers'
    ``save_pretrained`` writes it: readers build that class, a Llava rather than a causal LM)."""
    config = getattr(model, "config", None)
    if config is None:
        raise ExportError("save_pretrained needs a Hugging Face model (with .config) to write config.json")
    cfg = config.to_dict()
    hf = sys.modules.get("transformers")
    if hf is not None and isinstance(getattr(hf, type(model).__name__, None), type):
        cfg["architectures"] = [type(model).__name__]
    cfg.pop("_attn_implementation_autoset", None)
    cfg.pop("_fp8kit_inner_attn", None)
    if cfg.get("_attn_implementation") == "fp8kit_fp8_kv":
        cfg.pop("_attn_implementation")
    cfg.pop("quantization_config", None)
    return cfg


def kept_tensors(model: nn.Module, replaced: list[str]) -> dict[str, torch.Tensor]:
    """The state dict entries an export copies unchanged: all but tied aliases and the tensors of the
    modules named in ``replaced`` (the quantized layers, which each format writes its own way)."""
    state = model.state_dict()
    aliases = tied_aliases(state)
    prefixes = tuple(f"{n}." for n in replaced)
    out = {}
    for key, val in state.items():
        if key in aliases or key.startswith(prefixes):
            continue
        out[key] = val.detach().contiguous()
    return out


def _sibling(out: Path, kind: str) -> Path:
    """A new, uniquely named hidden folder beside ``out`` (created with the usual permissions)."""
    while True:
        path = out.with_name(f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is moved aside first and removed only afterwards."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = _sibling(out, "old")
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old / out.name, out)  # put the previous export back
        shutil.rmtree(old, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def export_folder(out: Path) -> Iterator[Path]:
    """A temporary sibling folder of ``out`` (already checked by ``check_export_dir``) to write the export
    into; renamed to ``out`` when the block ends, removed if it raises (or the process is killed: the
    hidden name never looks like an export)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, "tmp")
    try:
        yield tmp
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_metadata(
    tmp: Path,
    model: nn.Module,
    config: dict[str, Any],
    tokenizer: Any = None,
    extra_json: dict[str, dict[str, Any]] | None = None,
) -> None:
    """``config.json``, the generation config, ``extra_json`` files, the tokenizer and the ``MANIFEST`` of
    every file in ``tmp`` (so write the weights first)."""
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    for name, obj in (extra_json or {}).items():
        (tmp / name).write_text(json.dumps(obj, indent=4))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        (tmp / "generation_config.json").write_text(gen.to_json_string())
    tok = getattr(tokenizer, "tok", tokenizer)
    if hasattr(tok, "save_pretrained"):  # fp8kit's byte tokenizer (demo models) has no files
        tok.save_pretrained(tmp)
    files = sorted(p.name for p in tmp.iterdir())
    (tmp / MANIFEST).write_text(json.dumps({"producer": "fp8kit", "files": files}))


def write_export(
    out: Path,
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    tokenizer: Any = None,
    extra_json: dict[str, dict[str, Any]] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``tensors`` (sharded by ``max_shard_size``) and the metadata (``write_metadata``) into a
    temporary sibling of ``out`` and rename it into place (``export_folder``)."""
    with export_folder(out) as tmp:
        writer = ShardWriter(tmp, max_shard_size)
        try:
            writer.add_all(tensors)
            writer.close()
        finally:
            writer.abort()
        write_metadata(tmp, model, config, tokenizer, extra_json)
    return out


def read_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` of the Hugging Face directory ``path`` (``ExportError`` when missing or invalid)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{path} is not a Hugging Face model directory (config.json missing)")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{cfg_file} is not valid JSON: {err}") from err


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (shards merged)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ExportError(f"{path} holds no .safetensors weights (fp8kit never unpickles .bin files)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as err:
            raise ExportError(f"corrupted weights file {f}: {err}") from err
    return tensors


def model_from_config(path: Path, raw: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The model ``config.json`` (``raw``, its ``quantization_config`` dropped) describes, with fresh weights: the
    class its ``architectures`` names, else a causal LM, image-text-to-text or speech-to-text class of its
    config class."""
    from transformers import AutoConfig, AutoModelForCausalLM

    clean = {k: v for k, v in raw.items() if k != "quantization_config"}
    try:
        config = AutoConfig.for_model(**clean)
    except (ValueError, KeyError) as err:
        raise ExportError(f"{path}/config.json: unknown model config ({err})") from err
    import transformers
    from transformers.models.auto import modeling_auto as auto

    # the class that wrote it, else the Auto class, else a causal LM class of this config class (Emu3's text
    # config), else a multimodal one (Llava, Whisper); a class of another config class where transformers' Auto
    # mappings give it this model type (ShieldGemma 2's Gemma3ForConditionalGeneration)
    mappings = (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )
    mapped = {m.get(getattr(config, "model_type", None)) for m in mappings}
    names = list(clean.get("architectures") or [])
    if type(config) not in auto.MODEL_FOR_CAUSAL_LM_MAPPING:
        names += [n for m in mappings for n in m.values()]
    for name in names:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is not None and (type(config) is getattr(cls, "config_class", None) or name in mapped):
            return cls._from_config(config, dtype=dtype)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` in the place of the submodule ``name``."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def load_layer(model: nn.Module, path: Any, name: str, build: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace the ``nn.Linear`` ``name`` with ``build(linear)``, the layer made from a checkpoint's tensors;
    a missing tensor or a wrong shape raises ``ExportError`` naming the checkpoint and the tensor."""
    lin = model.get_submodule(name)
    try:
        new = build(lin)
    except KeyError as err:
        raise ExportError(f"{path}: tensor {err.args[0]} is missing") from err
    except RuntimeError as err:
        raise ExportError(f"{path}: tensors of {name} have the wrong shape ({err})") from err
    packed = getattr(getattr(new, "scheme", None), "is_fp4", False)  # FP4: two codes per byte
    in_features, out_features = linear_dims(lin)  # nn.Linear, or Conv1D (weight stored (in, out))
    want = (out_features, in_features // 2 if packed else in_features)
    if tuple(new.weight.shape) != want:
        raise ExportError(f"{path}: {name}'s weight codes have shape {tuple(new.weight.shape)}, the model needs {want}")
    replace_module(model, name, new)


def load_rest(model: nn.Module, path: Path, tensors: dict[str, torch.Tensor], replaced: list[str], dtype) -> None:
    """Load the tensors left after the quantized layers took theirs; ``ExportError`` when the checkpoint
    does not fit the model (missing or unexpected keys)."""
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    model.tie_weights()
    tied = tied_aliases(model.state_dict())
    prefixes = tuple(f"{n}." for n in replaced)
    missing = [k for k in missing if k not in tied and not k.startswith(prefixes) and "rotary_emb" not in k]
    if missing or unexpected:
        raise ExportError(f"{path} does not fit its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
