"""What one layer's training step costs (seconds) with a recipe: a roofline of a named GPU, or timed on this CPU.

A layer is a list of ``Gemm`` shapes (one for a Linear, two for an experts module). Per GEMM the step runs
three matmuls: forward ``Y = X W^T``, the input gradient ``dX = dY W`` and the weight gradient
``dW = dY^T X``. Each takes ``max(flops / peak, bytes / bandwidth)``. BF16 operands are 2 bytes, FP8 codes
1 byte; outputs are 2 bytes (``dW`` 4, FP32). An FP8 recipe adds its casts: each operand (``X``, ``W`` and
``dY``) is read in high precision (``W`` as FP32 master weights) and written as codes plus scales once per
layout the matmuls need; a per-tensor scale (or square weight tiles) gives the second layout by transposing
the codes, a row/tile scale along the reduction dim needs a second quantization. A recipe the GPU has no
native GEMM for (``fp8kit.runtime.device.native_on``) runs its matmuls at the BF16 rate on dequantized operands.
Each matmul and each quantization pass may also cost a fixed time per call (dispatch, kernel launch): zero
for the GPUs, whose published speed-ups are of compiled graphs; measured on this CPU by ``cpu_roofline``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from ..numerics.recipes import Recipe, recipe_from_name

__all__ = ["GPU", "GPUS", "TARGETS", "Gemm", "cpu_roofline", "layer_seconds", "measured_seconds"]


@dataclass(frozen=True)
class GPU:
    """Peak dense tensor-core rates (FLOP/s, no sparsity), HBM bandwidth (bytes/s), compute capability;
    ``emulated_flops``: the rate of matmuls on dequantized FP8 operands (default the BF16 peak);
    ``cast_bytes_per_s``: the rate FP8 casts move bytes at (default the HBM bandwidth);
    ``dequant_bytes_per_s``: the rate an emulated matmul dequantizes its FP8 operands at (default the cast
    rate); ``tile_dequant_bytes_per_s``: the same for operands whose scales vary along the reduction dim
    (tiles, MX blocks; default ``dequant_bytes_per_s``); ``matmul_call_s`` / ``cast_call_s``: fixed seconds
    each matmul / each quantization pass costs beyond its FLOPs and bytes."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    capability: tuple[int, int]
    emulated_flops: float | None = None
    cast_bytes_per_s: float | None = None
    dequant_bytes_per_s: float | None = None
    tile_dequant_bytes_per_s: float | None = None
    matmul_call_s: float = 0.0
    cast_call_s: float = 0.0


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


def _cast_passes(recipe: Recipe, g: Gemm) -> list[float]:
    """Bytes of each quantization pass of one layer step: each operand quantized once per layout the three
    matmuls need (the second layout a transpose of the codes where the scales allow it)."""
    m, k, n, w = g.tokens, g.in_features, g.out_features, g.weights
    passes = []
    for role, rows, cols, src in (("input", m, k, 2), ("weight", w * n, k, 4), ("grad", m, n, 2)):
        once = rows * cols * (src + 1) + _scales(recipe, role, rows, cols)
        transposable = recipe.per_tensor or (role == "weight" and recipe.weight_transposes_codes)
        second = 2 * rows * cols if transposable else rows * cols * (src + 1) + _scales(recipe, role, cols, rows)
        passes += [once, second]
    return passes


def _matmuls(g: Gemm, operand: int) -> list[tuple[float, float]]:
    """(flops, bytes) of the forward, input-gradient and weight-gradient matmuls, ``operand`` bytes per input."""
    m, k, n, w = g.tokens, g.in_features, g.out_features, g.weights
    flops = 2.0 * m * k * n
    return [
        (flops, operand * (m * k + w * k * n) + 2 * m * n),
        (flops, operand * (m * n + w * k * n) + 2 * m * k),
        (flops, operand * (m * k + m * n) + 4 * w * k * n),
    ]


def _dequant_bytes(g: Gemm) -> float:
    """Bytes an emulated step's dequantization moves: both FP8 operands of each of the three matmuls (``X``
    and ``W``, ``dY`` and ``W``, ``dY`` and ``X``), each element read as 1 byte and written as 2."""
    m, k, n, w = g.tokens, g.in_features, g.out_features, g.weights
    return 3 * 2 * (m * k + w * k * n + m * n)


def layer_seconds(gemms: list[Gemm], candidate: str, gpu: GPU) -> float:
    """Roofline seconds of one training step of a layer (``gemms``) with ``candidate`` ("bf16" or a recipe)."""
    from ..runtime.device import native_on

    total = 0.0
    for g in gemms:
        if candidate == "bf16":
            total += sum(max(f / gpu.bf16_flops, b / gpu.hbm_bytes_per_s) for f, b in _matmuls(g, 2))
            total += 3 * gpu.matmul_call_s
            continue
        recipe = recipe_from_name(candidate)
        cast_rate = gpu.cast_bytes_per_s or gpu.hbm_bytes_per_s
        if native_on(recipe, gpu.capability):
            matmul = sum(max(f / gpu.fp8_flops, b / gpu.hbm_bytes_per_s) for f, b in _matmuls(g, 1))
        else:  # emulated: dequantize each FP8 operand (read 1, write 2 bytes) and run the matmul on the values
            rate = gpu.emulated_flops or gpu.bf16_flops
            dequant_rate = gpu.dequant_bytes_per_s or cast_rate
            if recipe.tile_width:
                dequant_rate = gpu.tile_dequant_bytes_per_s or dequant_rate
            matmul = sum(max(f / rate, b / gpu.hbm_bytes_per_s) for f, b in _matmuls(g, 2))
            matmul += _dequant_bytes(g) / dequant_rate
        passes = _cast_passes(recipe, g)
        total += matmul + 3 * gpu.matmul_call_s + sum(passes) / cast_rate + len(passes) * gpu.cast_call_s
    return total


def _layer(in_features: int, out_features: int, candidate: str) -> torch.nn.Module:
    """An ``nn.Linear`` (no bias) that computes with ``candidate``: BF16 GEMMs or an FP8 recipe."""
    from ..nn import convert, to_bf16_gemms

    layer = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False))
    if candidate == "bf16":
        return to_bf16_gemms(layer)
    return convert(layer, candidate, module_filter=lambda _n, _m: True)


def measured_seconds(gemms: list[Gemm], candidate: str, reps: int = 3) -> float:
    """Seconds of one training step (forward + backward) of the layer's GEMMs on this CPU with
    ``candidate``, each GEMM timed as an ``nn.Linear`` (its ``weights`` copies as one wider-token matmul),
    best of ``reps`` after a warm-up."""
    total = 0.0
    gen = torch.Generator().manual_seed(0)
    for g in gemms:
        layer = _layer(g.in_features, g.out_features, candidate)
        x = torch.randn(g.tokens, g.in_features, generator=gen, requires_grad=True)
        best = float("inf")
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            layer(x).sum().backward()
            best = min(best, time.perf_counter() - t0)
        total += best
    return total


def _best_seconds(fn, reps: int = 5) -> float:
    """Best of ``reps`` timed calls of ``fn`` after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def step_seconds(tokens: int, side: int, candidate: str) -> float:
    """Best seconds of one training step of a ``side x side`` layer on ``tokens`` tokens with ``candidate``."""
    layer = _layer(side, side, candidate)
    x = torch.randn(tokens, side, requires_grad=True)
    return _best_seconds(lambda: layer(x).sum().backward())


def cpu_roofline() -> GPU:
    """This CPU as a roofline, its rates measured now, each on what the layers run:

    * fixed costs per call: a training step of a tiny (16 x 16, 16 tokens) BF16 layer, over its 3 matmuls;
      the same step per-tensor FP8 costs more, over its 6 quantization passes;
    * the BF16 rate: a training step of a 512 x 512 BF16 layer on 1000 tokens (``nn.to_bf16_gemms``);
    * the bandwidth: a 64 MiB copy;
    * the cast rate: a per-tensor E4M3 cast of the 1000 x 512 input with the layers' quantize backend
      (``nn.quantize_backend``), writing its values for the GEMM as the layers do; the dequantization rate:
      its codes decoded to FP32 (``gemm.codes.decode_codes``, what a GEMM on whole-row scales reads);
    * the emulated FP8 GEMM rate: what a per-tensor FP8 training step of the same layer spends beyond its
      casts, dequantization and calls (FP32 matmuls on exact values, scaled outputs), and the tile
      dequantization rate: what a 1 x 128 / 128 x 128 block step spends beyond the per-tensor model.

    1000 tokens: not a multiple of the tiles, as a step's shifted labels give. Bytes are counted as
    ``layer_seconds`` counts them (a cast reads 2 and writes 1 byte per element, a dequantization reads 1 and
    writes 2). No native FP8 GEMM."""
    from ..gemm.codes import decode_codes
    from ..nn.backend import quantize_backend
    from ..numerics.formats import E4M3
    from ..numerics.tensor import quantize

    tiny_bf16 = step_seconds(16, 16, "bf16")
    matmul_call = tiny_bf16 / 3
    cast_call = max(step_seconds(16, 16, "current") - tiny_bf16, 0.0) / 6
    tokens, side = 1000, 512
    g = Gemm(tokens, side, side)
    flops = 3 * 2 * tokens * side * side
    bf16 = flops / max(step_seconds(tokens, side, "bf16") - 3 * matmul_call, 1e-9)
    src = torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src))
    x = torch.randn(tokens, side)
    backend = quantize_backend()
    t = _best_seconds(lambda: quantize(x, E4M3, "tensor", backend=backend, values=torch.float32))
    cast = 3 * x.numel() / max(t - cast_call, t / 2)
    codes = quantize(x, E4M3, "tensor", backend=backend).data
    dequant = 3 * x.numel() / _best_seconds(lambda: decode_codes(codes, torch.float32))
    cpu = GPU(
        "cpu", bf16, bf16, bandwidth, (0, 0), emulated_flops=float("inf"), cast_bytes_per_s=cast,
        dequant_bytes_per_s=dequant, matmul_call_s=matmul_call, cast_call_s=cast_call,
    )  # fmt: skip
    step = step_seconds(tokens, side, "current")
    rest = layer_seconds([g], "current", cpu)  # everything but the matmuls' FLOPs
    emulated = flops / max(step - rest, step / 4)
    cpu = replace(cpu, fp8_flops=emulated, emulated_flops=emulated, tile_dequant_bytes_per_s=float("inf"))
    step = step_seconds(tokens, side, "block")
    tiles = _dequant_bytes(g) / max(step - layer_seconds([g], "block", cpu), step / 4)
    return replace(cpu, tile_dequant_bytes_per_s=tiles)
