r"""PTQ ``auto`` (a scheme per layer for an effective-bits budget) against uniform schemes on SmolLM2-135M
or another causal LM (``--model``: the MoE demo's ``fp8kit train`` checkpoint, where each experts module is
one unit of the plan).

Every configuration calibrates on the same KJV calibration batches and rounds to nearest (no GPTQ, AWQ,
SmoothQuant or layers kept in BF16 beyond what the plan keeps), the BF16 layers run BF16 GEMMs
(``to_bf16_gemms``), and each is scored on the KJV test split: perplexity and the paired change against
BF16 (mean +- standard error over windows), with its effective bits (``planner.bits``, ModelOpt's counting)
and the summed Fisher-predicted loss increase the plan reported.

    OMP_NUM_THREADS=2 python benchmarks/ptq_auto.py --budgets 8,6 --schemes fp8-dynamic,int8-weight-only,nvfp4-weight-only
    fp8kit train --arch moe --model-size tiny --steps 200 --out RUN
    OMP_NUM_THREADS=1 python benchmarks/ptq_auto.py --model RUN/ckpt/bf16 --seq-len 128
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch

from fp8kit.data import windows
from fp8kit.data.evaluation import window_losses
from fp8kit.jobs.loading import load_model
from fp8kit.jobs.quantize import calibration_loop, load_splits
from fp8kit.nn import to_bf16_gemms
from fp8kit.planner.bits import EFFECTIVE_BITS
from fp8kit.ptq import quantize
from fp8kit.ptq.experts import find_experts


def paired(loss: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Perplexity change (%) against ``ref`` per window: mean and standard error."""
    d = (loss - ref).double()
    return 100 * math.expm1(float(d.mean())), 100 * float(d.exp().sub(1).std()) / math.sqrt(d.numel())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a Hugging Face folder or an fp8kit train checkpoint")
    p.add_argument("--budgets", default="8,6", help="comma-separated effective-bits budgets for auto")
    p.add_argument("--schemes", default="fp8-dynamic,int8-weight-only,nvfp4-weight-only", help="uniform schemes")
    p.add_argument("--candidates", default=None, help="auto's candidates (default: all per-layer schemes)")
    p.add_argument("--calib-batches", type=int, default=8, help="calibration batches of 4 x 128 tokens")
    p.add_argument("--test-windows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    args = p.parse_args()
    torch.manual_seed(0)
    base, tok = load_model(args.model)
    base.eval()
    experts_modules = set(find_experts(base))
    kjv = load_splits(None, tok, second_text=False)[0]
    loop = calibration_loop(kjv, args.calib_batches)
    test = windows(kjv.test, args.test_windows, args.seq_len, kjv.block)
    bf = to_bf16_gemms(copy.deepcopy(base))
    ref = window_losses(bf, test)
    del bf
    print(f"KJV test: {args.test_windows} x {args.seq_len} tokens; bf16 ppl {math.exp(float(ref.mean())):.3f}")
    print(f"{'config':<28} {'bits':>5} {'pred. dloss':>12} {'test ppl':>9} {'vs bf16':>16} {'time (s)':>9}")
    candidates = args.candidates.split(",") if args.candidates else None
    configs = [(s, s, {}) for s in args.schemes.split(",") if s]
    configs += [
        (f"auto {b}", "auto", {"budget": float(b), "candidates": candidates}) for b in args.budgets.split(",") if b
    ]
    for label, scheme, kw in configs:
        t0 = time.perf_counter()
        m = quantize(copy.deepcopy(base), scheme, loop, calibration="max", **kw)
        seconds = time.perf_counter() - t0
        report = m.ptq_report
        if report.plan is not None:
            bits, pred = report.plan.bits, f"{report.plan.total_loss_increase:.3g}"
            uniform = report.plan.uniform
        else:
            bits, pred = EFFECTIVE_BITS[scheme], "-"
        to_bf16_gemms(m)
        losses = window_losses(m, test)
        change, sem = paired(losses, ref)
        ppl = math.exp(float(losses.mean()))
        print(
            f"{label:<28} {bits:>5.2f} {pred:>12} {ppl:>9.3f} {change:>+9.2f}% +- {sem:.2f} {seconds:>9.0f}", flush=True
        )
        if report.plan is not None:
            print("   " + ", ".join(f"{c} {k}" for c, k in report.plan.counts().items()))
            experts = {n: c for n, c in report.plan.per_layer.items() if n in experts_modules}
            if experts:
                share = sum(report.plan.params[n] for n in experts) / sum(report.plan.params.values())
                print(f"   experts ({100 * share:.0f}% of the planned weights): " + ", ".join(experts.values()))
    if "uniform" in locals():
        print("predicted (Fisher) loss increase of uniform schemes: "
              + ", ".join(f"{c} {u['loss_increase']:.3g}" for c, u in uniform.items()))  # fmt: skip


if __name__ == "__main__":
    main()
