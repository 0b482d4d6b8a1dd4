"""The training GEMM on ``QuantizedTensor`` operands: ``C = dequant(a) @ dequant(b).T`` with FP32 accumulation.

Both operands are ``QuantizedTensor`` s quantized along their last dim, the reduction dim ``K``:
``a`` is ``(M, K)``, ``b`` is ``(N, K)``.

CPU: exact emulation. Every E4M3/E5M2 value is exactly representable in float32 (and bfloat16), and
the product of two such values has at most 8 significant bits, so an FP32 GEMM over the upcast FP8
values forms every product exactly and accumulates in FP32, as an FP8 tensor core with FP32
accumulation does (up to summation order). FP32 is used rather than bfloat16 because CPUs without
native bfloat16 (AVX2) run bfloat16 GEMMs tens of times slower; the result is the same.

* Per-tensor and per-row scales do not vary along ``K``: the GEMM runs on the raw FP8 values and the
  scales are applied to the FP32 result (``acc * sa[:, None] * sb[None, :]``).
* Block and MX scales vary along ``K``: each operand is dequantized tile by tile first (exact when the
  scales are powers of two, as MX and the default block recipe use) and then multiplied.

CPU backend: chosen once per process from the CPU's features and logged (``gemm.probe``:
``cpu_gemm_backend()``, ``set_cpu_gemm_backend()``): on CPUs with native bfloat16 (AVX512-BF16, AMX) GEMMs with bfloat16
outputs run as bf16 GEMMs on the exact FP8 values (FP32 accumulation inside oneDNN); elsewhere, and
for FP32 outputs, the FP32 upcast above. The operands reach the GEMM as exact values without a
table gather: inside compiled graphs the quantizer computes them beside the cast
(``QuantizedTensor.values``, ``kernels.cast_values``); saved codes, and eager mode, decode in a compiled
loop (``gemm.codes.decode_codes``) with the FP8 conversion ``kernels.fused.cpu_cast_kernel`` picks.

CUDA: one native FP8 GEMM per recipe, with the scales applied inside the kernel:

* per tensor and per row: ``torch._scaled_mm`` (cuBLASLt), ``use_fast_accum`` allowed (forward GEMM);
* DeepSeek-V3 blocks (1x128 activations/gradients, 128x128 weights):
  ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` / ``BlockWise128x128`` (torch
  >= 2.10, SM90, cuBLASLt >= 12.9): no dequantization to bf16 on Hopper. Fast accumulation is never
  used here: Hopper's FP8 tensor cores keep about 14 bits between promotions to FP32, and DeepSeek-V3
  promotes every 128 elements of K precisely to avoid that error; block scaling exists for accuracy;
* MXFP8 (1x32 blocks, E8M0 scales): ``ScalingType.BlockWise1x32`` (Blackwell, SM100);
* NVFP4 (E2M1 codes, 1x16 E4M3 block scales or 16x16 weight tiles, FP32 per-tensor scales):
  ``torch._scaled_mm`` on packed ``float4_e2m1fn_x2`` operands with swizzled block scales (Blackwell, SM100),
  the per-tensor scales applied to the result.

CPU, NVFP4: the operands are dequantized (``code * block_scale * global_scale`` in float32) and multiplied
in an FP32 GEMM: the emulation exact to the format (its products are not exact in bf16).

Where the native GEMM is unavailable (older torch, an unsupported GPU or shape) the product falls back
to dequantized bf16 operands (exact for power-of-two scales), and the reason is logged once per kind.
"""

from __future__ import annotations

import logging

import torch

from ..kernels.opaque import repeat_tiles
from ..numerics.tensor import QuantizedTensor
from .codes import decode_codes
from .probe import cpu_gemm_backend

__all__ = ["cpu_gemm_dtype", "fp8_gemm", "gemm_values_dtype", "native_gemm_fallbacks", "scales_factor_out"]


def cpu_gemm_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a CPU GEMM on exact FP8 values with ``out_dtype`` outputs: bfloat16 for bfloat16
    outputs on the bf16 backend (``probe.cpu_gemm_backend``), else float32."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 and cpu_gemm_backend() == "bf16" else torch.float32


def gemm_values_dtype(x: torch.Tensor, out_dtype: torch.dtype) -> torch.dtype | None:
    """``quantize(values=...)`` for an operand ``x`` of a GEMM with ``out_dtype`` outputs: the CPU GEMM
    dtype (the quantize kernel then writes the operand beside the codes), None off CPU (native FP8)."""
    return cpu_gemm_dtype(out_dtype) if x.device.type == "cpu" else None


log = logging.getLogger("fp8kit")
_FALLBACKS: dict[str, str] = {}  # kind -> reason the native CUDA GEMM was not used (logged once)


def native_gemm_fallbacks() -> dict[str, str]:
    """Kinds of CUDA GEMM that fell back to the dequantize path in this process, with the reason."""
    return dict(_FALLBACKS)


def _fallback(kind: str, reason: str) -> None:
    if kind not in _FALLBACKS:
        _FALLBACKS[kind] = reason
        log.warning("fp8kit: %s FP8 GEMM falls back to dequantized bf16 operands: %s", kind, reason)


def scales_factor_out(q: QuantizedTensor) -> bool:
    """True when every scale of ``q`` covers a whole row (per tensor or per row)."""
    return q.block[1] >= q.shape[-1]


def _row_scales(q: QuantizedTensor) -> torch.Tensor:
    """Per-row dequant multipliers as ``(rows, 1)`` or ``(1, 1)`` float32 (tiles of several rows expand)."""
    s = q.scale_inv
    if s.numel() == 1:
        return s.reshape(1, 1)
    rows = q.shape[0]
    return repeat_tiles(s.reshape(-1, 1), q.block[0], 0, rows)


def _try_scaled_mm(
    a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype, use_fast_accum: bool = False
) -> torch.Tensor | None:
    if not hasattr(torch, "_scaled_mm"):
        _fallback("per-tensor/row-wise", "this torch has no torch._scaled_mm")
        return None
    m, k = a.data.shape
    n = b.data.shape[0]
    if k % 16 or n % 16:
        _fallback("per-tensor/row-wise", f"K={k}, N={n} are not multiples of 16")
        return None
    sa, sb = _row_scales(a), _row_scales(b)
    rowwise = sa.numel() > 1 or sb.numel() > 1
    if rowwise:
        sa = sa.expand(m, 1).contiguous()
        sb = sb.reshape(1, -1).expand(1, n).contiguous()
        dtype = torch.bfloat16
    else:
        sa, sb = sa.reshape(()), sb.reshape(())
        dtype = out_dtype
    try:
        out = torch._scaled_mm(
            a.data.contiguous(),
            b.data.contiguous().t(),
            scale_a=sa,
            scale_b=sb,
            out_dtype=dtype,
            use_fast_accum=use_fast_accum,
        )
    except (RuntimeError, TypeError) as err:
        _fallback("per-tensor/row-wise", f"torch._scaled_mm refused: {err}")
        return None
    return out.to(out_dtype)


def _scaling_type(q: QuantizedTensor) -> str | None:
    """The ``ScalingType`` name that describes ``q``'s tiles along K, or None."""
    br, bc = q.block
    if q.granularity.is_mx and (br, bc) == (1, 32):
        return "BlockWise1x32"
    if (br, bc) == (1, 128):
        return "BlockWise1x128"
    if (br, bc) == (128, 128):
        return "BlockWise128x128"
    return None


def _block_scales(q: QuantizedTensor, kind: str) -> torch.Tensor:
    """``q``'s scales laid out as ``scaled_mm`` reads them for the operand in ``(rows, K)`` form.

    1x128: ``(rows, K/128)`` float32, outer-dim-major (column-major) strides; 128x128: ``(rows/128,
    K/128)`` float32; 1x32 (MX): E8M0 codes as ``float8_e8m0fnu``."""
    if kind == "BlockWise1x32":
        return q.scales.contiguous().view(torch.float8_e8m0fnu)
    s = q.scale_inv.float()
    if kind == "BlockWise1x128":
        return s.t().contiguous().t()
    return s.contiguous()


def _try_block_scaled_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """Native block-scaled GEMM through ``torch.nn.functional.scaled_mm`` (no dequantization).

    The scale layout for ``mat_b`` is checked once per process and kind against the dequantized
    product (the first call computes both): a layout the kernel reads differently than fp8kit writes
    it falls back with a logged reason instead of giving wrong results."""
    kind_a, kind_b = _scaling_type(a), _scaling_type(b)
    label = f"{kind_a or a.block}x{kind_b or b.block}"
    if label in _FALLBACKS:
        return None
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    scaling_type = getattr(torch.nn.functional, "ScalingType", None)
    if scaled_mm is None or scaling_type is None:
        _fallback(label, "this torch has no torch.nn.functional.scaled_mm (needs torch >= 2.10)")
        return None
    if kind_a is None or kind_b is None:
        _fallback(label, "tile shapes other than 1x128, 128x128 and MX 1x32 have no native GEMM")
        return None
    major = torch.cuda.get_device_capability(a.data.device)[0]
    if kind_a == "BlockWise1x32" and major < 10:
        _fallback(label, f"MXFP8 GEMMs need Blackwell (SM100); this GPU is SM{major}x")
        return None
    if kind_a != "BlockWise1x32" and major != 9:
        _fallback(label, f"1x128/128x128 block-scaled GEMMs need Hopper (SM90); this GPU is SM{major}x")
        return None
    k = a.data.shape[1]
    if kind_a != "BlockWise1x32" and (k % 128 or (k // 128) % 4):
        # pytorch PR 166752: some releases gave wrong results when (K/128) % 4 != 0
        return None
    swizzle = getattr(torch.nn.functional, "SwizzleType", None)
    kw = {}
    if kind_a == "BlockWise1x32" and swizzle is not None:
        kw = {"swizzle_a": swizzle.SWIZZLE_32_4_4, "swizzle_b": swizzle.SWIZZLE_32_4_4}
    sa, sb = _block_scales(a, kind_a), _block_scales(b, kind_b)
    layouts = [_LAYOUTS[label]] if label in _LAYOUTS else ["as-is", "transposed"]
    errors = []
    for layout in layouts:
        try:
            out = scaled_mm(
                a.data.contiguous(),
                b.data.contiguous().t(),
                sa,
                getattr(scaling_type, kind_a),
                sb if layout == "as-is" else sb.t(),
                getattr(scaling_type, kind_b),
                output_dtype=out_dtype if out_dtype in (torch.bfloat16, torch.float32) else torch.bfloat16,
                **kw,
            )
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
            errors.append(f"{layout}: {err}")
            continue
        if label not in _LAYOUTS:  # first call: hold the native result against the dequantized product
            rel = _relative_error(out, a, b)
            if rel > 2**-6:
                errors.append(f"{layout}: relative error {rel:.3g} against the dequantized product")
                continue
            _LAYOUTS[label] = layout
            log.info("fp8kit: native %s FP8 GEMM in use (scale layout %s)", label, layout)
        return out.to(out_dtype)
    _fallback(label, "scaled_mm refused or disagreed: " + "; ".join(errors))
    return None


_LAYOUTS: dict[str, str] = {}  # kind pair -> mat_b scale layout checked on the first call


def _swizzled_scales(q: QuantizedTensor) -> torch.Tensor:
    """``q``'s E4M3 block scales, one per 1x16 block of its rows (16x16 tiles repeat over their rows), in
    cuBLAS's 128x4 swizzled layout (the layout ``torch._scaled_mm`` reads for NVFP4), flattened."""
    s = q.scales
    if q.block[0] > 1:
        s = repeat_tiles(s, q.block[0], 0, q.shape[0])
    rows, cols = s.shape
    padded = torch.zeros(-(-rows // 128) * 128, -(-cols // 4) * 4, dtype=s.dtype, device=s.device)
    padded[:rows, :cols] = s
    blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 4, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _try_nvfp4_mm(a: QuantizedTensor, b: QuantizedTensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """Native NVFP4 GEMM through ``torch._scaled_mm`` (packed E2M1 operands, swizzled E4M3 block scales, the
    two per-tensor scales applied to the result) on Blackwell (SM100+), held once against the dequantized
    product; else None with the reason logged (the caller dequantizes)."""
    label = "nvfp4"
    if label in _FALLBACKS:
        return None
    if not (a.granularity.is_nvfp4 and b.granularity.is_nvfp4) or a.block[1] != 16 or b.block[1] != 16:
        _fallback(label, "only NVFP4 operands blocked along K have a native FP4 GEMM (MXFP4 is not wired)")
        return None
    major = torch.cuda.get_device_capability(a.data.device)[0]
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if major < 10 or fp4 is None:
        why = f"this GPU is SM{major}x" if fp4 is not None else "this torch has no float4_e2m1fn_x2"
        _fallback(label, f"NVFP4 GEMMs need Blackwell (SM100) and torch's FP4 dtype: {why}")
        return None

    def packed(q: QuantizedTensor) -> torch.Tensor:
        c = q.data.contiguous()
        return (c[:, ::2] | (c[:, 1::2] << 4)).view(fp4)

    try:
        out = torch._scaled_mm(
            packed(a),
            packed(b).t(),
            _swizzled_scales(a).view(torch.float8_e4m3fn),
            _swizzled_scales(b).view(torch.float8_e4m3fn),
            out_dtype=torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32,
        )
    except (RuntimeError, TypeError, ValueError, NotImplementedError) as err:
        _fallback(label, f"torch._scaled_mm refused NVFP4 operands: {err}")
        return None
    out = out.float() * (a.global_scale * b.global_scale)
    if label not in _LAYOUTS:
        rel = _relative_error(out, a, b)
        if rel > 2**-6:
            _fallback(label, f"torch._scaled_mm disagreed with the dequantized product (relative error {rel:.3g})")
            return None
        _LAYOUTS[label] = "swizzled"
        log.info("fp8kit: native NVFP4 GEMM in use (torch._scaled_mm)")
    return out.to(out_dtype)


def _relative_error(out: torch.Tensor, a: QuantizedTensor, b: QuantizedTensor) -> float:
    """Frobenius relative error of a native GEMM result against the dequantized bf16 product (once per
    kind and process, outside graphs: it reads the device)."""

    def measure() -> float:
        ref = torch.matmul(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16).t()).float()
        return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))

    return torch.compiler.disable(measure)()


def _decode(q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 (or INT8) codes as ``dtype`` values, exactly: the values the quantizer computed beside the
    cast where it did (compiled CPU graphs), else ``decode_codes`` (a vectorized decode compiled on
    its own in eager mode, fused into the graph when compiling)."""
    if q.values is not None:
        return q.values.to(dtype)
    return decode_codes(q.data, dtype)


def fp8_gemm(
    a: QuantizedTensor,
    b: QuantizedTensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    use_fast_accum: bool = False,
    power_of_two: bool = False,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T`` for ``a`` ``(M, K)`` and ``b`` ``(N, K)``; result in ``out_dtype``.

    ``use_fast_accum``: let Hopper's FP8 tensor cores skip the periodic FP32 promotion (per-tensor and
    row-wise GEMMs on CUDA only; torchao and Transformer Engine use it for the forward GEMM).
    ``power_of_two``: the operands' scales are powers of two (the block recipe's default; MX scales
    always are): a CPU bf16 GEMM then reads the tile-dequantized operands in bf16, where they are exact
    (an FP8 value times a power of two, above bf16's subnormal range), instead of an FP32 GEMM."""
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"fp8_gemm needs a (M, K) and b (N, K) with the same K; got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    # FP4 codes are never multiplied raw: their scales enter before the GEMM (NVFP4's two levels)
    factor = scales_factor_out(a) and scales_factor_out(b) and not (a.fmt.sub_byte or b.fmt.sub_byte)
    if a.device.type == "cuda":
        if a.fmt.sub_byte:
            out = _try_nvfp4_mm(a, b, out_dtype)
        elif factor:
            out = _try_scaled_mm(a, b, out_dtype, use_fast_accum)
        else:
            out = _try_block_scaled_mm(a, b, out_dtype)
        if out is not None:
            return out
        acc = torch.matmul(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16).t()).float()
        return acc.to(out_dtype)
    gemm_dtype = cpu_gemm_dtype(out_dtype)
    if factor:
        acc = torch.matmul(_decode(a, gemm_dtype), _decode(b, gemm_dtype).t())
        sa, sb = _row_scales(a), _row_scales(b).reshape(1, -1)
        if gemm_dtype == torch.bfloat16:
            # bf16 GEMM: the sum is rounded to bf16 once in the GEMM and once more after the scales
            # (within one bf16 rounding of the tensor core's result; exact for power-of-two scales)
            if sa.numel() == 1 and sb.numel() == 1:
                return acc.mul((sa * sb).reshape(())).to(out_dtype)  # one pass, fp32 math, bf16 out
            return (acc.float() * sa * sb).to(out_dtype)
        acc = acc * sa * sb
    elif gemm_dtype == torch.bfloat16 and (power_of_two or (a.granularity.is_mx and b.granularity.is_mx)):
        # power-of-two scales: the dequantized operands are exact in bf16
        acc = torch.matmul(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16).t())
    else:
        acc = torch.matmul(a.dequantize(torch.float32), b.dequantize(torch.float32).t())
    return acc.to(out_dtype)
