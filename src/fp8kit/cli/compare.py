"""``fp8kit compare``: BF16 against each PTQ scheme: held-out perplexity, weight memory, prefill/decode time."""

from __future__ import annotations

import argparse

from ..jobs.announce import print_device_peak
from ._common import (
    add_device_options,
    add_overwrite,
    check_run_dir,
    clear_run_dir,
    job_device,
    model,
    positive_int,
    text_file,
)
from ._ptq_options import (
    MODEL_HELP,
    add_calibration_options,
    add_ptq_switches,
    check_scheme,
    ptq_settings,
    scheme_names,
)

NAME = "compare"
SUMMARY = "BF16 vs FP8 vs INT8 PTQ: perplexity, weight memory, prefill/decode time"
DESCRIPTION = (
    "Quantize a pretrained model with each scheme and compare held-out perplexity, weight memory and "
    "per-token times against BF16; writes compare.json, compare.md and compare.png to --out."
)
WRITES = ("compare.json", "compare.md", "compare.png")
SIGNATURE = ("compare.json", ("rows", "calibration"))


def scheme_list(text: str) -> str:
    """``all`` or a comma list of PTQ schemes."""
    if text.strip().lower() == "all":
        return "all"
    names = [s for s in text.split(",") if s.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"give a scheme: {scheme_names()}, all, or a comma list")
    return ",".join(check_scheme(n) for n in names)


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--model", type=model(allow_demo=False), default="smollm2", help=MODEL_HELP)
    c.add_argument(
        "--schemes",
        type=scheme_list,
        default="all",
        help=f"all, or a comma list of: {scheme_names()} (+kv: FP8 KV cache)",
    )
    c.add_argument(
        "--out",
        default="runs/fp8kit-compare",
        help="folder for compare.json/md/png (one that holds a report needs --overwrite)",
    )
    c.add_argument("--text", type=text_file, default=None, help="use this UTF-8 text instead of the shipped corpus")
    add_calibration_options(c)
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
    add_ptq_switches(c, "the N most sensitive layers (on calibration data; with --sensitivity W, by dev loss)")
    add_device_options(c)
    add_overwrite(c, "comparison")


def run(args: argparse.Namespace) -> int:
    check_run_dir(args.out, WRITES, SIGNATURE, args.overwrite, kind="comparison")
    from ..jobs.compare import announce_cost, compare_markdown, compare_schemes, parse_schemes

    schemes = parse_schemes(args.schemes)
    device = job_device(args, schemes)
    announce_cost(args, device, schemes)
    if args.overwrite:
        clear_run_dir(args.out, WRITES)
    result = compare_schemes(
        args.model,
        schemes,
        args.out,
        text=args.text,
        split=args.split,
        n_windows=args.windows,
        seq_len=args.seq_len,
        sensitivity=args.sensitivity,
        second_text=not args.no_second_text,
        timing=not args.no_timing,
        device=device,
        **ptq_settings(args),
    )
    print()
    print(compare_markdown(result))
    print_device_peak(device)
    print(f"wrote {args.out}/compare.json, compare.md and compare.png")
    return 0
