"""The ``fp8kit`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .formats import FORMATS


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
        compile=args.compile,
        out=args.out,
        resume=args.resume,
        text=args.text,
        progress=not args.no_progress,
        **settings,
    )
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
    from .train.loop import evaluate_checkpoint, evaluate_pretrained

    if args.checkpoint is not None:
        res = evaluate_checkpoint(args.checkpoint, text=args.text, batches=args.batches or 32)
    elif args.model == "demo":
        raise ValueError("--model demo is trained from scratch: give --checkpoint (a run's ckpt/<run> folder)")
    else:
        res = evaluate_pretrained(args.model, text=args.text, batches=args.batches or 8)
    print(
        f"{res['run']} (step {res['step']}) on the held-out split of {res['corpus']}: "
        f"loss {res['val_loss']:.4f} nats/token, perplexity {res['val_ppl']:.3f}"
    )
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from .export import save_pretrained
    from .ptq.compare import parse_schemes, quantize_pretrained

    if "," in args.scheme or args.scheme.strip().lower() == "all":
        raise ValueError("--scheme takes one scheme: fp8, fp8-dynamic, int8-smoothquant, int8-weight-only (+kv)")
    (scheme,) = parse_schemes(args.scheme)
    model, tokenizer, corpus = quantize_pretrained(
        args.model,
        scheme,
        text=args.text,
        calib_batches=args.calib_batches,
        calibration=args.calibration,
        alpha=args.alpha,
    )
    out = save_pretrained(model, args.out, tokenizer)
    print(model.ptq_report)
    print(f"calibrated on {corpus.name}; wrote the compressed-tensors export to {out} (vLLM: LLM(model={str(out)!r}))")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .ptq.compare import compare_markdown, compare_schemes, parse_schemes

    result = compare_schemes(
        args.model,
        parse_schemes(args.schemes),
        args.out,
        text=args.text,
        eval_batches=args.eval_batches,
        calib_batches=args.calib_batches,
        calibration=args.calibration,
        alpha=args.alpha,
    )
    print()
    print(compare_markdown(result))
    print(f"wrote {args.out}/compare.json, compare.md and compare.png")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # fail early (clear error) if the folder is not writable
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8kit", description="Train, debug and deploy PyTorch models in FP8.")
    parser.add_argument("--version", action="version", version=f"fp8kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the FP8 formats and the runtime")
    p.set_defaults(func=cmd_info)

    t = sub.add_parser("train", help="train a small Llama in BF16 and FP8 side by side on the shipped corpus")
    t.add_argument("--recipe", default="delayed", help="delayed|current|rowwise|block|mxfp8|all, or a comma list")
    t.add_argument(
        "--model",
        default="demo",
        help="demo (a small Llama trained from scratch), smollm2 (fine-tune the shipped SmolLM2-135M), "
        "or a local Hugging Face causal-LM directory",
    )
    t.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200; 20 when fine-tuning)")
    t.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch (default 16; 4 fine-tuning)")
    t.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 128)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3; 5e-5 fine-tuning)")
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--model-size", default="small", help="size of the demo model: tiny|small|base")
    t.add_argument("--text", default=None, help="train on this UTF-8 text file instead of the shipped corpus")
    t.add_argument("--compile", action="store_true", help="torch.compile the model")
    t.add_argument("--out", default="runs/fp8kit-train", help="run folder")
    t.add_argument("--resume", action="store_true", help="continue the runs in --out from their checkpoints")
    t.add_argument("--eval-interval", type=int, default=None, help="steps between held-out evaluations")
    t.add_argument("--ckpt-interval", type=int, default=None, help="steps between checkpoints")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out perplexity of a pretrained model or a fp8kit train checkpoint")
    e.add_argument("--model", default="demo", help="demo, smollm2 or a local Hugging Face directory")
    e.add_argument("--checkpoint", default=None, help="a run's ckpt/<run> folder (or one step-* folder)")
    e.add_argument("--text", default=None, help="evaluate on this text's held-out split instead of the corpus")
    e.add_argument(
        "--batches",
        type=int,
        default=None,
        help="held-out batches (default 32; 8 for a pretrained model, as fp8kit train uses)",
    )
    e.set_defaults(func=cmd_eval)

    d = sub.add_parser("doctor", help="run FP8 beside BF16 and report where, when and why they part")
    d.add_argument("--model", default="demo", help="demo (the fp8kit train Llama), smollm2, or a local HF directory")
    d.add_argument("--model-size", default="small", help="size of the demo model: tiny|small|base")
    d.add_argument("--recipe", default="delayed", help="delayed|current|rowwise|block|mxfp8")
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--seq-len", type=int, default=64)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--text", default=None, help="use this UTF-8 text instead of the shipped corpus")
    d.add_argument("--apply", action="store_true", help="re-run with the top fix and show whether the gap closed")
    d.add_argument("--out", default="runs/fp8kit-doctor", help="folder for report.md and its plots")
    d.set_defaults(func=cmd_doctor)

    model_help = "smollm2 (the shipped SmolLM2-135M) or a local Hugging Face causal-LM directory"
    q = sub.add_parser("quantize", help="post-training quantization, written as a compressed-tensors export")
    q.add_argument("--model", default="smollm2", help=model_help)
    q.add_argument("--scheme", required=True, help="fp8|fp8-dynamic|int8-smoothquant|int8-weight-only; fp8+kv: FP8 KV")
    q.add_argument("--out", required=True, help="directory for the Hugging Face / vLLM checkpoint")
    q.add_argument("--text", default=None, help="calibrate on this UTF-8 text instead of the shipped corpus")
    q.add_argument("--calibration", default="mse", help="max|percentile|mse (static activation scales)")
    q.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant migration strength (0.8 suits Llama models)")
    q.add_argument("--calib-batches", type=int, default=8, help="calibration batches of 4 x 128 tokens")
    q.set_defaults(func=cmd_quantize)

    c = sub.add_parser("compare", help="BF16 vs FP8 vs INT8 PTQ: perplexity, weight memory, prefill/decode time")
    c.add_argument("--model", default="smollm2", help=model_help)
    c.add_argument("--schemes", default="all", help="all, or a comma list of schemes (fp8+kv for the FP8 KV cache)")
    c.add_argument("--out", default="runs/fp8kit-compare", help="folder for compare.json/md/png")
    c.add_argument("--text", default=None, help="use this UTF-8 text instead of the shipped corpus")
    c.add_argument("--calibration", default="mse", help="max|percentile|mse (static activation scales)")
    c.add_argument("--alpha", type=float, default=0.8, help="SmoothQuant migration strength")
    c.add_argument("--calib-batches", type=int, default=8)
    c.add_argument("--eval-batches", type=int, default=8, help="held-out batches of 4 x 128 tokens")
    c.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
