"""``fp8kit eval``: held-out loss and perplexity of ``fp8kit train`` checkpoints or of a pretrained model."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..jobs.announce import announce_inference, print_device_peak
from ._common import (
    PRETRAINED_MODELS,
    TRAIN_OUT,
    UsageError,
    add_device_options,
    job_device,
    model,
    positive_int,
    text_file,
)

# The held-out batches of a demo run's evaluations in training (``TrainConfig.eval_batches``): the same
# batches, so ``fp8kit eval`` of a checkpoint prints the perplexity of the training summary.
CHECKPOINT_BATCHES = 16

NAME = "eval"
SUMMARY = "held-out perplexity of fp8kit train checkpoints or of a pretrained model"
DESCRIPTION = f"Held-out loss and perplexity. With no option: every run that `fp8kit train` wrote to {TRAIN_OUT}."


def existing_path(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(
            f"no fp8kit checkpoint at {text!r} (it does not exist): give a run's ckpt/<run> folder"
        )
    return text


def add_arguments(e: argparse.ArgumentParser) -> None:
    e.add_argument(
        "--checkpoint",
        type=existing_path,
        default=None,
        help=f"a run folder of fp8kit train, one of its ckpt/<run> folders, or a step-* folder (default {TRAIN_OUT})",
    )
    e.add_argument(
        "--model",
        type=model(allow_demo=False, demo_hint="; for a trained demo run give --checkpoint"),
        default=None,
        help="smollm2, a local Hugging Face directory or a Hub ID ORG/NAME[@REVISION]",
    )
    e.add_argument(
        "--text", type=text_file, default=None, help="evaluate on this text's held-out split instead of the corpus"
    )
    e.add_argument(
        "--eval-batches",
        type=positive_int,
        default=None,
        help=f"held-out batches (default {CHECKPOINT_BATCHES} for a checkpoint, the batches of fp8kit train's "
        "summary, so the perplexities match; 8 for a pretrained model, as fp8kit train's fine-tuning uses)",
    )
    e.add_argument("--batches", dest="eval_batches", type=positive_int, help=argparse.SUPPRESS)  # older name
    e.add_argument(
        "--reference",
        type=model(allow_demo=False),
        default=None,
        help="with --model: also the KL divergence to this model's next-token distribution (e.g. the BF16 model an "
        "export was quantized from) and top-1 agreement, on the same held-out tokens",
    )
    e.add_argument(
        "--engine",
        choices=["vllm"],
        default=None,
        help="also score the export --checkpoint DIR in this serving engine, beside fp8kit's own number on the "
        "same tokens (vllm: needs FP8KIT_VLLM_PYTHON, see scripts/vllm_env.sh)",
    )
    add_device_options(e)


def run_engine(args: argparse.Namespace) -> int:
    """``--engine vllm``: the export ``--checkpoint`` scored by fp8kit and by vLLM on the same held-out windows."""
    from ..engines.vllm import score_beside_fp8kit, vllm_unavailable

    if args.checkpoint is None or args.model is not None:
        raise UsageError("--engine vllm scores an export folder: give --checkpoint DIR (from fp8kit quantize)")
    reason = vllm_unavailable()
    if reason:
        raise UsageError(f"--engine vllm: {reason}")
    windows = args.eval_batches or 4
    res = score_beside_fp8kit(args.checkpoint, n_windows=windows, text=args.text)
    print(f"{args.checkpoint}: held-out perplexity over {res['tokens']} tokens ({windows} windows of 256)")
    print(f"  fp8kit (export.load_pretrained): {res['fp8kit_ppl']:.3f}")
    r = res["result"]
    if res["vllm_ppl"] is not None:
        rel = 100 * (res["vllm_ppl"] / res["fp8kit_ppl"] - 1)
        print(f"  vLLM {res['vllm']} ({r['quant_config']}): {res['vllm_ppl']:.3f} ({rel:+.2f}%)")
        return 0
    err = r["error"] or {}
    print(f"  vLLM {res['vllm']}: did not run it ({err.get('stage')}): {err.get('text', '').splitlines()[0][:300]}")
    return 1


def run(args: argparse.Namespace) -> int:
    if args.engine is not None:
        return run_engine(args)
    if args.model is not None and args.checkpoint is not None:
        raise UsageError("give --checkpoint (a trained run) or --model (a pretrained model), not both")
    if args.reference is not None and args.model is None:
        raise UsageError("--reference goes with --model (the model to score against it)")
    if args.model is None:
        from ..jobs.loading import train_runs

        where = Path(args.checkpoint or TRAIN_OUT)
        runs = train_runs(where)
        if not runs:
            raise UsageError(
                f"no fp8kit checkpoint in {where}: run `fp8kit train` first, or give --checkpoint "
                f"(a run's ckpt/<run> folder) or --model {'|'.join(PRETRAINED_MODELS)}|DIR"
            )
    from ..jobs.evaluate import evaluate_checkpoint, evaluate_pretrained

    device = job_device(args)
    if args.model is not None:
        announce_inference(args, "eval", device, {"evaluate": 1}, (args.eval_batches or 8) * 4 * 128, quantized=False)
        results = [
            evaluate_pretrained(
                args.model, text=args.text, batches=args.eval_batches or 8, device=device, reference=args.reference
            )
        ]
    else:
        batches = args.eval_batches or CHECKPOINT_BATCHES
        results = [evaluate_checkpoint(r, text=args.text, batches=batches, device=device) for r in runs]
    for res in results:
        print(
            f"{res['run']} (step {res['step']}) on the held-out split of {res['corpus']}: "
            f"loss {res['val_loss']:.4f} nats/token, perplexity {res['val_ppl']:.3f}"
            + (
                f"; KL to {res['reference']} {res['kl']:.5f} nats/token, top-1 agreement {100 * res['top1']:.2f}%"
                if "kl" in res
                else ""
            )
        )
    print_device_peak(device)
    return 0
