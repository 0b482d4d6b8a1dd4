"""``fp8kit eval``: held-out loss and perplexity of a ``fp8kit train`` checkpoint, or of a pretrained model
as shipped, on the held-out split of the shipped corpus (or of ``text``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..data import load_corpus
from ..data.evaluation import evaluate
from ..runtime.progress import counting
from .loading import CheckpointError, rebuild_run, train_checkpoint

__all__ = ["evaluate_checkpoint", "evaluate_pretrained"]


def evaluate_checkpoint(
    checkpoint: str | Path, text: str | None = None, batches: int = 32, device: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Held-out loss and perplexity of a ``fp8kit train`` checkpoint (a run folder or ``ckpt/<run>``), the
    model on ``device``."""
    path = Path(checkpoint)
    found = train_checkpoint(path)
    if found is None:
        raise CheckpointError(f"no fp8kit checkpoint in {path} (give a run's ckpt/<run> folder)")
    run = rebuild_run(found, text)
    corpus = load_corpus(text, run.tokenizer)
    corpus.check_fits(run.config.seq_len)
    run.model.to(device)
    cfg = run.config
    with counting(run.model, batches * cfg.batch_size, f"  eval {run.run}", "seq"):
        loss = evaluate(run.model, corpus.val_batches(batches, cfg.batch_size, cfg.seq_len, cfg.seed))
    return {"run": run.run, "step": run.step, "val_loss": loss, "val_ppl": math.exp(loss), "corpus": corpus.name}


def evaluate_pretrained(
    model_name: str,
    text: str | None = None,
    batches: int = 16,
    batch_size: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    device: str | torch.device = "cpu",
    reference: str | None = None,
) -> dict[str, Any]:
    """Held-out loss and perplexity of a pretrained model as shipped: FP32 weights on the CPU, BF16 on a GPU
    (``device.work_dtype``); an FP8/INT8/FP4 export fp8kit reads computes with fp8kit's inference layers, as it is
    served (``export.load_pretrained``: quantized activations and KV cache included). With ``reference`` (a model name or folder, e.g. the BF16 model an export
    was quantized from), also ``kl`` (``KL(P_ref || P)``, nats/token) and ``top1`` (top-1 agreement) on the
    same held-out tokens (``evaluation.divergence``)."""
    from ..data.evaluation import divergence
    from ..models.pretrained import load_pretrained_lm
    from ..runtime.device import work_dtype
    from .loading import load_served

    device = torch.device(device)
    model, tokenizer = load_served(model_name, work_dtype(device), device) or load_pretrained_lm(
        model_name, work_dtype(device), device
    )
    corpus = load_corpus(text, tokenizer)
    corpus.check_fits(seq_len)
    held_out = corpus.val_batches(batches, batch_size, seq_len, seed)
    with counting(model, batches * batch_size, f"  eval {model_name}", "seq"):
        loss = evaluate(model, held_out)
    out = {"run": model_name, "step": 0, "val_loss": loss, "val_ppl": math.exp(loss), "corpus": corpus.name}
    if reference is not None:
        ref, _ = load_pretrained_lm(reference, work_dtype(device), device)
        sizes = [getattr(m.get_output_embeddings(), "out_features", None) for m in (model, ref)]
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"--reference {reference} predicts {sizes[1]} tokens and {model_name} {sizes[0]}: "
                "give the model it was quantized from (the same tokenizer)"
            )
        out |= {"reference": reference, **divergence(model, ref, held_out)}
    return out
