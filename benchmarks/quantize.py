"""Quantize throughput: eager reference vs fp8kit's fused kernel vs torch.clone, per granularity: the E4M3
granularities and FP4 (E2M1 codes with NVFP4's and MXFP4's block scales) in one table.

Prints GB/s of float32 input read (higher is better) and the ratios it targets:
fused / reference (target >= 4x) and fused / clone (target >= 0.5 for per-tensor).

``--pair``: instead, ``x`` and ``x.T`` quantized along their rows (the weight-gradient copy), bf16
activations of training shapes: the fused pair kernel (one compiled kernel reading ``x`` once, ``x.T``
strided) beside two row-ordered quantizes of ``x`` and of ``x.t().contiguous()`` (what
``quantize_with_transpose`` runs for tiles on CPU in eager mode), in ms, with the transpose copy alone.

``--casts`` (CPU): the compiled per-tensor and 1x128 quantize of bf16 input with each float32 -> FP8
convert (``kernels.fused.set_cpu_cast_kernel``: ``native``, torch's conversion; ``bits``, integer
operations), side by side, to check the rule that picks one by CPU capability.

    python benchmarks/quantize.py [--sizes 1,4,16,64] [--device cpu|cuda]
    python benchmarks/quantize.py --pair [--shapes 2048x2048,2048x8192,4352x1024]
    python benchmarks/quantize.py --casts [--sizes 1,4,16]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from fp8kit import E2M1, E4M3, quantize

GRANULARITIES = ["tensor", "row", (1, 128), (128, 128), "mx"]
ROWS = [(E4M3, g) for g in GRANULARITIES] + [(E2M1, "nvfp4"), (E2M1, "mxfp4")]  # (format, granularity)


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


def pair(shapes: str, device: str) -> None:
    """The pair kernel vs two row-ordered quantizes (see the module doc), E4M3, bf16 input."""
    from fp8kit.kernels import BlockSpec, quantize_pair_fused
    from fp8kit.numerics.scaling import parse_granularity

    def two(x, g):
        kw = {"backend": "compiled", "nonfinite": "propagate"}
        return quantize(x, E4M3, g, **kw), quantize(x.t().contiguous(), E4M3, g, **kw)

    print(f"{'shape':>11} {'granularity':>12} {'pair ms':>8} {'two ms':>8} {'pair/two':>9} {'x.T copy ms':>12}")
    for shape in shapes.split(","):
        r, c = (int(v) for v in shape.split("x"))
        x = torch.randn(r, c, device=device, dtype=torch.bfloat16)
        for gran in ("row", (1, 128), "mx"):
            g = parse_granularity(gran)
            mx = "rceil" if g.is_mx else None
            spec = BlockSpec(E4M3, g.block_shape(r, c), 0, False, mx)
            spec_t = BlockSpec(E4M3, g.block_shape(c, r), 0, False, mx)
            t_pair = timeit(lambda x=x, a=spec, b=spec_t: quantize_pair_fused(x, a, b), device=device)
            t_two = timeit(lambda x=x, g=gran: two(x, g), device=device)
            t_copy = timeit(lambda x=x: x.t().contiguous(), device=device)
            print(
                f"{shape:>11} {str(gran):>12} {t_pair * 1e3:>8.2f} {t_two * 1e3:>8.2f} {t_pair / t_two:>8.2f}x "
                f"{t_copy * 1e3:>11.2f}",
                flush=True,
            )


def casts(sizes: str) -> None:
    """Both CPU float32 -> FP8 converts, side by side (see the module doc), bf16 input, ms per call."""
    from fp8kit.kernels import fused

    chosen = fused.cpu_cast_kernel()
    print(f"{'elements':>9} {'granularity':>12} {'native ms':>10} {'bits ms':>8} {'bits/native':>12}")
    try:
        for m in (int(v) for v in sizes.split(",")):
            x = torch.randn(m * 2**20 // 4096, 4096, dtype=torch.bfloat16)
            for gran in ("tensor", (1, 128)):
                t = {}
                for kernel in ("native", "bits"):
                    fused.set_cpu_cast_kernel(kernel)
                    t[kernel] = timeit(lambda x=x, g=gran: quantize(x, E4M3, g, backend="compiled"))
                print(
                    f"{m:>8}M {str(gran):>12} {t['native'] * 1e3:>10.2f} {t['bits'] * 1e3:>8.2f} "
                    f"{t['bits'] / t['native']:>11.2f}x",
                    flush=True,
                )
    finally:
        fused.set_cpu_cast_kernel(chosen)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16,64", help="millions of elements")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--pair", action="store_true", help="x and x.T: the pair kernel vs two row-ordered quantizes")
    ap.add_argument("--shapes", default="2048x2048,2048x8192,4352x1024", help="--pair: rows x cols, comma separated")
    ap.add_argument("--casts", action="store_true", help="CPU: the native and the bit-level FP8 convert side by side")
    args = ap.parse_args()
    from fp8kit.kernels.fused import cpu_cast_kernel

    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"device {args.device}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"CPU cast kernel {cpu_cast_kernel()}"
    )
    if args.pair:
        pair(args.shapes, args.device)
        return
    if args.casts:
        casts(args.sizes)
        return
    print(
        f"{'elements':>9} {'format':>6} {'granularity':>12} {'reference':>10} {'fused':>8} {'clone':>8} {'fused/ref':>10} "
        f"{'fused/clone':>12}"
    )
    for m in (int(s) for s in args.sizes.split(",")):
        n = m * 2**20
        x = torch.randn(n // 4096, 4096, device=args.device)
        gb = x.numel() * 4 / 1e9
        t_clone = timeit(lambda x=x: x.clone(), device=args.device)
        for fmt, gran in ROWS:
            t_ref = timeit(
                lambda x=x, f=fmt, g=gran: quantize(x, f, g, backend="reference"), min_time=0.0, device=args.device
            )
            t_fast = timeit(lambda x=x, f=fmt, g=gran: quantize(x, f, g, backend="compiled"), device=args.device)
            print(
                f"{m:>8}M {str(fmt):>6} {str(gran):>12} {gb / t_ref:>9.2f}  {gb / t_fast:>7.2f}  {gb / t_clone:>7.2f} "
                f"{t_ref / t_fast:>9.1f}x {t_clone / t_fast:>11.2f}x",
                flush=True,
            )
        del x


if __name__ == "__main__":
    main()
