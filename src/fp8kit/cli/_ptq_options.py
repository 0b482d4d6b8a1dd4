"""The options ``fp8kit quantize`` and ``fp8kit compare`` share: schemes, calibration and the PTQ switches."""

from __future__ import annotations

import argparse

from ._common import at_least, positive_int

MODEL_HELP = (
    "smollm2 (the shipped SmolLM2-135M), a local Hugging Face causal-LM directory or a Hub ID ORG/NAME[@REVISION]"
)


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


def scheme_names(auto: bool = False) -> str:
    """Every accepted scheme (``ptq.schemes.CLI_SCHEMES``), ``+kv`` variants included, and ``auto`` when the
    command takes it (``quantize``), for help and error messages."""
    from ..ptq.schemes import CLI_SCHEMES, KV_SCHEMES

    return ", ".join([*CLI_SCHEMES, *(f"{n}+kv" for n in KV_SCHEMES), *(["auto"] if auto else [])])


def check_scheme(name: str, auto: bool = False) -> str:
    """One scheme name of ``ptq.schemes.CLI_SCHEMES`` (or ``auto``, when the command takes it), normalized
    (lower case); ``+kv`` only on the FP8 PTQ schemes."""
    from ..ptq.schemes import CLI_SCHEMES, KV_SCHEMES

    key = name.strip().lower()
    base = key.removesuffix("+kv")
    if base not in CLI_SCHEMES and not (auto and key == "auto"):
        raise argparse.ArgumentTypeError(f"unknown scheme {name.strip()!r}; accepted: {scheme_names(auto)}")
    if key.endswith("+kv") and base not in KV_SCHEMES:
        raise argparse.ArgumentTypeError(
            f"{name.strip()!r}: the FP8 KV cache (+kv) goes with the FP8 schemes only ({', '.join(KV_SCHEMES)})"
        )
    return key


def calibration_method(text: str) -> str:
    from ..ptq.calibrate import CALIBRATION_METHODS

    if text not in CALIBRATION_METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {text!r}; accepted: {', '.join(CALIBRATION_METHODS)}")
    return text


def add_calibration_options(p: argparse.ArgumentParser) -> None:
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


def add_ptq_switches(p: argparse.ArgumentParser, keep_what: str) -> None:
    """The PTQ switches ``quantize`` and ``compare`` share; ``keep_what`` says which layers --keep-bf16 keeps."""
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
        type=at_least(0),
        default=None,
        metavar="N",
        help=f"keep in BF16 {keep_what} (default: each scheme's dev-chosen N)",
    )
    p.add_argument(
        "--norm-tweak",
        type=at_least(0),
        default=None,
        metavar="STEPS",
        help="after quantizing, tune the norm weights for STEPS steps towards the BF16 model on the "
        "calibration batches (0: off; default: each scheme's dev-chosen setting)",
    )


def ptq_settings(args: argparse.Namespace) -> dict[str, object]:
    """The calibration options and PTQ switches as keyword arguments of ``quantize_pretrained`` and
    ``compare_schemes``."""
    keys = ("calib_batches", "calibration", "alpha", "gptq", "awq", "keep_bf16", "smooth", "norm_tweak")
    return {key: getattr(args, key) for key in keys}
