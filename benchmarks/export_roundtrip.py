"""SmolLM2-135M PTQ -> export in one checkpoint format -> ``load_pretrained``: held-out perplexity of the
in-memory quantized model beside the reloaded checkpoint's, on the same windows.

    python benchmarks/export_roundtrip.py --format modelopt --scheme fp8 --keep-bf16 0 --norm-tweak 0

Windows: ``--windows`` x 128 tokens spread over the KJV dev split (never calibrated on).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch

from fp8kit.data import windows
from fp8kit.data.evaluation import window_losses
from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.jobs.quantize import quantize_pretrained


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="modelopt", help="compressed-tensors, modelopt or fp8-block")
    ap.add_argument("--scheme", default="fp8")
    ap.add_argument("--keep-bf16", type=int, default=None, help="default: the scheme's dev-chosen N")
    ap.add_argument("--norm-tweak", type=int, default=None, help="default: the scheme's dev-chosen steps")
    ap.add_argument("--windows", type=int, default=32)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok, splits = quantize_pretrained(
        "smollm2", args.scheme, keep_bf16=args.keep_bf16, norm_tweak=args.norm_tweak
    )
    report = model.ptq_report
    print(f"quantized in {time.perf_counter() - t0:.0f} s: {report.scheme}, {len(report.quantized)} layers")
    w = windows(splits.dev, args.windows, 128, splits.block)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        ours = window_losses(model, w)
        out = save_pretrained(model, f"{tmp}/ckpt", tok, format=args.format)
        theirs = window_losses(load_pretrained(out).eval(), w)
    print("| format | in-memory ppl | reloaded ppl | max per-window loss difference |\n|---|---|---|---|")
    print(
        f"| {args.format} | {math.exp(float(ours.mean())):.4f} | {math.exp(float(theirs.mean())):.4f} "
        f"| {float((ours - theirs).abs().max()):.3g} |"
    )


if __name__ == "__main__":
    main()
