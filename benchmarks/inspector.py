"""Overhead of the FP8 numerics inspector on a training step of the demo Llama.

One run, side by side: a converted model trained with no inspector, with the inspector every 10 steps,
every step, and every step with two what-if recipes. Mean step time (the amortized cost) and median
over the measured steps, and their ratios to the run without the inspector. (Outside its ``with`` block the inspector leaves no hook, so
"off" is exactly the plain model.)

    python benchmarks/inspector.py [--steps 20] [--model-size small]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
import warnings

import torch

import fp8kit
from fp8kit import debug
from fp8kit.models import build_llama

warnings.filterwarnings("ignore")


def run(model, batches, inspector_kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []

    def loop(insp=None):
        for x in batches:
            t = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if insp is not None:
                insp.step()
            times.append(time.perf_counter() - t)

    if inspector_kwargs is None:
        loop()
    else:
        with debug.inspect(model, tensorboard=False, **inspector_kwargs) as insp:
            loop(insp)
    measured = times[2:]  # skip warm-up steps
    return statistics.mean(measured), statistics.median(measured)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model-size", default="small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = fp8kit.convert(build_llama(args.model_size, seed=0), fp8kit.DelayedScaling())
    batches = [torch.randint(0, 256, (args.batch_size, args.seq_len)) for _ in range(args.steps)]
    configs = [
        ("off", None),
        ("every 10 steps", {"every": 10}),
        ("every step", {"every": 1}),
        ("every step + what-if current, block", {"every": 1, "what_if": ["current", "block"]}),
    ]
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"demo Llama '{args.model_size}', delayed scaling, {args.batch_size}x{args.seq_len} tokens, {args.steps} steps"
    )
    print(f"{'inspector':<38} {'mean step (s)':>14} {'vs off':>7} {'median step (s)':>16} {'vs off':>7}")
    ref = None
    for name, kw in configs:
        mean, median = run(copy.deepcopy(base), batches, kw)
        ref = ref or (mean, median)
        print(f"{name:<38} {mean:>14.3f} {mean / ref[0]:>6.2f}x {median:>16.3f} {median / ref[1]:>6.2f}x")


if __name__ == "__main__":
    main()
