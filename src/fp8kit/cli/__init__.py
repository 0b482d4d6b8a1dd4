"""The ``fp8kit`` command line: one module per subcommand (its options beside its handler), and ``main``.

Every argument is checked before any model is loaded or any data is read: a bad value ends the
command at once with a one-line ``fp8kit <command>: error: ...`` that names the fix, and exit code 2.
A subcommand module holds ``NAME``, ``SUMMARY``, ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> exit code``; ``COMMANDS`` lists them in the order ``fp8kit --help`` shows.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from . import compare, doctor, info, quantize, train
from . import eval as eval_
from ._common import USER_ERRORS, HelpFormatter, Parser

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = (info, train, eval_, doctor, quantize, compare)


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8kit`` parser: one subparser per command (add options to a command in its module)."""
    parser = Parser(
        prog="fp8kit", description="Train, debug and deploy PyTorch models in FP8.", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"fp8kit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        p = sub.add_parser(
            command.NAME, help=command.SUMMARY, description=command.DESCRIPTION, formatter_class=HelpFormatter
        )
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fp8kit`` command line (``argv``: the arguments after ``fp8kit``, default ``sys.argv[1:]``);
    returns the exit code (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse: --help/--version (0) or a bad argument (2)
        return stop.code if isinstance(stop.code, int) else 2
    args.argv = argv  # the command line as given: `train --nproc N` re-runs it under torchrun
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        print(f"fp8kit {args.command}: error: {err}", file=sys.stderr)
        return 2
