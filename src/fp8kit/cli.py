"""The ``fp8kit`` command line.

Every argument is checked before any model is loaded or any data is read: a bad value ends the
command at once with a one-line ``fp8kit <command>: error: ...`` that names the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from . import __version__
from .formats import FORMATS

TRAIN_OUT = "runs/fp8kit-train"
PRETRAINED_MODELS = ("smollm2",)


class UsageError(ValueError):
    """A bad command-line argument, found before any work started (exit code 2)."""


# ---- argument types: each raises ArgumentTypeError with the fix, so argparse reports it (exit 2) --------
def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = _at_least(1)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def unit_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def smoothquant_alpha(text: str) -> float | str:
    """``--alpha``: a number in [0, 1], or ``search`` (each layer group's alpha chosen on calibration data)."""
    return "search" if text.strip().lower() == "search" else unit_fraction(text)


def recipe_list(text: str) -> str:
    """``all`` or a comma list of recipe names (``fp8kit train``)."""
    from .recipes import RECIPE_NAMES, recipe_from_name

    names = [s.strip() for s in text.split(",") if s.strip()]
    if text.strip().lower() == "all":
        return "all"
    if not names:
        raise argparse.ArgumentTypeError(f"give a recipe: {', '.join(RECIPE_NAMES)}, all, or a comma list")
    for n in names:
        try:
            recipe_from_name(n)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown recipe {n!r}; accepted: {', '.join(RECIPE_NAMES)}, all, or a comma list"
            ) from None
    return text


def recipe_name(text: str) -> str:
    """One recipe name (``fp8kit doctor``)."""
    from .recipes import RECIPE_NAMES, recipe_from_name

    try:
        recipe_from_name(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown recipe {text!r}; accepted: {', '.join(RECIPE_NAMES)}") from None
    return text


def _scheme_names() -> str:
    from .ptq.schemes import SCHEMES

    return ", ".join([*SCHEMES, *(f"{n}+kv" for n, s in SCHEMES.items() if s.is_fp8)])


def _check_scheme(name: str) -> str:
    from .ptq.schemes import SCHEMES

    base = name.strip().lower().removesuffix("+kv")
    if base not in SCHEMES:
        raise argparse.ArgumentTypeError(f"unknown scheme {name.strip()!r}; accepted: {_scheme_names()}")
    if name.strip().lower().endswith("+kv") and not SCHEMES[base].is_fp8:
        raise argparse.ArgumentTypeError(f"{name.strip()!r}: the FP8 KV cache (+kv) goes with the FP8 schemes only")
    return name.strip().lower()


def one_scheme(text: str) -> str:
    """One PTQ scheme (``fp8kit quantize``)."""
    if "," in text or text.strip().lower() == "all":
        raise argparse.ArgumentTypeError(
            f"quantize writes one model, so it takes one scheme: {_scheme_names()} (compare takes several, or all)"
        )
    return _check_scheme(text)


def scheme_list(text: str) -> str:
    """``all`` or a comma list of PTQ schemes (``fp8kit compare``)."""
    if text.strip().lower() == "all":
        return "all"
    names = [s for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"give a scheme: {_scheme_names()}, all, or a comma list")
    return ",".join(_check_scheme(n) for n in names)


def calibration_method(text: str) -> str:
    from .ptq.calibrate import CALIBRATION_METHODS

    if text not in CALIBRATION_METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {text!r}; accepted: {', '.join(CALIBRATION_METHODS)}")
    return text


def model_size(text: str) -> str:
    from .models.llama import MODEL_SIZES

    if text not in MODEL_SIZES:
        raise argparse.ArgumentTypeError(f"unknown size {text!r}; accepted: {', '.join(MODEL_SIZES)}")
    return text


def _model(allow_demo: bool, demo_hint: str = "") -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text == "demo" and allow_demo:
            return text
        if text == "demo":
            raise argparse.ArgumentTypeError(
                "the demo model is trained from scratch and has no pretrained weights: "
                f"give {' or '.join(PRETRAINED_MODELS)}, or a local Hugging Face model folder{demo_hint}"
            )
        if text in PRETRAINED_MODELS:
            return text
        path = Path(text)
        if not (path / "config.json").is_file():
            known = ", ".join((["demo"] if allow_demo else []) + list(PRETRAINED_MODELS))
            what = "a folder without config.json" if path.is_dir() else "not an existing folder"
            raise argparse.ArgumentTypeError(
                f"{text!r} is {what}: give {known}, or a local Hugging Face model folder (with config.json)"
            )
        return text

    return parse


def text_file(text: str) -> str:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"file not found: {text!r} (give a UTF-8 text file)")
    return text


def existing_path(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(
            f"no fp8kit checkpoint at {text!r} (it does not exist): give a run's ckpt/<run> folder"
        )
    return text


# ---- output folders ------------------------------------------------------------------------------------
def check_run_dir(out: str, writes: tuple[str, ...], signature: tuple[str, tuple[str, ...]], overwrite: bool) -> Path:
    """Validate a run folder that a command writes ``writes`` into (other files in it are never touched).

    Refused: a file; a folder where a file of ``writes`` exists that an earlier run of the same command did
    not write (``signature``: a JSON file and keys it holds), unless ``overwrite``; an unwritable location.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder: give a folder path (new, or an earlier run's)")
    if path.is_dir() and not overwrite:
        clash = [w for w in writes if (path / w).exists()]
        if clash and not _written_by_fp8kit(path / signature[0], signature[1]):
            raise UsageError(
                f"--out {out} already holds {', '.join(clash)}, which fp8kit did not write: "
                "give a new folder, or pass --overwrite to replace those files"
            )
    parent = path.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out} is not writable ({parent} is not a writable folder): choose another folder")
    return path


def _written_by_fp8kit(path: Path, keys: tuple[str, ...]) -> bool:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(k in data for k in keys)


TRAIN_WRITES = ("config.json", "metrics.jsonl", "summary.json", "summary.md", "loss.png", "ckpt")
TRAIN_SIGNATURE = ("config.json", ("recipes", "model_size", "eval_interval"))
DOCTOR_WRITES = ("report.md", "report.json", "fp8_stats.jsonl", "loss.png", "heatmaps.png")
DOCTOR_SIGNATURE = ("report.json", ("healthy", "culprits", "recipe"))
COMPARE_WRITES = ("compare.json", "compare.md", "compare.png")
COMPARE_SIGNATURE = ("compare.json", ("rows", "calibration"))


def _checkpoints_in(path: Path) -> list[Path]:
    """``ckpt/<run>`` folders to evaluate: ``path`` itself, or every run of a ``fp8kit train`` folder."""
    from .train.checkpoint import latest_checkpoint

    if latest_checkpoint(path) is not None or (path / "model.safetensors").is_file():
        return [path]
    runs = sorted(p for p in (path / "ckpt").glob("*") if p.is_dir()) if (path / "ckpt").is_dir() else []
    return [r for r in runs if latest_checkpoint(r) is not None]


# ---- commands --------------------------------------------------------------------------------------------
def _format_table() -> str:
    head = f"{'format':<7} {'torch dtype':<22} {'bias':>4} {'max':>12} {'min normal':>12} {'min subnormal':>14} {'binades':>8}"
    lines = [head, "-" * len(head)]
    for f in FORMATS.values():
        dtype = str(f.dtype).replace("torch.", "") + (" (codes)" if f.kind == "scale" else "")
        lines.append(
            f"{f.name.upper():<7} {dtype:<22} {f.bias:>4} {f.max:>12.6g} {f.min_normal:>12.6g} "
            f"{f.min_subnormal:>14.6g} {f.binades:>8.2f}"
        )
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    print(f"fp8kit {__version__}  torch {torch.__version__}  CUDA available: {torch.cuda.is_available()}")
    print()
    print(_format_table())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    check_run_dir(args.out, TRAIN_WRITES, TRAIN_SIGNATURE, args.overwrite)
    if args.resume and not (Path(args.out) / "config.json").is_file():
        raise UsageError(f"--resume: {args.out} holds no fp8kit training run: give the --out of an earlier run")

    from .train import TrainConfig, run_comparison
    from .train.loop import defaults_for, parse_recipes
    from .train.report import summary_markdown

    settings = defaults_for(args.model)
    for key in ("steps", "batch_size", "seq_len", "lr", "eval_interval", "ckpt_interval"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    settings.setdefault("eval_interval", 100 if args.model == "demo" else settings["steps"])
    settings.setdefault("ckpt_interval", 100 if args.model == "demo" else settings["steps"])
    cfg = TrainConfig(
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
        nproc=getattr(args, "nproc", 1),
        fsdp=getattr(args, "fsdp", False),
        **settings,
    )
    from .distributed.launch import launch_train, should_launch

    if should_launch(cfg):  # --nproc N: validate here, then run this command on N processes (torchrun)
        return launch_train(args, cfg)
    try:
        summary = run_comparison(cfg)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: checkpoints are in {cfg.out}/ckpt; continue with --out {cfg.out} --resume", file=sys.stderr
        )
        return 130
    print()
    print(summary_markdown(summary))
    print(f"wrote {cfg.out}/summary.json, summary.md, loss.png, metrics.jsonl and checkpoints in {cfg.out}/ckpt")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.model is not None and args.checkpoint is not None:
        raise UsageError("give --checkpoint (a trained run) or --model (a pretrained model), not both")
    if args.model is None:
        where = Path(args.checkpoint or TRAIN_OUT)
        runs = _checkpoints_in(where)
        if not runs:
            raise UsageError(
                f"no fp8kit checkpoint in {where}: run `fp8kit train` first, or give --checkpoint "
                f"(a run's ckpt/<run> folder) or --model {'|'.join(PRETRAINED_MODELS)}|DIR"
            )
    from .train.loop import evaluate_checkpoint, evaluate_pretrained

    if args.model is not None:
        results = [evaluate_pretrained(args.model, text=args.text, batches=args.eval_batches or 8)]
    else:
        results = [evaluate_checkpoint(r, text=args.text, batches=args.eval_batches or 32) for r in runs]
    for res in results:
        print(
            f"{res['run']} (step {res['step']}) on the held-out split of {res['corpus']}: "
            f"loss {res['val_loss']:.4f} nats/token, perplexity {res['val_ppl']:.3f}"
        )
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from .export import check_export_dir, save_pretrained

    try:
        check_export_dir(args.out, args.overwrite)
    except ValueError as err:
        raise UsageError(f"--out {err}") from None
    from .compare import quantize_pretrained

    model, tokenizer, corpus = quantize_pretrained(
        args.model,
        args.scheme,
        text=args.text,
        calib_batches=args.calib_batches,
        calibration=args.calibration,
        alpha=args.alpha,
        gptq=args.gptq,
        awq=args.awq,
        keep_bf16=args.keep_bf16,
        smooth=args.smooth,
        norm_tweak=args.norm_tweak,
    )
    out = save_pretrained(model, args.out, tokenizer, overwrite=args.overwrite)
    print(model.ptq_report)
    print(f"calibrated on {corpus.name}; wrote the compressed-tensors export to {out} (vLLM: LLM(model={str(out)!r}))")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    check_run_dir(args.out, COMPARE_WRITES, COMPARE_SIGNATURE, args.overwrite)
    from .compare import compare_markdown, compare_schemes, parse_schemes

    result = compare_schemes(
        args.model,
        parse_schemes(args.schemes),
        args.out,
        text=args.text,
        split=args.split,
        n_windows=args.windows,
        seq_len=args.seq_len,
        calib_batches=args.calib_batches,
        calibration=args.calibration,
        alpha=args.alpha,
        gptq=args.gptq,
        awq=args.awq,
        keep_bf16=args.keep_bf16,
        smooth=args.smooth,
        norm_tweak=args.norm_tweak,
        sensitivity=args.sensitivity,
        second_text=not args.no_second_text,
        timing=not args.no_timing,
    )
    print()
    print(compare_markdown(result))
    print(f"wrote {args.out}/compare.json, compare.md and compare.png")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    out = check_run_dir(args.out, DOCTOR_WRITES, DOCTOR_SIGNATURE, args.overwrite)
    from .data import load_corpus
    from .debug import doctor
    from .recipes import recipe_from_name
    from .train.loop import TrainConfig, build_base

    recipe = recipe_from_name(args.recipe)
    cfg = TrainConfig(model=args.model, model_size=args.model_size, seq_len=args.seq_len, seed=args.seed)
    model, tokenizer = build_base(cfg)
    corpus = load_corpus(args.text, tokenizer)
    corpus.check_fits(args.seq_len)
    batches = []
    for i in range(args.steps):
        x, _ = corpus.batch("train", i, args.batch_size, args.seq_len, args.seed)
        batches.append({"input_ids": x, "labels": x})
    report = doctor(model, batches, recipe=recipe, steps=args.steps, lr=args.lr, apply=args.apply, seed=args.seed)
    path = report.save(out)
    print(
        f"fp8kit doctor ({recipe.kind} vs bf16, {report.steps} steps): "
        f"{'healthy' if report.healthy else report.kind} - {report.summary}"
    )
    label = "anomaly (no loss effect)" if report.healthy else "culprit"
    for c in report.culprits[:5]:
        print(f"  {label}: {c.layer} {c.operand} from step {c.step}: {c.reason}")
    for i, r in enumerate(report.recommendations[:3], 1):
        print(f"  fix {i}: {r.action}")
    if report.applied:
        a = report.applied
        print(f"  applied fix 1: gap {100 * a['gap_before']:+.2f}% -> {100 * a['gap_after']:+.2f}%")
    print(f"wrote {path} (with loss.png, heatmaps.png, report.json, fp8_stats.jsonl)")
    return 0


# ---- parser ----------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """Bad arguments end in one line, ``fp8kit <command>: error: ...`` (exit code 2), as every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, unless it is unset (None/False) or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what} in --out that fp8kit did not write")


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8kit`` parser: one subparser per command (add options to a command with ``add_argument``)."""
    parser = _Parser(
        prog="fp8kit", description="Train, debug and deploy PyTorch models in FP8.", formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"fp8kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=summary, description=description, formatter_class=_HelpFormatter)

    p = command("info", "print the FP8 formats and the runtime", "Print fp8kit's FP8 formats and the torch runtime.")
    p.set_defaults(func=cmd_info)

    from .debug.doctor import DEFAULT_LR, DEFAULT_STEPS

    t = command(
        "train",
        "train a small Llama in BF16 and FP8 side by side on the shipped corpus",
        "Train the same model from the same weights and batches in BF16 and in each FP8 recipe, then write "
        "a loss plot, a summary table and checkpoints to --out.",
    )
    t.add_argument(
        "--recipe", default="delayed", type=recipe_list, help="delayed|current|rowwise|block|mxfp8|all, or a comma list"
    )
    t.add_argument(
        "--model",
        default="demo",
        type=_model(allow_demo=True),
        help="demo (a small Llama trained from scratch), smollm2 (fine-tune the shipped SmolLM2-135M), "
        "or a local Hugging Face causal-LM directory",
    )
    t.add_argument(
        "--steps", type=positive_int, default=None, help="optimizer steps (default 200; 20 when fine-tuning)"
    )
    t.add_argument(
        "--batch-size", type=positive_int, default=None, help="sequences per micro-batch (default 16; 4 fine-tuning)"
    )
    t.add_argument("--seq-len", type=_at_least(2), default=None, help="tokens per sequence (default 128)")
    t.add_argument(
        "--lr", type=positive_float, default=None, help="peak learning rate (default 2e-3; 5e-5 fine-tuning)"
    )
    t.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batch order")
    t.add_argument("--model-size", type=model_size, default="small", help="size of the demo model: tiny|small|base")
    t.add_argument(
        "--arch",
        choices=("dense", "moe"),
        default="dense",
        help="demo model: dense (Llama) or moe (Qwen3-MoE, 8 experts, top-2; router load balance reported)",
    )
    t.add_argument(
        "--text", type=text_file, default=None, help="train on this UTF-8 text file instead of the shipped corpus"
    )
    t.add_argument("--compile", action="store_true", help="torch.compile the model")
    t.add_argument("--out", default=TRAIN_OUT, help="run folder")
    t.add_argument("--resume", action="store_true", help="continue the runs in --out from their checkpoints")
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
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
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
    t.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        help="processes on this machine (launched through torchrun; CPU, gloo); --batch-size stays the global "
        "batch, split evenly across them; only rank 0 writes files. Several machines: docs/distributed.md",
    )
    t.add_argument(
        "--fsdp",
        action="store_true",
        help="with --nproc N >= 2: shard parameters, gradients and optimizer state with FSDP2 instead of DDP",
    )
    _add_overwrite(t, "files")
    t.set_defaults(func=cmd_train)

    e = command(
        "eval",
        "held-out perplexity of fp8kit train checkpoints or of a pretrained model",
        f"Held-out loss and perplexity. With no option: every run that `fp8kit train` wrote to {TRAIN_OUT}.",
    )
    e.add_argument(
        "--checkpoint",
        type=existing_path,
        default=None,
        help=f"a run folder of fp8kit train, one of its ckpt/<run> folders, or a step-* folder (default {TRAIN_OUT})",
    )
    e.add_argument(
        "--model",
        type=_model(allow_demo=False, demo_hint="; for a trained demo run give --checkpoint"),
        default=None,
        help="smollm2 or a local Hugging Face directory",
    )
    e.add_argument(
        "--text", type=text_file, default=None, help="evaluate on this text's held-out split instead of the corpus"
    )
    e.add_argument(
        "--eval-batches",
        type=positive_int,
        default=None,
        help="held-out batches (default 32 for a checkpoint; 8 for a pretrained model, as fp8kit train uses)",
    )
    e.add_argument("--batches", dest="eval_batches", type=positive_int, help=argparse.SUPPRESS)  # older name
    e.set_defaults(func=cmd_eval)

    d = command(
        "doctor",
        "run FP8 beside BF16 and report where, when and why they part",
        "Train FP8 and BF16 copies side by side for a few steps and write a report (report.md with plots) "
        "naming the layers, operands and steps where FP8 departs, with ranked fixes.",
    )
    d.add_argument(
        "--model",
        type=_model(allow_demo=True),
        default="demo",
        help="demo (the fp8kit train Llama), smollm2, or a local HF directory",
    )
    d.add_argument("--model-size", type=model_size, default="small", help="size of the demo model: tiny|small|base")
    d.add_argument("--recipe", type=recipe_name, default="delayed", help="delayed|current|rowwise|block|mxfp8")
    d.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, help="training steps of each copy")
    d.add_argument("--batch-size", type=positive_int, default=8, help="sequences per step")
    d.add_argument("--seq-len", type=_at_least(2), default=64, help="tokens per sequence")
    d.add_argument("--lr", type=positive_float, default=DEFAULT_LR, help="learning rate (AdamW), as fp8kit train's")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights and batches")
    d.add_argument("--text", type=text_file, default=None, help="use this UTF-8 text instead of the shipped corpus")
    d.add_argument("--apply", action="store_true", help="re-run with the top fix and show whether the gap closed")
    d.add_argument("--out", default="runs/fp8kit-doctor", help="folder for report.md and its plots")
    _add_overwrite(d, "files")
    d.set_defaults(func=cmd_doctor)

    model_help = "smollm2 (the shipped SmolLM2-135M) or a local Hugging Face causal-LM directory"
    q = command(
        "quantize",
        "post-training quantization, written as a compressed-tensors export",
        "Calibrate a pretrained causal LM on the shipped corpus (or --text), quantize it with one scheme and "
        "write a compressed-tensors folder that vLLM and transformers load.",
    )
    q.add_argument("--model", type=_model(allow_demo=False), default="smollm2", help=model_help)
    q.add_argument(
        "--scheme",
        type=one_scheme,
        required=True,
        help="fp8|fp8-dynamic|int8-smoothquant|int8-weight-only; fp8+kv: FP8 KV",
    )
    q.add_argument("--out", required=True, help="new (or empty) folder for the Hugging Face / vLLM checkpoint")
    q.add_argument(
        "--text", type=text_file, default=None, help="calibrate on this UTF-8 text instead of the shipped corpus"
    )
    _add_calibration_options(q)
    _add_ptq_switches(q, "the N layers whose quantization alone worsens the model most on calibration data")
    _add_overwrite(q, "a folder")
    q.set_defaults(func=cmd_quantize)

    c = command(
        "compare",
        "BF16 vs FP8 vs INT8 PTQ: perplexity, weight memory, prefill/decode time",
        "Quantize a pretrained model with each scheme and compare held-out perplexity, weight memory and "
        "per-token times against BF16; writes compare.json, compare.md and compare.png to --out.",
    )
    c.add_argument("--model", type=_model(allow_demo=False), default="smollm2", help=model_help)
    c.add_argument(
        "--schemes",
        type=scheme_list,
        default="all",
        help="all, or a comma list of schemes (fp8+kv for the FP8 KV cache)",
    )
    c.add_argument("--out", default="runs/fp8kit-compare", help="folder for compare.json/md/png")
    c.add_argument("--text", type=text_file, default=None, help="use this UTF-8 text instead of the shipped corpus")
    _add_calibration_options(c)
    c.add_argument(
        "--split", choices=("dev", "test"), default="test", help="dev (to choose settings) or test (to report)"
    )
    c.add_argument(
        "--windows",
        type=positive_int,
        default=64,
        help="held-out windows per text, one per 2,048-token block of the split (64 x 512 = 32,768 tokens)",
    )
    c.add_argument("--seq-len", type=positive_int, default=512, help="tokens per held-out window")
    c.add_argument("--eval-batches", "--batches", dest="windows", type=positive_int, help=argparse.SUPPRESS)  # old name
    c.add_argument("--no-second-text", action="store_true", help="skip the second text (Python Language Reference)")
    c.add_argument("--no-timing", action="store_true", help="skip the prefill/decode timing (accuracy only)")
    c.add_argument(
        "--sensitivity", type=positive_int, default=0, metavar="W", help="per-layer sensitivity report on W dev windows"
    )
    _add_ptq_switches(c, "the N most sensitive layers (on calibration data; with --sensitivity W, by dev loss)")
    _add_overwrite(c, "files")
    c.set_defaults(func=cmd_compare)
    return parser


def _add_calibration_options(p: argparse.ArgumentParser) -> None:
    """The calibration options ``quantize`` and ``compare`` share."""
    p.add_argument(
        "--calibration",
        type=calibration_method,
        default=None,
        help="max|percentile|mse (static activation scales; default mse, max for int8-smoothquant)",
    )
    p.add_argument(
        "--alpha",
        type=smoothquant_alpha,
        default=None,
        help="SmoothQuant migration strength in [0, 1], or search (per layer group, on calibration data); "
        "default: each scheme's dev-chosen setting",
    )
    p.add_argument("--calib-batches", type=positive_int, default=8, help="calibration batches of 4 x 128 tokens")


def _add_ptq_switches(p: argparse.ArgumentParser, keep_what: str) -> None:
    p.add_argument(
        "--gptq", action=argparse.BooleanOptionalAction, default=True, help="GPTQ weight rounding (Hessian-aware)"
    )
    p.add_argument(
        "--awq", action=argparse.BooleanOptionalAction, default=True, help="AWQ scale search (int8-weight-only)"
    )
    p.add_argument(
        "--smooth",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fold SmoothQuant factors before quantizing W8A8 schemes (default: each scheme's dev-chosen setting)",
    )
    p.add_argument(
        "--keep-bf16",
        type=_at_least(0),
        default=None,
        metavar="N",
        help=f"keep in BF16 {keep_what} (default: each scheme's dev-chosen N)",
    )
    p.add_argument(
        "--norm-tweak",
        type=_at_least(0),
        default=None,
        metavar="STEPS",
        help="after quantizing, tune the norm weights for STEPS steps towards the BF16 model on the "
        "calibration batches (0: off; default: each scheme's dev-chosen setting)",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the ``fp8kit`` command line; returns the exit code (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse: --help/--version (0) or a bad argument (2)
        return stop.code if isinstance(stop.code, int) else 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, PermissionError, ImportError, FloatingPointError, OSError) as err:
        print(f"fp8kit {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
