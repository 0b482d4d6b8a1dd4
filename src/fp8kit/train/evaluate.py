"""``fp8kit eval``: held-out loss and perplexity of a ``fp8kit train`` checkpoint, or of a pretrained model
as shipped, on the held-out split of the shipped corpus (or of ``text``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..data import load_corpus
from ..evaluation import evaluate
from ..progress import counting
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_info
from .loop import TrainConfig, build_base, make_model

__all__ = ["evaluate_checkpoint", "evaluate_pretrained"]


def evaluate_checkpoint(
    checkpoint: str | Path, text: str | None = None, batches: int = 32, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Held-out loss and perplexity of a ``fp8kit train`` checkpoint (a run folder or ``ckpt/<run>``), the
    model on ``device``."""
    path = Path(checkpoint)
    found = latest_checkpoint(path)
    if found is None and (path / "model.safetensors").is_file():
        found = path
    if found is None:
        raise CheckpointError(f"no fp8kit checkpoint in {path} (give a run's ckpt/<run> folder)")
    info = read_info(found)
    missing = [k for k in ("run", "model_size", "seed", "seq_len", "batch_size") if k not in info]
    if missing:
        raise CheckpointError(f"checkpoint {found} lacks {', '.join(missing)}: not written by fp8kit train")
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
    corpus = load_corpus(text, tokenizer)
    corpus.check_fits(cfg.seq_len)
    model = make_model(base, cfg, info["run"])
    step, _ = load_checkpoint(found, model)
    model.to(device)
    with counting(model, batches * cfg.batch_size, f"  eval {info['run']}", "seq"):
        loss = evaluate(model, corpus.val_batches(batches, cfg.batch_size, cfg.seq_len, cfg.seed))
    return {"run": info["run"], "step": step, "val_loss": loss, "val_ppl": math.exp(loss), "corpus": corpus.name}


def evaluate_pretrained(
    model_name: str,
    text: str | None = None,
    batches: int = 16,
    batch_size: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Held-out loss and perplexity of a pretrained model as shipped (no FP8): FP32 weights on the CPU, BF16
    on a GPU (``device.work_dtype``)."""
    from ..device import work_dtype
    from ..models.pretrained import load_pretrained_lm

    device = torch.device(device)
    model, tokenizer = load_pretrained_lm(model_name, work_dtype(device), device)
    corpus = load_corpus(text, tokenizer)
    corpus.check_fits(seq_len)
    with counting(model, batches * batch_size, f"  eval {model_name}", "seq"):
        loss = evaluate(model, corpus.val_batches(batches, batch_size, seq_len, seed))
    return {"run": model_name, "step": 0, "val_loss": loss, "val_ppl": math.exp(loss), "corpus": corpus.name}
