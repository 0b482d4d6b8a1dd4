"""One MoE experts layer forward+backward: fp8kit (each recipe) vs transformers' ``grouped_mm`` and
``eager`` experts implementations, side by side in one run.

A Qwen3-MoE experts module (``E`` experts, top-``k`` routing, hidden ``d``, expert intermediate ``i``)
over ``T`` tokens with a fixed random routing. High-precision rows: ``grouped_mm`` and ``eager`` in
FP32, and in BF16 (weights and activations bfloat16; ``torch._grouped_mm`` ignores bf16 autocast on
CPU, so the BF16 rows cast the module), and fp8kit's BF16 baseline (``nn.to_bf16_gemms``: FP32 weights,
bf16-rounded GEMM operands, FP32 accumulation, as ``fp8kit train``'s bf16 run). fp8kit rows: the
``"fp8kit"`` experts implementation with FP32 or BF16 weights, eager and compiled (``fp8kit.compile``,
``fullgraph=True``; beside ``torch.compile`` of the BF16 ``grouped_mm`` module). Median step time over
``--reps`` steps; each row's ratio to the fastest high-precision step (compiled or not) and whether it
meets the CPU target (<= 1.5x). One more high-precision row, ``grouped_mm bf16, fp8kit routing``
(fp8kit's token routing around plain bf16 ``torch._grouped_mm`` GEMMs), is not one of the target's
baselines: each FP8 row's ratio to it ("x same routing") is the cost of FP8 alone, without the routing's
own speed-up (its backward gathers where transformers' scatters with accumulation).

Fair to the high-precision rows: every fp8kit step quantizes the expert weights again, as a training step
does after its optimizer update (the eager FP8 weight cache is dropped before each step, as the optimizer
step hook drops it; compiled graphs never cache). ``--keep-weight-cache`` times cache hits instead (weights
quantized once, as in inference or gradient accumulation). And to every row alike: glibc is told to keep
freed memory (``keep_freed_memory``), else the rows timed first pay page faults for every large tensor a
step allocates again (up to 60,000 minor faults per step seen, about 10 ms); the table reports the faults
per step; ``--allocator-as-is`` leaves the allocator alone.

    python benchmarks/moe.py [--experts 8 --topk 2 --d 1024 --inter 512 --tokens 2048] [--recipes delayed,rowwise]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

import fp8kit
from fp8kit.gemm import cpu_gemm_backend

warnings.filterwarnings("ignore")


def experts(args, impl: str, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=args.d, moe_intermediate_size=args.inter, num_experts=args.experts)
    cfg._experts_implementation = impl
    module = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    return module.to(dtype)


TARGET = 1.5  # CPU target: an FP8 step within 1.5x the fastest high-precision step
SAME_ROUTING = "grouped_mm bf16, fp8kit routing"


class RoutedBF16(torch.nn.Module):
    """fp8kit's routing (``nn.experts.routed_experts_forward``) around plain bf16 ``torch._grouped_mm``
    GEMMs: the high-precision step with the FP8 experts' own routing, so that an FP8 step's ratio to it is
    FP8's own cost (the target's baselines route the tokens with transformers' code)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.experts = module

    def forward(self, hidden, top_k_index, top_k_weights):
        from fp8kit.nn.experts import routed_experts_forward

        m = self.experts

        def project(x, p, expert_ids):
            offs = torch.cumsum(torch.bincount(expert_ids, minlength=m.num_experts), 0).to(torch.int32)
            weight = m.gate_up_proj if p == 0 else m.down_proj
            return torch._grouped_mm(x, weight.transpose(1, 2), offs=offs)

        return routed_experts_forward(m, hidden, top_k_index, top_k_weights, project)


def step_time(module, inputs, reps: int, requantize: torch.nn.Module | None = None) -> float:
    """Median seconds of one forward+backward; ``requantize``: an FP8 experts module whose weight cache
    is dropped before every step (what an optimizer step does)."""
    x, idx, w, g = inputs

    def step():
        if requantize is not None:
            requantize.release_fp8_weights()
        xr = x.clone().requires_grad_()
        module(xr, idx, w).backward(g)

    step()
    step()
    times = []
    faults = _minor_faults()
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        module.zero_grad(set_to_none=True)
    LAST_FAULTS[0] = (_minor_faults() - faults) / reps
    times.sort()
    return times[len(times) // 2]


LAST_FAULTS = [0.0]  # minor page faults per step of the last ``step_time``


def keep_freed_memory() -> str:
    """Make glibc keep freed memory in the process (``mallopt``: blocks up to 32 MiB from the heap, never
    trimmed), so that no row pays page faults for memory an earlier step freed; by default glibc gives
    large freed blocks back to the OS and the rows timed first (the high-precision ones) fault the most.
    Returns what was done, for the header."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "allocator as is (not glibc)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    if mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 2**31 - 1):
        return "glibc keeps freed memory (mallopt)"
    return "allocator as is (mallopt refused)"


def _minor_faults() -> int:
    """Minor page faults of this process so far (first touches of memory the allocator got fresh from the
    OS: glibc returns large freed blocks to the OS, so a step that allocates them again faults again)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--recipes", default="delayed,current,rowwise,block,mxfp8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true", help="eager rows only")
    ap.add_argument("--keep-weight-cache", action="store_true", help="quantize the FP8 weights once, not every step")
    ap.add_argument(
        "--allocator-as-is", action="store_true", help="leave glibc's allocator as is (freed memory faults again)"
    )
    args = ap.parse_args()
    allocator = "allocator as is" if args.allocator_as_is else keep_freed_memory()
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(1)
    t = args.tokens
    scores = torch.rand(t, args.experts, generator=gen)
    top_w, top_i = scores.topk(args.topk, dim=-1)
    x = torch.randn(t, args.d, generator=gen)
    g = torch.randn(t, args.d, generator=gen)

    def inputs(dtype):
        return x.to(dev, dtype), top_i.to(dev), (top_w / top_w.sum(-1, keepdim=True)).to(dev, dtype), g.to(dev, dtype)

    print(
        f"MoE experts layer: E={args.experts} top-{args.topk} d={args.d} i={args.inter} tokens={t} on {dev} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads, CPU FP8 GEMM backend {cpu_gemm_backend()}, "
        f"FP8 weights {'cached' if args.keep_weight_cache else 'quantized every step'}; {allocator}); "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    rows: list[tuple[str, float]] = []
    faults: dict[str, float] = {}  # minor page faults per step, by row
    for impl in ("grouped_mm", "eager"):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{impl} {'fp32' if dtype == torch.float32 else 'bf16'}"
            rows.append((name, step_time(experts(args, impl, dtype).to(dev), inputs(dtype), args.reps)))
            print(f"  {name}: {rows[-1][1] * 1e3:.1f} ms", flush=True)
            faults[name] = LAST_FAULTS[0]
    if not args.no_compile:
        name = "grouped_mm bf16 compiled"
        module = torch.compile(experts(args, "grouped_mm", torch.bfloat16).to(dev), fullgraph=True)
        rows.append((name, step_time(module, inputs(torch.bfloat16), args.reps)))
        print(f"  {name}: {rows[-1][1] * 1e3:.1f} ms", flush=True)
        faults[name] = LAST_FAULTS[0]
    from fp8kit.nn import to_bf16_gemms

    name = "bf16 baseline (to_bf16_gemms)"
    rows.append(
        (
            name,
            step_time(
                to_bf16_gemms(experts(args, "grouped_mm", torch.float32)).to(dev), inputs(torch.float32), args.reps
            ),
        )
    )
    print(f"  {name}: {rows[-1][1] * 1e3:.1f} ms", flush=True)
    faults[name] = LAST_FAULTS[0]
    base = min(s for _, s in rows)  # every row so far is high precision: the target's baselines
    rows.append(
        (
            SAME_ROUTING,
            step_time(
                RoutedBF16(experts(args, "grouped_mm", torch.bfloat16).to(dev)), inputs(torch.bfloat16), args.reps
            ),
        )
    )
    print(f"  {SAME_ROUTING}: {rows[-1][1] * 1e3:.1f} ms", flush=True)
    faults[SAME_ROUTING] = LAST_FAULTS[0]
    same = rows[-1][1]
    for recipe in args.recipes.split(","):
        variants = [(torch.float32, "fp32 weights", False), (torch.bfloat16, "bf16", False)]
        variants += [] if args.no_compile else [(torch.bfloat16, "bf16, compiled", True)]
        for dtype, label, compiled in variants:
            holder = fp8kit.convert(torch.nn.Sequential(experts(args, "grouped_mm", dtype).to(dev)), recipe)
            module = fp8kit.compile(holder[0], fullgraph=True) if compiled else holder[0]
            cache = None if args.keep_weight_cache or compiled else holder[0]
            rows.append((f"fp8kit {recipe} ({label})", step_time(module, inputs(dtype), args.reps, cache)))
            print(f"  {rows[-1][0]}: {rows[-1][1] * 1e3:.1f} ms", flush=True)
            faults[rows[-1][0]] = LAST_FAULTS[0]
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print(
        f"{'implementation':32s} {'step ms':>9s} {'x fastest high-prec.':>20s} {f'<= {TARGET}x':>8s} "
        f"{'x same routing':>14s} {'page faults/step':>16s}"
    )
    for name, sec in rows:
        fp8 = name.startswith("fp8kit ")
        meets = "" if not fp8 else ("yes" if sec / base <= TARGET else "no")
        vs_same = f"{sec / same:14.2f}" if fp8 or name == SAME_ROUTING else " " * 14
        print(f"{name:32s} {sec * 1e3:9.1f} {sec / base:20.2f} {meets:>8s} {vs_same} {faults[name]:16.0f}")
    print(
        f"x fastest high-prec.: the CPU target's ratio, against transformers' grouped_mm / eager and fp8kit's BF16 "
        f"baseline; x same routing: against '{SAME_ROUTING}', the BF16 step with fp8kit's routing (FP8's own cost)"
    )
    from fp8kit.gemm.grouped import grouped_gemm_fallbacks

    for kind, why in grouped_gemm_fallbacks().items():
        print(f"fallback {kind}: {why}")


if __name__ == "__main__":
    main()
