"""What one layer's training step costs (seconds) with a recipe: a roofline of a named GPU, or timed on this CPU.

A layer is a list of ``Gemm`` shapes (one for a Linear, two for an experts module). Per GEMM the step runs
three matmuls: forward ``Y = X W^T``, the input gradient ``dX = dY W`` and the weight gradient
``dW = dY^T X``. Each takes ``max(flops / peak, bytes / bandwidth)``. BF16 operands are 2 bytes, FP8 codes
1 byte; outputs are 2 bytes (``dW`` 4, FP32). An FP8 recipe adds its casts: each operand (``X``, ``W`` and
``dY``) is read in high precision (``W`` as FP32 master weights) and written as codes plus scales once per
layout the matmuls need; a per-tensor scale (or square weight tiles) gives the second layout by transposing
the codes, a row/tile scale along the reduction dim needs a second quantization. A recipe the GPU has no
native GEMM for (``fp8kit.device.native_on``) runs its matmuls at the BF16 rate on dequantized operands.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..recipes import Recipe, recipe_from_name

__all__ = ["GPU", "GPUS", "TARGETS", "Gemm", "cpu_roofline", "layer_seconds", "measured_seconds"]


@dataclass(frozen=True)
class GPU:
    """Peak dense tensor-core rates (FLOP/s, no sparsity), HBM bandwidth (bytes/s), compute capability;
    ``emulated_flops``: the rate of matmuls on dequantized FP8 operands (default the BF16 peak);
    ``cast_bytes_per_s``: the rate FP8 casts move bytes at (default the HBM bandwidth)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    capability: tuple[int, int]
    emulated_flops: float | None = None
    cast_bytes_per_s: float | None = None


# Dense (non-sparse) peaks: the datasheets print the 2:4-sparsity figure; dense is half of it.
GPUS = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 1,979 / FP8 3,958 TFLOPS with sparsity, HBM3 3.35 TB/s
    "h100": GPU("h100", 989.4e12, 1978.9e12, 3.35e12, (9, 0)),
    # NVIDIA H200 Tensor Core GPU datasheet, SXM: same tensor cores as H100 SXM, HBM3e 4.8 TB/s
    "h200": GPU("h200", 989.4e12, 1978.9e12, 4.8e12, (9, 0)),
    # NVIDIA DGX/HGX B200 datasheet, per GPU: FP8 9 / BF16 4.5 PFLOPS with sparsity, HBM3e 8 TB/s
    "b200": GPU("b200", 2.25e15, 4.5e15, 8.0e12, (10, 0)),
}
TARGETS = (*GPUS, "cpu")
_SCALE_BYTES = 4  # FP32 scales; MX's E8M0 scales are 1 byte


@dataclass(frozen=True)
class Gemm:
    """``tokens`` rows through a ``in_features -> out_features`` projection held ``weights`` times (experts)."""

    tokens: int
    in_features: int
    out_features: int
    weights: int = 1


def _scales(recipe: Recipe, role: str, rows: int, cols: int) -> float:
    """Bytes of the scales of a ``rows x cols`` operand (``cols`` along the GEMM's reduction dim)."""
    gran = recipe.granularity_for(role)
    if gran == "mx":
        return rows * cols / 32
    if gran == "tensor":
        return _SCALE_BYTES
    if gran == "row":
        return rows * _SCALE_BYTES
    br, bc = gran
    return -(-rows // br) * -(-cols // bc) * _SCALE_BYTES


def _cast_bytes(recipe: Recipe, g: Gemm) -> float:
    """Bytes the casts of one layer step move: each operand quantized per layout the three matmuls need."""
    m, k, n, w = g.tokens, g.in_features, g.out_features, g.weights
    total = 0.0
    for role, rows, cols, src in (("input", m, k, 2), ("weight", w * n, k, 4), ("grad", m, n, 2)):
        once = rows * cols * (src + 1) + _scales(recipe, role, rows, cols)
        transposable = recipe.per_tensor or (role == "weight" and recipe.weight_transposes_codes)
        second = 2 * rows * cols if transposable else rows * cols * (src + 1) + _scales(recipe, role, cols, rows)
        total += once + second
    return total


def _matmuls(g: Gemm, operand: int) -> list[tuple[float, float]]:
    """(flops, bytes) of the forward, input-gradient and weight-gradient matmuls, ``operand`` bytes per input."""
    m, k, n, w = g.tokens, g.in_features, g.out_features, g.weights
    flops = 2.0 * m * k * n
    return [
        (flops, operand * (m * k + w * k * n) + 2 * m * n),
        (flops, operand * (m * n + w * k * n) + 2 * m * k),
        (flops, operand * (m * k + m * n) + 4 * w * k * n),
    ]


def layer_seconds(gemms: list[Gemm], candidate: str, gpu: GPU) -> float:
    """Roofline seconds of one training step of a layer (``gemms``) with ``candidate`` ("bf16" or a recipe)."""
    from ..device import native_on

    total = 0.0
    for g in gemms:
        if candidate == "bf16":
            total += sum(max(f / gpu.bf16_flops, b / gpu.hbm_bytes_per_s) for f, b in _matmuls(g, 2))
            continue
        recipe = recipe_from_name(candidate)
        if native_on(recipe, gpu.capability):
            matmul = sum(max(f / gpu.fp8_flops, b / gpu.hbm_bytes_per_s) for f, b in _matmuls(g, 1))
        else:  # emulated: dequantize each FP8 operand (read 1, write 2 bytes) and run the matmul on the values
            rate = gpu.emulated_flops or gpu.bf16_flops
            dequant = sum(3 * (b - 2 * g.tokens * g.out_features) for _, b in _matmuls(g, 1))
            matmul = sum(max(f / rate, b / gpu.hbm_bytes_per_s) for f, b in _matmuls(g, 2))
            matmul += dequant / (gpu.cast_bytes_per_s or gpu.hbm_bytes_per_s)
        total += matmul + _cast_bytes(recipe, g) / (gpu.cast_bytes_per_s or gpu.hbm_bytes_per_s)
    return total


def measured_seconds(gemms: list[Gemm], candidate: str, reps: int = 3) -> float:
    """Seconds of one training step (forward + backward) of the layer's GEMMs on this CPU with
    ``candidate``, each GEMM timed as an ``nn.Linear`` (its ``weights`` copies as one wider-token matmul),
    best of ``reps`` after a warm-up."""
    from ..nn import convert, to_bf16_gemms

    total = 0.0
    gen = torch.Generator().manual_seed(0)
    for g in gemms:
        layer = torch.nn.Sequential(torch.nn.Linear(g.in_features, g.out_features, bias=False))
        if candidate == "bf16":
            to_bf16_gemms(layer)
        else:
            convert(layer, candidate, module_filter=lambda _n, _m: True)
        x = torch.randn(g.tokens, g.in_features, generator=gen, requires_grad=True)
        best = float("inf")
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            layer(x).sum().backward()
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def _best_seconds(fn, reps: int = 4) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def cpu_roofline() -> GPU:
    """This CPU as a roofline, its rates measured now: the BF16 rate of one training step of a 512 x 512 BF16
    layer on 512 tokens (what the BF16 layers run: ``nn.to_bf16_gemms``), a 512^3 FP32 matmul (FP8 GEMMs are
    emulated on exact values in FP32), a 64 MiB copy (bandwidth), and a per-tensor E4M3 cast of 4 Mi values
    (FP32 read, codes written: the rate casts and dequantization move bytes at). No native FP8 GEMM."""
    from ..nn import to_bf16_gemms
    from ..tensor import quantize

    a = torch.randn(512, 512, requires_grad=True)
    layer = to_bf16_gemms(torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False)))
    flops = 2 * 512**3
    bf16 = 3 * flops / _best_seconds(lambda: layer(a).sum().backward())
    w = a.detach()
    fp32 = flops / _best_seconds(lambda: w @ w)
    src = torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src))
    x = src[: 4 * 2**20]
    cast = x.numel() * 5 / _best_seconds(lambda: quantize(x))
    return GPU("cpu", bf16, fp32, bandwidth, (0, 0), emulated_flops=fp32, cast_bytes_per_s=cast)
