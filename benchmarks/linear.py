"""MLP block forward+backward: nn.Linear fp32/bf16, torchao Float8Linear, fp8kit recipes (eager, compiled).

One run, side by side, per shape ``d -> 4d -> d`` (GELU) over ``T`` tokens: median step time, ratios to
bf16 and fp32, and the bytes autograd saves for backward (activations only; FP8 weight caches and
parameters excluded). Slow baselines (bf16 GEMMs on CPUs without native bf16) run once.

    python benchmarks/linear.py [--shapes 512x512,2048x2048,4096x2048] [--no-compile] [--no-torchao]
"""

from __future__ import annotations

import argparse
import copy
import platform
import time
import warnings

import torch

import fp8kit
from fp8kit.nn import saved_activation_bytes
from fp8kit.recipes import all_recipes

warnings.filterwarnings("ignore")
RECIPES = all_recipes()


def mlp(d: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))


def step_time(model, x, g, reps: int, slow_after: float) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def step():
        y = model(x)
        y.backward(g)
        sync()  # CUDA runs asynchronously: a step ends when its kernels have

    t = time.perf_counter()
    step()  # warm-up: compilation, first-step scaling
    first = time.perf_counter() - t
    if first > slow_after:  # a slow baseline (bf16 GEMMs on a CPU without bf16): one step is the figure
        return first
    step()  # delayed scaling switches to its stored scales on the second step
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def saved_bytes(model, x) -> int:
    return saved_activation_bytes(model(x), exclude=list(model.parameters()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="512x512,2048x2048,4096x2048", help="d x tokens, comma separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slow-after", type=float, default=20.0, help="seconds: one timed step beyond this")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument(
        "--bf16-max-d", type=int, default=2048, help="skip nn.Linear bf16 above this d (slow on CPUs without bf16)"
    )
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.cuda.get_device_name() if dev == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"# {platform.processor() or platform.machine()}, {where}, torch {torch.__version__}, {dev}")
    for shape in args.shapes.split(","):
        d, tokens = (int(v) for v in shape.split("x"))
        base = mlp(d).to(dev)
        x32 = torch.randn(tokens, d, device=dev)
        g32 = torch.randn(tokens, d, device=dev)
        rows: list[tuple[str, float, int]] = []

        def run(name, model, dtype, x32=x32, g32=g32, rows=rows):
            x, g = x32.to(dtype), g32.to(dtype)
            t = step_time(model, x, g, args.reps, args.slow_after)
            rows.append((name, t, saved_bytes(model, x)))
            print(f"  measured {name}: {t * 1e3:.2f} ms", flush=True)

        run("nn.Linear fp32", copy.deepcopy(base), torch.float32)
        if d <= args.bf16_max_d or dev == "cuda":
            run("nn.Linear bf16", copy.deepcopy(base).bfloat16(), torch.bfloat16)
        if not args.no_torchao:
            try:
                from torchao.float8 import convert_to_float8_training

                run(
                    "torchao Float8Linear (bf16)",
                    convert_to_float8_training(copy.deepcopy(base).bfloat16()),
                    torch.bfloat16,
                )
            except Exception as err:  # not installed, or built for another torch
                print(f"  torchao unavailable ({type(err).__name__}: {err}); pip install -e '.[bench]'")
        for recipe in RECIPES:
            run(f"fp8kit {recipe.kind} (bf16)", fp8kit.convert(copy.deepcopy(base).bfloat16(), recipe), torch.bfloat16)
            if not args.no_compile:
                compiled = torch.compile(fp8kit.convert(copy.deepcopy(base).bfloat16(), recipe))
                run(f"fp8kit {recipe.kind} (bf16) compiled", compiled, torch.bfloat16)
        fp32 = rows[0][1]
        ref = next((r for r in rows if r[0] == "nn.Linear bf16"), None)
        bf16, bf16_mem = (ref[1], ref[2]) if ref else (float("nan"), rows[0][2] / 2)
        print(
            f"\nMLP {d} -> {4 * d} -> {d}, {tokens} tokens, forward+backward"
            + ("" if ref else " (bf16 skipped: too slow here; memory ratio vs half of fp32)")
        )
        print(
            f"| {'module':<36} | {'step (ms)':>9} | {'vs bf16':>8} | {'vs fp32':>8} | {'saved act. MiB':>14} | {'vs bf16':>7} |"
        )
        print(f"|{'-' * 38}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 16}|{'-' * 9}|")
        for name, t, mem in rows:
            print(
                f"| {name:<36} | {t * 1e3:>9.2f} | {t / bf16:>7.2f}x | {t / fp32:>7.2f}x | {mem / 2**20:>14.1f} | {mem / bf16_mem:>6.2f}x |"
            )
        print(flush=True)


if __name__ == "__main__":
    main()
