"""Save and load quantized models as Hugging Face directories in the compressed-tensors format.

This is the format vLLM serves and ``transformers`` (with the ``compressed-tensors`` package) loads:
``config.json`` carries a ``quantization_config`` with ``quant_method: "compressed-tensors"``, and
the safetensors files hold, for each quantized ``Linear`` named ``NAME``:

* ``float-quantized`` (FP8): ``NAME.weight`` (F8_E4M3), ``NAME.weight_scale`` (float32, ``(1,)`` per
  tensor or ``(out, 1)`` per channel) and, for static activations, ``NAME.input_scale`` (``(1,)``);
* ``int-quantized`` (INT8 W8A8): the same with an int8 ``NAME.weight``;
* ``pack-quantized`` (INT8 weight-only): ``NAME.weight_packed`` (int32, four offset-by-128 bytes per
  word, little-endian), ``NAME.weight_scale`` and ``NAME.weight_shape``.

Scales are dequant multipliers (``amax / 448`` for E4M3, ``amax / 127`` for INT8). An FP8 KV cache adds
``kv_cache_scheme`` and per-layer ``self_attn.k_scale`` / ``self_attn.v_scale``. Loading reads JSON and
safetensors only (nothing is unpickled).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .ptq.linear import QuantLinear
from .ptq.schemes import SCHEMES, Scheme
from .state_dict import tied_aliases

__all__ = ["ExportError", "check_export_dir", "load_pretrained", "save_pretrained"]

QUANT_METHOD = "compressed-tensors"


class ExportError(ValueError):
    """A directory that is not a (supported) compressed-tensors export, or a model that cannot be saved."""


def _args(scheme: Scheme, which: str) -> dict[str, Any] | None:
    fmt = scheme.weight_format if which == "weights" else scheme.act_format
    if fmt is None:
        return None
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


def quantization_config(scheme: Scheme, ignore: list[str], kv_cache: bool) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json`` for ``scheme``."""
    kv = None
    if kv_cache:
        kv = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}
    return {
        "quant_method": QUANT_METHOD,
        "format": scheme.export_format,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _args(scheme, "weights"),
                "input_activations": _args(scheme, "input"),
                "output_activations": None,
                "format": scheme.export_format,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": kv,
        "sparsity_config": {},
        "global_compression_ratio": None,
        "producer": "fp8kit",
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


MANIFEST = ".fp8kit-export"  # the files an export wrote: a later export may replace them, nothing else


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


def save_pretrained(model: nn.Module, out_dir: str | Path, tokenizer: Any = None, *, overwrite: bool = False) -> Path:
    """Write a ``fp8kit.ptq``-quantized model as a compressed-tensors directory.

    The export is written into a temporary sibling folder and renamed into place, so ``out_dir`` is
    either the complete new export or left as it was; the temporary folder is removed on failure. An
    existing ``out_dir`` is replaced only if fp8kit wrote everything in it (see ``check_export_dir``),
    or with ``overwrite=True``.
    """
    from safetensors.torch import save_file

    report = getattr(model, "ptq_report", None)
    qlayers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not qlayers or report is None:
        raise ExportError("save_pretrained takes a model quantized by fp8kit.ptq.quantize (none of its layers are)")
    scheme = SCHEMES[report.scheme]
    config = getattr(model, "config", None)
    if config is None:
        raise ExportError("save_pretrained needs a Hugging Face model (with .config) to write config.json")
    out = check_export_dir(out_dir, overwrite)
    tensors: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    aliases = tied_aliases(state)
    prefixes = tuple(f"{n}." for n in qlayers)
    for key, val in state.items():
        if key in aliases or key.startswith(prefixes):
            continue
        tensors[key] = val.detach().contiguous()
    for name, q in qlayers.items():
        if scheme.export_format == "pack-quantized":
            tensors[f"{name}.weight_packed"] = pack_int8(q.weight)
            tensors[f"{name}.weight_shape"] = torch.tensor([q.out_features, q.in_features])
        else:
            tensors[f"{name}.weight"] = q.weight.contiguous()
        tensors[f"{name}.weight_scale"] = q.weight_scale.float().contiguous()
        if q.input_scale is not None:
            tensors[f"{name}.input_scale"] = q.input_scale.float().contiguous()
        if q.bias is not None:
            tensors[f"{name}.bias"] = q.bias.contiguous()
    kv = bool(report.kv_cache)
    if kv:
        for name, m in model.named_modules():
            if hasattr(m, "k_scale") and hasattr(m, "v_scale") and hasattr(m, "k_proj"):
                tensors[f"{name}.k_scale"] = m.k_scale.float().contiguous()
                tensors[f"{name}.v_scale"] = m.v_scale.float().contiguous()
    cfg = config.to_dict()
    cfg["quantization_config"] = quantization_config(scheme, list(report.skipped), kv)
    cfg.pop("_attn_implementation_autoset", None)
    cfg.pop("_fp8kit_inner_attn", None)
    if cfg.get("_attn_implementation") == "fp8kit_fp8_kv":
        cfg.pop("_attn_implementation")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out, "tmp")
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            (tmp / "generation_config.json").write_text(gen.to_json_string())
        if tokenizer is not None:
            getattr(tokenizer, "tok", tokenizer).save_pretrained(tmp)
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({"producer": "fp8kit", "files": files}))
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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


def _matches(name: str, module: nn.Module, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == type(module).__name__ or name == p or name.endswith(f".{p}"):
            return True
    return False


def _scheme_of(group: dict[str, Any], fmt: str) -> Scheme:
    w, a = group.get("weights"), group.get("input_activations")
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
                return s
            if a is not None and s.act_format is not None and a.get("type") == s.act_format.kind:
                strat = "token" if a.get("dynamic") else a.get("strategy")
                if strat == s.act_strategy:
                    return Scheme(
                        s.name, s.weight_format, w["strategy"], s.act_format, strat, s.smooth, fmt, s.description
                    )
    raise ExportError(f"unsupported compressed-tensors scheme (format {fmt!r}, weights {w}, activations {a})")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ExportError(f"{path} holds no .safetensors weights (fp8kit never unpickles .bin files)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as err:
            raise ExportError(f"corrupted weights file {f}: {err}") from err
    return tensors


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a compressed-tensors directory (fp8kit's or another tool's) into fp8kit ``QuantLinear``s."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{path} is not a Hugging Face model directory (config.json missing)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{cfg_file} is not valid JSON: {err}") from err
    qc = raw.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        raise ExportError(f"{path} is not a compressed-tensors export (quant_method {method!r})")
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ExportError(f"fp8kit loads exports with one config group, {path} has {len(groups)}")
    scheme = _scheme_of(groups[0], fmt)
    targets, ignore = groups[0].get("targets") or ["Linear"], qc.get("ignore") or []
    clean = {k: v for k, v in raw.items() if k != "quantization_config"}
    try:
        config = AutoConfig.for_model(**clean)
    except (ValueError, KeyError) as err:
        raise ExportError(f"{cfg_file}: unknown model config ({err})") from err
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = _read_tensors(path)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and _matches(n, m, targets)]
    names = [n for n in names if not _matches(n, model.get_submodule(n), ignore)]
    for name in names:
        lin = model.get_submodule(name)
        q = QuantLinear(lin.in_features, lin.out_features, lin.bias is not None, scheme)
        try:
            if fmt == "pack-quantized":
                q.weight = unpack_int8(tensors.pop(f"{name}.weight_packed"), lin.in_features)
                tensors.pop(f"{name}.weight_shape", None)
            else:
                q.weight = tensors.pop(f"{name}.weight").to(scheme.weight_format.dtype)
            q.weight_scale = tensors.pop(f"{name}.weight_scale").float().reshape(q.weight_scale.shape)
            if scheme.static_activations:
                q.input_scale = tensors.pop(f"{name}.input_scale").float().reshape(1)
            if lin.bias is not None:
                q.bias = tensors.pop(f"{name}.bias").float()
        except KeyError as err:
            raise ExportError(f"{path}: tensor {err.args[0]} is missing") from err
        except RuntimeError as err:
            raise ExportError(f"{path}: tensors of {name} have the wrong shape ({err})") from err
        if tuple(q.weight.shape) != (lin.out_features, lin.in_features):
            raise ExportError(
                f"{path}: {name}.weight has shape {tuple(q.weight.shape)}, the model needs "
                f"{(lin.out_features, lin.in_features)}"
            )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
    kv_scales = {k: tensors.pop(k) for k in list(tensors) if k.endswith((".k_scale", ".v_scale"))}
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    model.tie_weights()
    tied = tied_aliases(model.state_dict())
    qbuffers = {f"{n}.{b}" for n in names for b in ("weight", "weight_scale", "input_scale", "bias")}
    missing = [k for k in missing if k not in tied and k not in qbuffers and "rotary_emb" not in k]
    if missing or unexpected:
        raise ExportError(f"{path} does not fit its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if qc.get("kv_cache_scheme"):
        from .ptq.kv_cache import enable_fp8_kv

        blocks = enable_fp8_kv(model, "quantize")
        for name, m in blocks.items():
            for which in ("k", "v"):
                key = f"{name}.{which}_scale"
                if key not in kv_scales:
                    raise ExportError(f"{path}: kv_cache_scheme is set but {key} is missing")
                m.register_buffer(f"{which}_scale", kv_scales[key].float().reshape(1))
    from .ptq.quantize import PTQReport

    report = PTQReport(scheme.name, quantized=names, kv_cache=bool(qc.get("kv_cache_scheme")))
    report.skipped = {
        n: "in the export's ignore list"
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and type(m) is nn.Linear
    }
    object.__setattr__(model, "ptq_report", report)
    return model.eval()
