"""MLP block forward+backward: nn.Linear fp32/bf16, torchao Float8Linear, fp8kit recipes (eager, compiled).

One run, side by side, per shape ``d -> 4d -> d`` (GELU) over ``T`` tokens: median step time, ratios to
bf16 and fp32 (and to the faster of the plain bf16 and fp32 steps: the CPU target), and the
bytes autograd saves for backward (activations only; FP8 weight caches and parameters excluded). BF16
and torchao run compiled as well as eager (torchao is meant to be compiled); fp8kit's compiled rows use
``fp8kit.compile`` (``torch.compile`` whose partitioner keeps FP8 activations for backward). Slow baselines (bf16 GEMMs
on CPUs without native bf16) run once.

    python benchmarks/linear.py [--shapes 2048x2048] [--recipes current,rowwise] [--no-compile] [--no-torchao]
    python benchmarks/linear.py --shapes 4096x8192,8192x8192 --reps 20      # GPU shapes
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        python benchmarks/linear.py --cpu-gemm-backend fp32 --bf16-max-d 0      # an AVX2 CPU, emulated
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
import warnings

import torch

import fp8kit
from fp8kit.gemm import cpu_gemm_backend
from fp8kit.nn import saved_activation_bytes
from fp8kit.numerics.recipes import recipe_from_name

warnings.filterwarnings("ignore")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mlp(d: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))


def step_time(model, x, g, reps: int, slow_after: float) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def step():
        y = model(x)
        y.backward(g)
        sync()  # CUDA runs asynchronously: a step ends when its kernels have

    step()  # warm-up: compilation, first-step scaling
    t = time.perf_counter()
    step()  # delayed scaling switches to its stored scales on the second step
    second = time.perf_counter() - t
    if second > slow_after:  # a slow baseline (bf16 GEMMs on a CPU without bf16): one step is the figure
        return second
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
    ap.add_argument("--shapes", default="2048x2048", help="d x tokens, comma separated")
    ap.add_argument("--recipes", default="delayed,current,rowwise,block,mxfp8", help="fp8kit recipes to time")
    ap.add_argument("--no-eager", action="store_true", help="time compiled modules only (GPU runs)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--slow-after", type=float, default=20.0, help="seconds: one timed step beyond this")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument(
        "--bf16-max-d", type=int, default=2048, help="skip nn.Linear bf16 above this d (slow on CPUs without bf16)"
    )
    ap.add_argument(
        "--cpu-gemm-backend",
        choices=["fp32", "bf16"],
        help="override fp8kit's CPU GEMM choice (e.g. fp32 when emulating an AVX2 machine with "
        "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2)",
    )
    args = ap.parse_args()
    if args.cpu_gemm_backend:
        from fp8kit.gemm import set_cpu_gemm_backend

        set_cpu_gemm_backend(args.cpu_gemm_backend)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        where = torch.cuda.get_device_name()
    else:
        cap = torch.backends.cpu.get_cpu_capability()
        where = f"{torch.get_num_threads()} threads, {cap}, fp8kit CPU GEMM backend {cpu_gemm_backend()}"
        limits = [f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS") if k in os.environ]
        where += f" (ISA limited: {', '.join(limits)})" if limits else ""
    print(f"# {_cpu_name()}, {where}, torch {torch.__version__}, {dev}")
    recipes = [recipe_from_name(r) for r in args.recipes.split(",") if r]
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

        eager = not args.no_eager
        run("nn.Linear fp32", copy.deepcopy(base), torch.float32)
        if d <= args.bf16_max_d or dev == "cuda":
            if eager:
                run("nn.Linear bf16", copy.deepcopy(base).bfloat16(), torch.bfloat16)
            if not args.no_compile:
                run("nn.Linear bf16 compiled", torch.compile(copy.deepcopy(base).bfloat16()), torch.bfloat16)
        if not args.no_torchao:
            try:
                from torchao.float8 import convert_to_float8_training

                ao = convert_to_float8_training(copy.deepcopy(base).bfloat16())
                if eager:
                    run("torchao Float8Linear (bf16)", ao, torch.bfloat16)
                if not args.no_compile:
                    ao = torch.compile(convert_to_float8_training(copy.deepcopy(base).bfloat16()))
                    run("torchao Float8Linear (bf16) compiled", ao, torch.bfloat16)
            except Exception as err:  # not installed, built for another torch, or no CPU kernels
                print(f"  torchao unavailable ({type(err).__name__}: {str(err)[:200]}); pip install -e '.[bench]'")
        for recipe in recipes:
            if eager:
                model = fp8kit.convert(copy.deepcopy(base).bfloat16(), recipe)
                run(f"fp8kit {recipe.kind} (bf16)", model, torch.bfloat16)
            if not args.no_compile:
                # fp8kit.compile: torch.compile with the activation memory budget that keeps FP8 copies
                compiled = fp8kit.compile(fp8kit.convert(copy.deepcopy(base).bfloat16(), recipe), fullgraph=True)
                run(f"fp8kit {recipe.kind} (bf16) compiled", compiled, torch.bfloat16)
        fp32 = rows[0][1]
        bf16_rows = [r for r in rows if r[0] in ("nn.Linear bf16", "nn.Linear bf16 compiled")]
        ref = min(bf16_rows, key=lambda r: r[1]) if bf16_rows else None
        bf16, bf16_mem = (ref[1], ref[2]) if ref else (float("nan"), rows[0][2] / 2)
        fastest_plain = min(fp32, bf16) if ref else fp32
        print(
            f"\nMLP {d} -> {4 * d} -> {d}, {tokens} tokens, forward+backward; 'vs bf16' = vs the faster bf16 row"
            + ("" if ref else " (bf16 skipped: too slow here; memory ratio vs half of fp32)")
        )
        print(
            f"| {'module':<40} | {'step (ms)':>9} | {'vs bf16':>8} | {'vs fp32':>8} | {'vs faster':>9} "
            f"| {'saved act. MiB':>14} | {'vs bf16':>7} |"
        )
        print(f"|{'-' * 42}|{'-' * 11}|{'-' * 10}|{'-' * 10}|{'-' * 11}|{'-' * 16}|{'-' * 9}|")
        for name, t, mem in rows:
            print(
                f"| {name:<40} | {t * 1e3:>9.2f} | {t / bf16:>7.2f}x | {t / fp32:>7.2f}x | {t / fastest_plain:>8.2f}x "
                f"| {mem / 2**20:>14.1f} | {mem / bf16_mem:>6.2f}x |"
            )
        print(flush=True)


if __name__ == "__main__":
    main()
