"""LoRA fine-tuning on a quantized checkpoint: what ``fp8kit train --model DIR --lora R`` runs.

The checkpoint (fp8kit's, compressed-tensors or ModelOpt) loads with ``fp8kit.export.load_pretrained``, its
quantized layers kept as ``QuantLinear`` (8-bit or packed FP4 weights in memory); ``fp8kit.qat.lora_config``
puts peft LoRA adapters of rank ``r`` on every quantized layer; AdamW trains the adapters alone on the
next-token cross-entropy over windows of the calibration split of the text (the shipped KJV or ``--text``),
with a cosine decay; the dev-split loss is measured before and after; the adapter is written with peft's
``save_pretrained`` (vLLM's LoRA serving reads it beside the base checkpoint; ``fp8kit.qat.merge_lora``
folds it into the base, re-quantized).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..data import windows
from ..data.evaluation import window_losses
from ..data.splits import available_windows
from ..ptq.linear import QuantLinear
from .quantize import load_splits

__all__ = ["LoraRun", "held_out_loss", "lora_finetune", "train_adapters"]


@dataclass
class LoraRun:
    """What ``lora_finetune`` measured: dev loss before and after, the adapter's trainable parameters, the
    quantized layers it sits on, and where it was written."""

    before: float
    after: float
    trainable: int
    layers: int
    steps: int
    out: Path

    def line(self) -> str:
        return (
            f"LoRA on {self.layers} quantized layers ({self.trainable} trainable parameters), {self.steps} steps: "
            f"dev loss {self.before:.4f} -> {self.after:.4f} (ppl {math.exp(self.before):.3f} -> "
            f"{math.exp(self.after):.3f}); adapter written to {self.out}"
        )


def held_out_loss(model: nn.Module, held_out: torch.Tensor) -> float:
    """Mean next-token loss of ``model`` on the ``held_out`` token windows."""
    with torch.no_grad():
        return float(window_losses(model, held_out, batch_size=4).mean())


def lora_finetune(
    model_dir: str | Path,
    rank: int,
    out: str | Path,
    *,
    text: str | None = None,
    steps: int = 20,
    lr: float = 8e-4,
    batch_size: int = 4,
    seq_len: int = 128,
    eval_windows: int = 4,
    eval_seq_len: int = 256,
) -> tuple[nn.Module, LoraRun]:
    """Train LoRA adapters of rank ``rank`` on the quantized checkpoint in ``model_dir`` (module doc) and
    write them to ``out``; returns the peft model (its base still quantized) and what was measured."""
    from transformers import AutoTokenizer

    from ..export import load_pretrained
    from ..qat.lora import lora_config

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"--lora takes the adapters' rank, a whole number >= 1, got {rank!r}")
    model = load_pretrained(model_dir)
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not quantized:
        raise ValueError(
            f"{model_dir} holds no quantized layer: --lora fine-tunes a quantized checkpoint (fp8kit quantize --out "
            "DIR); train a float model without --lora"
        )
    import peft

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    splits = load_splits(text, tokenizer, second_text=False)[0]
    n_train = min(available_windows(splits.calib, seq_len, splits.block), max(steps, 1) * batch_size)
    if n_train < 1:
        raise ValueError(f"{splits.name} is too short to train on windows of {seq_len + 1} tokens: lower --seq-len")
    train = windows(splits.calib, n_train, seq_len, splits.block).split(batch_size)
    eval_seq_len = min(eval_seq_len, seq_len, splits.block - 1)
    n_eval = min(eval_windows, available_windows(splits.dev, eval_seq_len, splits.block))
    if n_eval < 1:
        raise ValueError(f"{splits.name}'s dev split is too short for windows of {eval_seq_len + 1} tokens")
    held_out = windows(splits.dev, n_eval, eval_seq_len, splits.block)
    targets = sorted({n.rsplit(".", 1)[-1] for n in quantized})
    model = peft.get_peft_model(model, lora_config(r=rank, lora_alpha=2 * rank, target_modules=targets))
    before, after = train_adapters(model, train, held_out, steps, lr)
    out = Path(out)
    model.save_pretrained(str(out))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, LoraRun(before, after, trainable, len(quantized), steps, out)


def train_adapters(
    model: nn.Module,
    train: list[torch.Tensor] | tuple[torch.Tensor, ...],
    held_out: torch.Tensor,
    steps: int,
    lr: float,
) -> tuple[float, float]:
    """The LoRA training loop: AdamW (no weight decay) on ``model``'s trainable parameters with a cosine decay
    from ``lr``, ``steps`` batches of ``train`` (token windows, cycled) on the next-token cross-entropy; returns
    the mean loss on ``held_out`` windows before and after."""
    params = [p for p in model.parameters() if p.requires_grad]
    before = held_out_loss(model, held_out)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / max(steps, 1))))
    model.train()
    for i in range(steps):
        ids = train[i % len(train)]
        logits = model(input_ids=ids[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        if not torch.isfinite(loss):
            raise ValueError(f"--lora: the loss at step {i} is {float(loss)}: lower --lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return before, held_out_loss(model, held_out)
