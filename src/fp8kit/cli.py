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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8kit", description="Train, debug and deploy PyTorch models in FP8.")
    parser.add_argument("--version", action="version", version=f"fp8kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the FP8 formats and the runtime")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
