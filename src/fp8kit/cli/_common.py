"""What every ``fp8kit`` subcommand shares: the parser that ends bad arguments in one line (exit code 2),
the help formatter, argument types that name the fix, and the check of a run folder before it is written.

Every argument is checked before any model is loaded or any data is read: a bad value ends the command at
once with a one-line ``fp8kit <command>: error: ...`` that names the fix, and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

TRAIN_OUT = "runs/fp8kit-train"
# How an ``fp8kit train`` run folder is recognized: its config.json holds these keys.
TRAIN_SIGNATURE = ("config.json", ("recipes", "model_size", "eval_interval"))
PRETRAINED_MODELS = ("smollm2",)


class UsageError(ValueError):
    """A bad command-line argument, found before any work started (exit code 2)."""


# Errors a command reports as one line ``fp8kit <command>: error: ...`` with exit code 2 (no traceback).
USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, ImportError, FloatingPointError, OSError)


# ---- parser ----------------------------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """Bad arguments end in one line, ``fp8kit <command>: error: ...`` (exit code 2), as every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, unless it is unset (None/False) or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if unset or "default" in text or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    """``--overwrite``: replace the earlier fp8kit ``what`` in ``--out`` (its files removed first), or files there
    that fp8kit did not write."""
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace the earlier fp8kit {what} in --out (its files are removed first) or files there that "
        "fp8kit did not write",
    )


# ---- argument types: each raises ArgumentTypeError with the fix, so argparse reports it (exit 2) --------
def at_least(minimum: int) -> Callable[[str], int]:
    """A whole number >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


positive_int = at_least(1)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def model_size(text: str) -> str:
    """A size of the demo model (``fp8kit train``, ``fp8kit doctor``)."""
    from ..models.llama import MODEL_SIZES

    if text not in MODEL_SIZES:
        raise argparse.ArgumentTypeError(f"unknown size {text!r}; accepted: {', '.join(MODEL_SIZES)}")
    return text


def model(allow_demo: bool, demo_hint: str = "") -> Callable[[str], str]:
    """``--model``: a pretrained model's name, a local Hugging Face folder, a Hub ID ``ORG/NAME[@REVISION]``
    (resolved when the command runs, ``models.resolve``), or (if allowed) ``demo``."""

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
        from ..jobs.loading import train_checkpoint
        from ..models.resolve import is_hub_id

        if is_hub_id(text):
            return text
        if path.is_dir() and (run := train_run_checkpoint(path)) is not None:
            return run
        found = train_checkpoint(path)
        if found is not None:
            _check_train_checkpoint(found)
            return text
        if not (path / "config.json").is_file():
            known = ", ".join((["demo"] if allow_demo else []) + list(PRETRAINED_MODELS))
            what = "a folder without config.json" if path.is_dir() else "not an existing folder"
            raise argparse.ArgumentTypeError(
                f"{text!r} is {what}: give {known}, a local Hugging Face model folder (with config.json) "
                "or a Hub ID ORG/NAME[@REVISION]"
            )
        from ..export.fp4_checkpoints import fp4_layout
        from ..models.folder import check_model_folder

        try:
            check_model_folder(path)
            fp4_layout(path)  # an FP4 layout fp8kit does not read
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    return parse


def train_run_checkpoint(path: Path) -> str | None:
    """An ``fp8kit train`` run folder given as ``--model``: its one run's ``ckpt/<run>`` folder; ``None`` when
    ``path`` is not a run folder; refused in one line naming each ``ckpt/<run>`` when it holds several."""
    from ..train.checkpoint import latest_checkpoint

    config = read_json(path / TRAIN_SIGNATURE[0])
    if config is None or not all(k in config for k in TRAIN_SIGNATURE[1]):
        return None
    ckpt = path / "ckpt"
    runs = sorted(p for p in ckpt.iterdir() if latest_checkpoint(p) is not None) if ckpt.is_dir() else []
    if len(runs) == 1:
        return str(runs[0])
    if not runs:
        raise argparse.ArgumentTypeError(
            f"{path} is an fp8kit train run folder without a checkpoint yet: continue it with "
            f"`fp8kit train --out {path} --resume`, or give another model"
        )
    raise argparse.ArgumentTypeError(
        f"{path} is an fp8kit train run folder with {len(runs)} runs: give one of them, "
        + ", ".join(str(r) for r in runs)
    )


def _check_train_checkpoint(step: Path) -> None:
    from ..models.folder import safetensors_problem

    weights = step / "model.safetensors"  # (a checkpoint of several processes is a DCP folder instead)
    problem = safetensors_problem(weights) if weights.is_file() else None
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{weights} is not a readable fp8kit checkpoint: {problem}; give another step")


def text_file(text: str) -> str:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"file not found: {text!r} (give a UTF-8 text file)")
    return text


# ---- output folders ------------------------------------------------------------------------------------
def check_run_dir(
    out: str,
    writes: tuple[str, ...],
    signature: tuple[str, tuple[str, ...]],
    overwrite: bool,
    resume: bool | None = None,
    kind: str = "run",
) -> Path:
    """Validate a run folder that a command writes ``writes`` into (other files in it are never touched).

    Refused: a file; a folder that holds an earlier fp8kit ``kind`` (``signature``: a JSON file and keys it
    holds), unless ``overwrite`` or (for a command with ``--resume``, ``resume`` not ``None``) ``resume``; a
    folder where a file of ``writes`` exists that fp8kit did not write, unless ``overwrite``; ``resume`` and
    ``overwrite`` together; an unwritable location. ``clear_run_dir`` removes the old run once every check passed.
    """
    path = Path(out)
    if resume and overwrite:
        raise UsageError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder: give a folder path (new, or an earlier run's)")
    if path.is_dir() and not overwrite and not resume:
        if _written_by_fp8kit(path / signature[0], signature[1]):
            keep = "pass --overwrite to replace it"
            if resume is not None:  # the command can continue it
                keep = "pass --resume to continue it, --overwrite to replace it"
            raise UsageError(f"--out {out} holds an earlier fp8kit {kind}: {keep}, or give a new --out")
        clash = [w for w in writes if (path / w).exists()]
        if clash:
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


def check_out_outside_model(out: str, model_spec: str) -> None:
    """Refuse an ``--out`` equal to or inside the local ``--model`` folder (the export would replace its input)."""
    source = Path(model_spec)
    if model_spec in PRETRAINED_MODELS:
        from ..models.pretrained import cache_dir

        source = cache_dir() / "smollm2-135m-instruct"
    if not source.is_dir():
        return
    target, source = Path(out).resolve(), source.resolve()
    if target == source or source in target.parents:
        where = "is" if target == source else "is inside"
        raise UsageError(
            f"--out {out} {where} the --model folder {source}: the export would replace its own input; "
            "give an --out outside it"
        )


def clear_run_dir(out: str | Path, writes: tuple[str, ...]) -> None:
    """Remove the files and folders ``writes`` names from ``out`` (``--overwrite``: no file of the old run is
    left beside the new one); other files stay."""
    path = Path(out)
    for name in writes:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or ``None`` when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _written_by_fp8kit(path: Path, keys: tuple[str, ...]) -> bool:
    data = read_json(path)
    return data is not None and all(k in data for k in keys)


def add_device_options(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--emulate`` and ``--force``."""
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when present, else the CPU), cpu, cuda or cuda:N; on CUDA weights load in BF16 and "
        "FP8 GEMMs run on the native kernels",
    )
    p.add_argument(
        "--emulate",
        action="store_true",
        help="run a recipe/scheme this GPU has no native FP8 GEMM for (MXFP8 below SM100, FP8 below SM89) on "
        "dequantized BF16 operands, with a warning, instead of refusing",
    )
    p.add_argument(
        "--force", action="store_true", help="start even when the estimated peak memory exceeds the free memory"
    )


def job_device(args: argparse.Namespace, recipes: Any = None) -> Any:
    """``--device`` resolved and checked against ``recipes`` (``fp8kit.runtime.device.resolve_device``)."""
    from ..runtime.device import resolve_device

    return resolve_device(args.device, recipe=recipes, emulate=args.emulate)
