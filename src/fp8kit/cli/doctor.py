"""``fp8kit doctor``: FP8 beside BF16 for a few steps; a report of where, when and why they part."""

from __future__ import annotations

import argparse

from ._common import (
    add_device_options,
    add_overwrite,
    at_least,
    check_run_dir,
    clear_run_dir,
    job_device,
    model,
    model_size,
    positive_float,
    positive_int,
    text_file,
)

NAME = "doctor"
SUMMARY = "run FP8 beside BF16 and report where, when and why they part"
DESCRIPTION = (
    "Train FP8 and BF16 copies side by side for a few steps and write a report (report.md with plots) "
    "naming the layers, operands and steps where FP8 departs, with ranked fixes."
)
WRITES = ("report.md", "report.json", "fp8_stats.jsonl", "loss.png", "heatmaps.png")
SIGNATURE = ("report.json", ("healthy", "culprits", "recipe"))


def recipe_name(text: str) -> str:
    """One recipe name."""
    from ..numerics.recipes import TRAINING_RECIPE_NAMES, recipe_from_name

    try:
        recipe_from_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown recipe {text!r}; accepted: {', '.join(TRAINING_RECIPE_NAMES)}"
        ) from None
    return text


def attention_name(text: str) -> str:
    """An attention recipe name (``nn.attention.attention_recipe``'s spellings)."""
    from ..nn.attention import attention_recipe

    try:
        attention_recipe(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def add_arguments(d: argparse.ArgumentParser) -> None:
    from ..debug.doctor import DEFAULT_LR, DEFAULT_STEPS

    d.add_argument(
        "--model",
        type=model(allow_demo=True),
        default="demo",
        help="demo (the fp8kit train Llama), smollm2, a local HF directory or a Hub ID ORG/NAME[@REVISION]",
    )
    d.add_argument("--model-size", type=model_size, default="small", help="size of the demo model: tiny|small|base")
    d.add_argument(
        "--arch",
        choices=("dense", "moe", "gpt_oss"),
        default="dense",
        help="demo model, as fp8kit train --arch: dense (Llama), moe (Qwen3-MoE; the report reads each expert) or "
        "gpt_oss (GPT-OSS)",
    )
    d.add_argument("--recipe", type=recipe_name, default="delayed", help="delayed|current|rowwise|block|mxfp8|nvfp4")
    d.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, help="training steps of each copy")
    d.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    d.add_argument("--seq-len", type=at_least(2), default=64, help="tokens per sequence")
    d.add_argument("--lr", type=positive_float, default=DEFAULT_LR, help="learning rate (AdamW), as fp8kit train's")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    d.add_argument("--text", type=text_file, default=None, help="use this UTF-8 text instead of the shipped corpus")
    d.add_argument(
        "--attention",
        type=attention_name,
        default=None,
        help="FP8 attention in the FP8 copy too (fp8kit.convert's attention=: fp8, fp8-head, current, mxfp8, ...); "
        "a departure there is fixed by BF16 attention in the blocks named",
    )
    d.add_argument(
        "--apply",
        action="store_true",
        help="re-run with the top fix (a recipe, BF16 layers, Smooth-SwiGLU) and show whether the finding is gone",
    )
    d.add_argument(
        "--noise-floor",
        action="store_true",
        help="also train BF16 with one layer's weights one ulp off: a gap within twice its spread is not FP8's",
    )
    d.add_argument(
        "--out",
        default="runs/fp8kit-doctor",
        help="folder for report.md and its plots (one that holds a report needs --overwrite)",
    )
    add_device_options(d)
    add_overwrite(d, "report")


def run(args: argparse.Namespace) -> int:
    out = check_run_dir(args.out, WRITES, SIGNATURE, args.overwrite, kind="doctor report")
    from ..jobs import doctor as doctor_job
    from ..numerics.recipes import recipe_from_name

    recipe = recipe_from_name(args.recipe)
    if args.arch != "dense" and args.model != "demo":
        raise ValueError(f"--arch {args.arch} builds the demo model: leave out --model {args.model}")
    device = job_device(args, recipe)
    doctor_job.announce_cost(args, device)
    if args.overwrite:
        clear_run_dir(out, WRITES)
    doctor_job.run(args, recipe, device, out)
    return 0
