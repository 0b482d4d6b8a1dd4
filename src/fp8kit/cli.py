"""The ``fp8kit`` command line."""

from __future__ import annotations

import argparse
import sys

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
    from .train.loop import parse_recipes
    from .train.report import summary_markdown

    cfg = TrainConfig(
        recipes=parse_recipes(args.recipe),
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        grad_accum=args.grad_accum,
        seed=args.seed,
        model_size=args.model_size,
        compile=args.compile,
        out=args.out,
        resume=args.resume,
        text=args.text,
        eval_interval=args.eval_interval,
        ckpt_interval=args.ckpt_interval,
        progress=not args.no_progress,
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
    from .train.loop import evaluate_checkpoint

    if args.model not in ("demo",):
        raise ValueError(f"--model {args.model!r} is not available yet; accepted: demo (the fp8kit train model)")
    res = evaluate_checkpoint(args.checkpoint, text=args.text, batches=args.batches)
    print(
        f"{res['run']} (step {res['step']}) on the held-out split of {res['corpus']}: "
        f"loss {res['val_loss']:.4f} nats/token, perplexity {res['val_ppl']:.3f}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8kit", description="Train, debug and deploy PyTorch models in FP8.")
    parser.add_argument("--version", action="version", version=f"fp8kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the FP8 formats and the runtime")
    p.set_defaults(func=cmd_info)

    t = sub.add_parser("train", help="train a small Llama in BF16 and FP8 side by side on the shipped corpus")
    t.add_argument("--recipe", default="delayed", help="delayed|current|rowwise|block|mxfp8|all, or a comma list")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--model-size", default="small", help="tiny|small|base")
    t.add_argument("--text", default=None, help="train on this UTF-8 text file instead of the shipped corpus")
    t.add_argument("--compile", action="store_true", help="torch.compile the model")
    t.add_argument("--out", default="runs/fp8kit-train", help="run folder")
    t.add_argument("--resume", action="store_true", help="continue the runs in --out from their checkpoints")
    t.add_argument("--eval-interval", type=int, default=100)
    t.add_argument("--ckpt-interval", type=int, default=100)
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out perplexity of a checkpoint written by fp8kit train")
    e.add_argument("--model", default="demo", help="demo: the fp8kit train Llama")
    e.add_argument("--checkpoint", required=True, help="a run's ckpt/<run> folder (or one step-* folder)")
    e.add_argument("--text", default=None, help="evaluate on this text's held-out split instead of the corpus")
    e.add_argument("--batches", type=int, default=32)
    e.set_defaults(func=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, PermissionError, ImportError, FloatingPointError) as err:
        print(f"fp8kit {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
