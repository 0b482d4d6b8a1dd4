"""Quantize throughput: eager reference vs fp8kit's fused kernel vs torch.clone, per granularity.

Prints GB/s of float32 input read (higher is better) and the ratios the foundation issue targets:
fused / reference (target >= 4x) and fused / clone (target >= 0.5 for per-tensor).

    python benchmarks/quantize.py [--sizes 1,4,16,64] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from fp8kit import E4M3, quantize

GRANULARITIES = ["tensor", "row", (1, 128), (128, 128), "mx"]


def timeit(fn, min_time: float = 0.3, device: str = "cpu") -> float:
    """Median seconds per call over repeats lasting at least ``min_time``."""
    fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    times: list[float] = []
    while sum(times) < min_time or len(times) < 3:
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16,64", help="millions of elements")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, device {args.device}"
    )
    print(
        f"{'elements':>9} {'granularity':>12} {'reference':>10} {'fused':>8} {'clone':>8} {'fused/ref':>10} {'fused/clone':>12}"
    )
    for m in (int(s) for s in args.sizes.split(",")):
        n = m * 2**20
        x = torch.randn(n // 4096, 4096, device=args.device)
        gb = x.numel() * 4 / 1e9
        t_clone = timeit(lambda x=x: x.clone(), device=args.device)
        for gran in GRANULARITIES:
            t_ref = timeit(
                lambda x=x, g=gran: quantize(x, E4M3, g, backend="reference"), min_time=0.0, device=args.device
            )
            t_fast = timeit(lambda x=x, g=gran: quantize(x, E4M3, g, backend="compiled"), device=args.device)
            print(
                f"{m:>8}M {str(gran):>12} {gb / t_ref:>9.2f}  {gb / t_fast:>7.2f}  {gb / t_clone:>7.2f} "
                f"{t_ref / t_fast:>9.1f}x {t_clone / t_fast:>11.2f}x",
                flush=True,
            )
        del x


if __name__ == "__main__":
    main()
