"""``fp8kit doctor``: FP8 beside BF16 for a few steps; a report of where, when and why they part."""

from __future__ import annotations

import argparse

from ._common import (
    add_overwrite,
    at_least,
    check_run_dir,
    clear_run_dir,
    model,
    model_size,
    positive_float,
    positive_int,
    text_file,
)
from ._job import add_device_options, announce, job_device, print_device_peak, shape_of

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
    from ..data import load_corpus
    from ..debug import doctor
    from ..numerics.recipes import recipe_from_name
    from ..train.loop import TrainConfig, build_base

    recipe = recipe_from_name(args.recipe)
    if args.arch != "dense" and args.model != "demo":
        raise ValueError(f"--arch {args.arch} builds the demo model: leave out --model {args.model}")
    device = job_device(args, recipe)
    _announce_cost(args, device)
    if args.overwrite:
        clear_run_dir(out, WRITES)
    cfg = TrainConfig(
        model=args.model, model_size=args.model_size, seq_len=args.seq_len, seed=args.seed, arch=args.arch
    )
    model, tokenizer = build_base(cfg)
    corpus = load_corpus(args.text, tokenizer)
    corpus.check_fits(args.seq_len)
    batches = []
    for i in range(args.steps):
        x, _ = corpus.batch("train", i, args.batch_size, args.seq_len, args.seed)
        batches.append({"input_ids": x, "labels": x})
    report = doctor(
        model, batches, recipe=recipe, steps=args.steps, lr=args.lr, apply=args.apply, seed=args.seed, device=device,
        noise_floor=args.noise_floor, progress=True,
    )  # fmt: skip
    path = report.save(out)
    print(
        f"fp8kit doctor ({recipe.kind} vs bf16, {report.steps} steps): "
        f"{'healthy' if report.healthy else report.kind} - {report.summary}"
    )
    label = "latent" if report.kind == "latent" else "culprit"
    for c in report.culprits[:5]:
        print(f"  {label}: {c.layer} {c.operand} from step {c.step}: {c.reason}")
    for c in report.notes[: 3 if report.culprits else 5]:
        print(f"  note (no loss effect or marginal): {c.layer} {c.operand} from step {c.step}: {c.reason}")
    for i, r in enumerate(report.recommendations[:3], 1):
        print(f"  fix {i}: {r.action}")
    if report.applied:
        a = report.applied
        print(
            f"  applied fix 1: gap {100 * a['gap_before']:+.2f}% -> {100 * a['gap_after']:+.2f}%; "
            f"after: {'healthy' if a['healthy_after'] else a['kind_after']}"
        )
    print(f"wrote {path} (with loss.png, heatmaps.png, report.json, fp8_stats.jsonl)")
    print_device_peak(device)
    return 0


def _announce_cost(args: argparse.Namespace, device) -> None:
    """Two copies (BF16 and FP8) trained side by side, ``--apply``: twice; ``--noise-floor``: one more BF16 run."""
    from ..jobs.cost import estimate_training

    shape = shape_of(args.model, args.arch, args.model_size, args.seq_len)
    tokens = args.batch_size * args.seq_len
    runs = ["bf16 + fp8"] + (["apply fix"] if args.apply else [])
    from ..jobs.estimate import current_rates, doctor_rates, step_model

    rates = current_rates(device, [args.recipe])
    cost = estimate_training("doctor", shape, device, runs, 2 * args.steps, tokens, tokens, rates=rates)
    scale, fixed = doctor_rates(device, args.recipe)
    for run in runs:  # a BF16 and an FP8 copy each step, the statistics of every layer
        pair = sum(step_model(shape, r, tokens, tokens, rates) for r in ("bf16", args.recipe))
        cost.phases[run] = args.steps * scale * pair + fixed
    if args.noise_floor:  # one copy, not two
        bf16 = step_model(shape, "bf16", tokens, tokens, rates) * rates.step_scale.get("bf16", 1.0)
        cost.phases["bf16 one ulp off"] = args.steps * bf16
    cost.phases["report"] = 2 * rates.figure_s  # loss.png, heatmaps.png
    cost.device_bytes *= 2  # both copies live at once
    announce(cost, device, args.force)
