"""Which model a job starts from, loaded: a run folder ``fp8kit train`` wrote (its runs rebuilt with their trained
weights), a pretrained causal LM (``smollm2``, a local folder, a Hub ID, an FP8/INT8/FP4 checkpoint dequantized:
``models.pretrained.load_pretrained_lm``), or a quantized export in fp8kit's inference layers, as it is served."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..train.checkpoint import CheckpointError, latest_checkpoint

__all__ = [
    "CheckpointError",
    "TrainRun",
    "train_runs",
    "load_model",
    "load_train_checkpoint",
    "rebuild_run",
    "train_checkpoint",
]


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` of ``name_or_path``, the model in ``dtype`` on ``device``: a checkpoint
    ``fp8kit train`` wrote (the run's model with its trained weights, byte tokens), else a pretrained causal LM
    (``models.pretrained.load_pretrained_lm``: ``smollm2``, a Hugging Face directory or Hub ID, an FP8/INT8
    checkpoint dequantized)."""
    from ..models.pretrained import load_pretrained_lm

    trained = train_checkpoint(Path(name_or_path))
    if trained is not None:
        model, tokenizer = load_train_checkpoint(trained, dtype)
        return model.to(device), tokenizer
    return load_pretrained_lm(name_or_path, dtype, device)


def train_checkpoint(path: Path) -> Path | None:
    """The checkpoint an ``fp8kit train`` folder ``path`` holds (a ``ckpt/<run>`` folder: its latest step;
    or a ``step-*`` folder itself), or ``None`` when ``path`` is not one."""
    from ..train.checkpoint import latest_checkpoint

    if not path.is_dir():
        return None
    found = latest_checkpoint(path)
    if found is None and (path / "model.safetensors").is_file() and not (path / "config.json").is_file():
        found = path
    return found


def train_runs(path: Path) -> list[Path]:
    """``ckpt/<run>`` folders to evaluate: ``path`` itself, or every run of a ``fp8kit train`` folder."""
    if latest_checkpoint(path) is not None or (path / "model.safetensors").is_file():
        return [path]
    runs = sorted(p for p in (path / "ckpt").glob("*") if p.is_dir()) if (path / "ckpt").is_dir() else []
    return [r for r in runs if latest_checkpoint(r) is not None]


def load_train_checkpoint(path: Path, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """``(model, byte tokenizer)`` of an ``fp8kit train`` checkpoint: the run's model rebuilt from the
    checkpoint's settings (``--arch``, ``--model-size``, seed) with its trained weights; the ``bf16`` run as
    plain ``nn.Linear`` / experts modules, FP8 runs converted with their recipe and trained scales."""
    from ..train.checkpoint import read_info

    info = read_info(path)
    if info.get("model", "demo") != "demo":
        raise CheckpointError(f"{path} fine-tuned {info['model']!r}: give the serving export of that run instead")
    run = rebuild_run(path, plain_bf16=True)
    return run.model.to(dtype).eval(), run.tokenizer


@dataclass
class TrainRun:
    """A train checkpoint rebuilt: its model (trained weights loaded), tokenizer, settings and step."""

    model: torch.nn.Module
    tokenizer: Any
    config: Any  # train.loop.TrainConfig
    run: str
    step: int


def rebuild_run(path: Path, text: str | None = None, plain_bf16: bool = False) -> TrainRun:
    """The run an ``fp8kit train`` checkpoint ``path`` (a ``step-*`` folder) holds: its model rebuilt from the
    checkpoint's settings, converted with the run's recipe (``plain_bf16``: the ``bf16`` run as plain modules,
    else with the training run's BF16 GEMMs) and its trained weights and scales loaded; ``text`` the corpus
    the run's tokenizer and held-out batches come from."""
    from ..train.checkpoint import load_checkpoint, read_info
    from ..train.loop import TrainConfig, build_base, make_model

    info = read_info(path)
    missing = [k for k in ("run", "model_size", "seed", "seq_len", "batch_size") if k not in info]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: not written by fp8kit train")
    cfg = TrainConfig(
        model_size=info["model_size"],
        model=info.get("model", "demo"),
        arch=info.get("arch", "dense"),
        seed=info["seed"],
        seq_len=info["seq_len"],
        batch_size=info["batch_size"],
        text=text,
        plan=info.get("plan"),
    )
    base, tokenizer = build_base(cfg)
    model = base if plain_bf16 and info["run"] == "bf16" else make_model(base, cfg, info["run"])
    step, _ = load_checkpoint(path, model)
    return TrainRun(model, tokenizer, cfg, info["run"], step)


def load_served(name: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, Any] | None:
    """``(model, tokenizer)`` of a local export in a format ``export.load_pretrained`` reads, in its inference
    layers; ``None`` for anything else (a plain model, a Hub ID, a layout it does not read)."""
    import json

    from ..export import ExportError, load_pretrained
    from ..models.pretrained import HFTokenizer

    path = Path(name)
    config = path / "config.json"
    qc = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if not isinstance(qc, dict) or qc.get("quant_method") not in ("compressed-tensors", "modelopt", "fp8"):
        return None
    try:
        model = load_pretrained(path, dtype)
    except ExportError:
        return None  # e.g. an FP4 layout fp8kit reads only dequantized: load_pretrained_lm does
    from transformers import AutoTokenizer

    return model.to(device), HFTokenizer(AutoTokenizer.from_pretrained(path))
