"""``fp8kit info``: the FP8 formats, the torch runtime and each device with the recipes it runs natively."""

from __future__ import annotations

import argparse

NAME = "info"
SUMMARY = "print the FP8 formats and the runtime"
DESCRIPTION = "Print fp8kit's FP8 formats and the torch runtime."


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options."""


def format_table() -> str:
    """One row per format: dtype, exponent bias, largest, smallest normal and subnormal value, binades."""
    from ..numerics.formats import FORMATS

    head = f"{'format':<7} {'torch dtype':<22} {'bias':>4} {'max':>12} {'min normal':>12} {'min subnormal':>14} {'binades':>8}"
    lines = [head, "-" * len(head)]
    for f in FORMATS.values():
        dtype = str(f.dtype).replace("torch.", "") + (" (codes)" if f.kind == "scale" or f.sub_byte else "")
        lines.append(
            f"{f.name.upper():<7} {dtype:<22} {f.bias:>4} {f.max:>12.6g} {f.min_normal:>12.6g} "
            f"{f.min_subnormal:>14.6g} {f.binades:>8.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import torch

    from .. import __version__
    from ..runtime.device import device_report

    print(f"fp8kit {__version__}  torch {torch.__version__}  CUDA available: {torch.cuda.is_available()}")
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] or [torch.device("cpu")]
    for device in devices:
        print(f"device: {device_report(device).line()}")
    print()
    print(format_table())
    return 0
