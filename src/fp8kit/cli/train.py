"""``fp8kit train``: the demo Llama (or a pretrained model) in BF16 and FP8 recipes side by side.

``--nproc N`` re-runs this same command line on N local processes through torchrun
(``distributed.launch``); each worker, started under torchrun, runs as one rank and does not launch again.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ..jobs import train as train_job
from ._common import (
    TRAIN_OUT,
    TRAIN_SIGNATURE,
    USER_ERRORS,
    Parser,
    UsageError,
    add_device_options,
    at_least,
    check_run_dir,
    clear_run_dir,
    model,
    model_size,
    positive_float,
    positive_int,
    read_json,
    text_file,
)

if TYPE_CHECKING:
    from ..train import TrainConfig

NAME = "train"
SUMMARY = "train a small Llama in BF16 and FP8 side by side on the shipped corpus"
DESCRIPTION = (
    "Train the same model from the same weights and batches in BF16 and in each FP8 recipe, then write "
    "a loss plot, a summary table and checkpoints to --out."
)
WRITES = ("config.json", "metrics.jsonl", "summary.json", "summary.md", "loss.png", "ckpt", "plan.json", "serving")
SIGNATURE = TRAIN_SIGNATURE
# What ``--resume`` takes from OUT/config.json: the settings that make the run what it is. An option given
# with a different value is refused; ``--steps`` and the eval/checkpoint intervals may change (train further).
RUN_SETTINGS = {
    "recipes": "recipe",
    "model": "model",
    "model_size": "model_size",
    "arch": "arch",
    "text": "text",
    "batch_size": "batch_size",
    "seq_len": "seq_len",
    "lr": "lr",
    "grad_accum": "grad_accum",
    "seed": "seed",
    "optimizer": "optimizer",
    "master_weights": "master_weights",
    "loss_budget": "loss_budget",
    "target": "target",
}
EXTENDABLE = ("steps", "eval_interval", "ckpt_interval")


def recipe_list(text: str) -> str:
    """``all``, ``auto`` or a comma list of recipe names."""
    from ..numerics.recipes import TRAINING_RECIPE_NAMES, recipe_from_name

    names = [s.strip() for s in text.split(",") if s.strip()]
    if text.strip().lower() == "all":
        return "all"
    if not names:
        raise argparse.ArgumentTypeError(
            f"give a recipe: {', '.join(TRAINING_RECIPE_NAMES)}, auto, all, or a comma list"
        )
    for n in names:
        if n.lower() == "auto":
            continue
        try:
            recipe_from_name(n)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown recipe {n!r}; accepted: {', '.join(TRAINING_RECIPE_NAMES)}, auto, all, or a comma list"
            ) from None
    return text


def add_arguments(t: argparse.ArgumentParser) -> None:
    """The options of ``fp8kit train``, one group per concern."""
    _add_model_options(t)
    _add_schedule_options(t)
    _add_optimizer_options(t)
    _add_parallel_options(t)
    add_device_options(t)
    _add_output_options(t)


def _add_model_options(t: argparse.ArgumentParser) -> None:
    from ..planner.roofline import TARGETS

    t.add_argument(
        "--recipe",
        default="delayed",
        type=recipe_list,
        help="delayed|current|rowwise|block|mxfp8|nvfp4|all (the FP8 ones), or a comma list; auto: a recipe per layer (or bf16), "
        "planned by fp8kit.autotune on the first batches for the least step time on --target within --loss-budget",
    )
    t.add_argument(
        "--loss-budget",
        type=float,
        default=0.01,
        help="--recipe auto: the predicted loss increase the plan may cost, relative (default 0.01 = 1%%)",
    )
    t.add_argument(
        "--target",
        choices=TARGETS,
        default="h100",
        help="--recipe auto: the step time the plan minimises: a GPU's roofline (h100, h200, b200) or timed on "
        "this CPU (default: h100)",
    )
    t.add_argument(
        "--model",
        default="demo",
        type=model(allow_demo=True),
        help="demo (a small Llama trained from scratch), smollm2 (fine-tune the shipped SmolLM2-135M), "
        "a local Hugging Face causal-LM directory, or a Hub ID ORG/NAME[@REVISION]",
    )
    t.add_argument("--model-size", type=model_size, default="small", help="size of the demo model: tiny|small|base")
    t.add_argument(
        "--arch",
        choices=("dense", "moe", "gpt_oss"),
        default="dense",
        help="demo model: dense (Llama), moe (Qwen3-MoE, 8 experts, top-2; router load balance reported) or gpt_oss "
        "(GPT-OSS: biased experts, clamped SwiGLU, attention sinks, sliding-window layers)",
    )
    t.add_argument(
        "--text", type=text_file, default=None, help="train on this UTF-8 text file instead of the shipped corpus"
    )
    t.add_argument("--compile", action="store_true", help="torch.compile the model")


def _add_schedule_options(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--steps", type=positive_int, default=None, help="optimizer steps (default 200; 20 when fine-tuning)"
    )
    t.add_argument(
        "--batch-size", type=positive_int, default=None, help="sequences per micro-batch (default 16; 4 fine-tuning)"
    )
    t.add_argument("--seq-len", type=at_least(2), default=None, help="tokens per sequence (default 128)")
    t.add_argument(
        "--lr", type=positive_float, default=None, help="peak learning rate (default 2e-3; 5e-5 fine-tuning)"
    )
    t.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batch order")
    t.add_argument(
        "--eval-interval",
        type=positive_int,
        default=None,
        help="steps between held-out evaluations (default 100; the last step when fine-tuning)",
    )
    t.add_argument(
        "--ckpt-interval",
        type=positive_int,
        default=None,
        help="steps between checkpoints (default 100; the last step when fine-tuning)",
    )


def _add_optimizer_options(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--optimizer",
        choices=("adamw", "fp8-adamw"),
        default="adamw",
        help="optimizer of the FP8 runs: adamw (torch, FP32 moments) or fp8-adamw (fp8kit.optim.AdamW, FP8 "
        "moments, ~2 bytes/param); the bf16 baseline always uses torch AdamW (default: adamw)",
    )
    t.add_argument(
        "--master-weights",
        choices=("fp32", "bf16"),
        default="fp32",
        help="precision of the FP8 runs' parameters: fp32, or bf16 updated with stochastic rounding "
        "(needs --optimizer fp8-adamw) (default: fp32)",
    )


def _add_parallel_options(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        help="processes on this machine (launched through torchrun): on the CPU with gloo, on CUDA one per GPU "
        "with NCCL; --batch-size stays the global batch, split evenly across them; only rank 0 writes files. "
        "Several machines: docs/distributed.md",
    )
    t.add_argument(
        "--fsdp",
        action="store_true",
        help="with --nproc N >= 2: shard parameters, gradients and optimizer state with FSDP2 instead of DDP",
    )
    t.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="tensor-parallel degree: --nproc N runs on an (N/T data-parallel) x T mesh; attention and MLP "
        "projections split over T ranks with FP8 scales agreed over the mesh (needs --fsdp when N > T)",
    )
    t.add_argument(
        "--sp",
        action="store_true",
        help="with --tp T: sequence parallelism (Megatron's): between the projections each rank keeps 1/T of the "
        "sequence; norms run on the shard, the attention/MLP inputs are all-gathered in FP8 and o/down "
        "reduce-scattered (--seq-len a multiple of T; dense model; default off)",
    )
    t.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="expert-parallel degree (--arch moe): experts placed across E ranks, tokens dispatched in FP8",
    )


def _add_output_options(t: argparse.ArgumentParser) -> None:
    t.add_argument("--out", default=TRAIN_OUT, help="run folder (one that holds a run needs --resume or --overwrite)")
    t.add_argument(
        "--resume",
        action="store_true",
        help="continue the runs in --out from their checkpoints, with the settings in OUT/config.json (an option "
        "that contradicts them is refused; a larger --steps trains further, the cosine schedule stretched to it)",
    )
    t.add_argument(
        "--export-format",
        default=None,
        help="after training, write each FP8 run's serving checkpoint (its trained scales) to OUT/serving/<run> in "
        "this format: compressed-tensors, modelopt or fp8-block (--model smollm2 or DIR)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the earlier fp8kit run in --out (its checkpoints, metrics, summaries and plot are removed "
        "first) or files there that fp8kit did not write",
    )


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of the parsed options: unset ones take the defaults of ``--model``."""
    from ..train import TrainConfig
    from ..train.loop import defaults_for, parse_recipes

    settings = defaults_for(args.model)
    for key in ("steps", "batch_size", "seq_len", "lr", "eval_interval", "ckpt_interval"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    settings.setdefault("eval_interval", 100 if args.model == "demo" else settings["steps"])
    settings.setdefault("ckpt_interval", 100 if args.model == "demo" else settings["steps"])
    return TrainConfig(
        recipes=parse_recipes(args.recipe),
        grad_accum=args.grad_accum,
        seed=args.seed,
        model_size=args.model_size,
        model=args.model,
        arch=args.arch,
        compile=args.compile,
        out=args.out,
        resume=args.resume,
        text=args.text,
        progress=not args.no_progress,
        optimizer=args.optimizer,
        master_weights=args.master_weights,
        nproc=args.nproc,
        fsdp=args.fsdp,
        tp=args.tp,
        ep=args.ep,
        sp=args.sp,
        device=args.device,
        emulate=args.emulate,
        loss_budget=args.loss_budget,
        target=args.target,
        **settings,
    )


def run(args: argparse.Namespace) -> int:
    cfg = checked_config(args)
    from ..distributed.launch import launch, should_launch, torchrun_worker

    if should_launch(cfg.nproc):  # --nproc N: this same command on N processes; each runs as one rank
        return launch(cfg.nproc, "fp8kit.cli", args.argv)
    with torchrun_worker() as rank:  # ranks > 0 print nothing: rank 0 speaks for the job
        if args.overwrite and not rank:
            clear_run_dir(cfg.out, WRITES)
        try:
            summary = train_job.run(cfg, getattr(args, "argv", None))
        except USER_ERRORS:
            if rank:
                return 2
            raise
        if summary is None:
            return 130
        train_job.print_summary(cfg, summary)
        if args.export_format and not rank:
            train_job.export(cfg, args.export_format)
    return 0


def checked_config(args: argparse.Namespace) -> TrainConfig:
    """The run's ``TrainConfig`` after every check that needs neither model nor data (the run folder,
    ``--resume``, ``--export-format``, ``train.check_config`` with ``--device``, the model's name), and the
    cost line (refused when the job will not fit): what N processes cannot take ends here, before any
    process starts."""
    from ..distributed.runtime import in_torchrun
    from ..train import check_config

    check_run_dir(args.out, WRITES, SIGNATURE, args.overwrite, resume=args.resume, kind="training run")
    if args.resume:
        resume_settings(args)
    cfg = train_config(args)
    if args.export_format:
        _check_export(cfg, args.export_format)
    check_config(cfg)
    if not in_torchrun():  # the launching process speaks for the job
        train_job.announce_cost(cfg, args.force)
    return cfg


def resume_settings(args: argparse.Namespace) -> None:
    """``--resume``: the run's settings from OUT/config.json into ``args``; an option given on the command line
    with another value is refused in one line naming both values."""
    from ..train.checks import parse_recipes

    saved = read_json(Path(args.out) / SIGNATURE[0])
    if saved is None or not all(k in saved for k in SIGNATURE[1]):
        raise UsageError(f"--resume: {args.out} holds no fp8kit training run: give the --out of an earlier run")
    given = given_options(args)
    for key, dest in RUN_SETTINGS.items():
        if key not in saved:
            continue
        if dest in given:
            value = sorted(parse_recipes(args.recipe)) if key == "recipes" else getattr(args, dest)
            if value != (sorted(saved[key]) if key == "recipes" else saved[key]):
                option = "--" + dest.replace("_", "-")
                shown = args.recipe if key == "recipes" else value
                raise UsageError(
                    f"--resume: {option} {shown} contradicts the run in {args.out} ({key}={saved[key]!r}): "
                    f"drop {option} to continue that run, or give a new --out"
                )
        setattr(args, dest, ",".join(saved[key]) if key == "recipes" else saved[key])
    for key in EXTENDABLE:
        if key not in given and key in saved:
            setattr(args, key, saved[key])


def given_options(args: argparse.Namespace) -> set[str]:
    """The ``dest`` of each option given on the command line (``args.argv``: ``["train", ...]``); without it,
    the options whose value differs from the default."""
    parser = Parser(prog="fp8kit train", add_help=False)
    add_arguments(parser)
    argv = getattr(args, "argv", None)
    if argv is None:
        return {a.dest for a in parser._actions if getattr(args, a.dest, a.default) != a.default}
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    known, _ = parser.parse_known_args(argv[1:] if argv[:1] == ["train"] else argv)
    return set(vars(known))


def _check_export(cfg: TrainConfig, export_format: str) -> None:
    from ..export import check_train_export

    try:
        check_train_export(cfg.recipes, export_format, cfg.out, cfg.model != "demo")
    except ValueError as err:
        raise UsageError(f"--export-format: {err}") from None
