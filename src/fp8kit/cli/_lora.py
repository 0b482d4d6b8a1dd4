"""``fp8kit train --model DIR --lora R``: LoRA adapters trained on a quantized checkpoint (``jobs.lora``)."""

from __future__ import annotations

import argparse

from ._common import UsageError

# lr: the lowest dev loss of 200-step SmolLM2 runs from 2e-4 to 1.6e-3 on the BF16 base (docs/qat.md)
LORA_STEPS, LORA_LR, LORA_BATCH, LORA_SEQ = 20, 8e-4, 4, 128  # when --steps/--lr/--batch-size/--seq-len are not given


def add_lora_argument(t: argparse.ArgumentParser) -> None:
    """``--lora R``."""
    t.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="fine-tune LoRA adapters of rank R on the quantized checkpoint --model DIR (fp8kit quantize --out DIR), "
        f"the base kept quantized; writes the adapter to --out (defaults: {LORA_STEPS} steps, lr {LORA_LR:g})",
    )


def run_lora(args: argparse.Namespace) -> int:
    """Train, measure and write the adapter (``jobs.lora.lora_finetune``)."""
    from ..jobs.lora import lora_finetune

    try:
        _, run = lora_finetune(
            args.model, args.lora, args.out, text=args.text, steps=args.steps or LORA_STEPS, lr=args.lr or LORA_LR,
            batch_size=args.batch_size or LORA_BATCH, seq_len=args.seq_len or LORA_SEQ,
        )  # fmt: skip
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(run.line(), flush=True)
    return 0
