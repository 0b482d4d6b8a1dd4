"""Grouped FP8 GEMMs for Mixture-of-Experts layers: one GEMM per expert, launched as one grouped op.

The tokens routed to the experts are sorted by expert into one ``(P, K)`` matrix whose rows ``[offs[e-1],
offs[e])`` belong to expert ``e`` (``offs``: int32 cumulative row ends, as ``torch._grouped_mm`` takes;
rows past ``offs[-1]`` are padding and their outputs are undefined). Expert weights are one 3-D operand
``(E, N, K)``, quantized per expert (``fp8kit.numerics.grouped_tensor.GroupedWeight``: an expert's weight never
shares a scale with another expert's). Three GEMMs of the FP8 training experts:

* ``grouped_gemm(x, w, offs, group_ids)``: ``out[rows of e] = x[rows of e] @ w[e].T`` (forward, and the
  input gradient with ``w`` the transposed weights);
* ``grouped_gemm_wgrad(a, b, offs)``: ``out[e] = a[:, rows of e] @ b[:, rows of e].T``, the weight
  gradient, reducing over each expert's tokens. Its operands are quantized along the token dim, so
  their scales must not cover two experts: per-tensor scales span the layer (see ``nn.experts``),
  row-wise scales are per expert and column (``GroupColumns``), and 1x128 / MX 1x32 tiles are kept
  inside one expert by padding each expert's group of rows to a multiple of the tile (DeepGEMM's
  M-alignment; the padding rows are zeros).

CPU: exact emulation as ``fp8kit.gemm`` does it (the FP8 values are exact in float32 and bfloat16;
scales that do not vary along K are applied to the GEMM's result, tile scales by dequantizing the
operands first) with one grouped GEMM, ``torch._grouped_mm`` with offsets, behind the custom op
``fp8kit::grouped_mm`` (opaque to ``torch.compile``: inductor accepts only bfloat16 ``_grouped_mm``;
no ``.item()`` or Python loop over experts; torch without a CPU ``_grouped_mm`` (< 2.9) loops inside the
op). The GEMM dtype follows ``gemm.cpu_gemm_backend()`` (bfloat16 for bfloat16 outputs on CPUs with
native bf16, else float32).

CUDA: ``torch._scaled_grouped_mm`` on SM90 for per-tensor and row-wise scales (per-tensor scales
broadcast to rows): forward and input gradient as 2-D x 3-D grouped GEMMs (the weight read column-major
from its ``(E, N, K)`` storage), the weight gradient as 2-D x 2-D with one scale per expert and row, which
needs every expert's token group to start at a multiple of 16 rows (``SCALED_GROUPED_MM_ALIGN``; the
experts pad them, as torchao and torchtitan do). The kernel takes E4M3 operands only, so the hybrid
format's E5M2 gradients, block tiles, MXFP8, other GPUs and old torch run ``torch._grouped_mm`` on
dequantized bf16 operands (exact for power-of-two scales) and log the reason once per kind
(``grouped_gemm_fallbacks()``).

NVFP4 (E2M1 codes in 1x16 blocks or 16x16 weight tiles, E4M3 block scales under FP32 per-tensor scales, one
per expert for the weights): torch has no grouped NVFP4 GEMM (``torch._scaled_grouped_mm`` takes FP8
row-wise or MXFP8 operands), so CUDA always takes the logged fallback above. CPU dequantizes the operands
(``code * block_scale * tensor_scale`` in float32, as ``QuantizedTensor.dequantize``) and multiplies them in
an FP32 grouped GEMM: the dense NVFP4 GEMM's emulation (``gemm.fp8``), one expert group at a time.

``grouped_gemm_counts()`` counts the FP8 grouped GEMMs run in eager mode by kind (``"forward"``,
``"dgrad"``, ``"wgrad"``), and those on E2M1 operands also as ``"forward e2m1"``, ... : tests use it to
show that every expert GEMM ran in FP8 (or FP4).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import torch

from ..kernels import decode_fp8
from ..kernels.fused import scale_output, transpose_last
from ..kernels.opaque import dequantize_tiles_opaque
from ..numerics.formats import e2m1_decode
from ..numerics.grouped_tensor import GroupColumns, GroupedWeight
from ..numerics.tensor import QuantizedTensor
from .fp8 import cpu_gemm_dtype

__all__ = [
    "grouped_gemm",
    "grouped_gemm_counts",
    "grouped_gemm_fallbacks",
    "grouped_gemm_wgrad",
    "grouped_codes_dtype",
    "grouped_mm",
    "grouped_scaled_mm",
    "native_grouped_device",
    "scaled_grouped_mm_args",
    "scaled_grouped_mm_wgrad_args",
    "transpose_experts",
    "with_values",
    "with_weight_values",
]

log = logging.getLogger("fp8kit")
SCALED_GROUPED_MM_ALIGN = 16  # rows: torch._scaled_grouped_mm's FP8 rows start on 16-byte boundaries
_COUNTS: Counter[str] = Counter()
_FALLBACKS: dict[str, str] = {}


def grouped_gemm_counts() -> dict[str, int]:
    """FP8 grouped GEMMs run so far in this process (eager mode), by kind; those whose two operands are E2M1
    codes (NVFP4) also under ``"<kind> e2m1"``."""
    return dict(_COUNTS)


def grouped_gemm_fallbacks() -> dict[str, str]:
    """CUDA grouped GEMMs that ran on bf16 operands instead of ``torch._scaled_grouped_mm``, by GEMM and
    scaling (``"dgrad per-tensor"``, ``"wgrad row-wise"``, ...), with the reason."""
    return dict(_FALLBACKS)


def _count(kind: str, a: object, b: object) -> None:
    if not torch.compiler.is_compiling():
        _COUNTS[kind] += 1
        if getattr(a, "fmt", None) is not None and a.fmt.sub_byte and b.fmt.sub_byte:  # type: ignore[attr-defined]
            _COUNTS[f"{kind} {a.fmt.name}"] += 1  # type: ignore[attr-defined]


def _fallback(kind: str, reason: str) -> None:
    if kind not in _FALLBACKS:
        _FALLBACKS[kind] = reason
        log.warning("fp8kit: %s FP8 grouped GEMM falls back to dequantized bf16 operands: %s", kind, reason)


# ---- the plain grouped GEMM (an opaque custom op) ------------------------------------------------------


def _grouped_mm_impl(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is not None:
        try:
            return grouped(a, b, offs=offs)
        except (RuntimeError, NotImplementedError):
            pass  # no kernel for this device / dtype in this torch: the loop below
    ends = offs.tolist()  # one sync, inside the opaque op only
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # (P, K) x (E, K, N) -> (P, N)
        out = a.new_zeros(a.shape[0], b.shape[2])
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            if t > s:
                out[s:t] = a[s:t] @ b[e]
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])  # (N, P) x (P, K) -> (E, N, K)
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        if t > s:
            out[e] = a[:, s:t] @ b[s:t]
    return out


def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[2])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


_OP = torch.library.custom_op("fp8kit::grouped_mm", _grouped_mm_impl, mutates_args=())
_OP.register_fake(_grouped_mm_fake)


def _dequantize(q: QuantizedTensor | GroupedWeight, dtype: torch.dtype) -> torch.Tensor:
    """Tile-scaled operand as ``dtype`` values, in the op opaque to inductor ``fp8kit::dequantize_tiles``
    (``kernels.opaque``; inductor's CPU loop-split pass fails on the 1x128 dequantizations of one tensor
    in both orientations that a weight gradient has). E2M1 codes are decoded to their float32 values first."""
    codes = e2m1_decode(q.data) if q.fmt.sub_byte else q.data
    return dequantize_tiles_opaque(codes, q.scale_inv, q.block, dtype)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for any float dtype, traceable by ``torch.compile``.

    ``a`` ``(P, K)`` and ``b`` ``(E, K, N)`` give ``(P, N)``; ``a`` ``(N, P)`` and ``b`` ``(P, K)``
    give ``(E, N, K)`` (groups along P). Not differentiable (the FP8 layers call it in their forward and
    backward)."""
    return _OP(a, b, offs)


def grouped_codes_dtype(device: torch.device) -> torch.dtype:
    """The dtype of an inference grouped GEMM on 8-bit codes (``grouped_scaled_mm``): float32 on CPU (exact
    products of codes and of high-precision activations, FP32 accumulation), bfloat16 elsewhere
    (``torch._grouped_mm``'s dtype on CUDA)."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def grouped_scaled_mm(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    offs: torch.Tensor,
    group_ids: torch.Tensor,
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inference grouped GEMM on 8-bit codes: ``out[j] = (x[j] @ w[e_j].T) * x_scale * w_scale[e_j]``,
    float32, for rows ``x`` ``(S, K)`` sorted by expert (``offs`` the experts' row ends, ``group_ids`` the
    expert of each row): FP8 / INT8 codes with dequant multipliers ``x_scale`` ``(1,)`` or ``(S, 1)``, or
    high-precision activations (weight-only, ``x_scale=None``); ``w`` ``(E, N, K)`` codes with
    ``w_scale`` ``(E, 1, 1)`` (per expert) or ``(E, N, 1)`` (per expert and channel). One grouped GEMM in
    ``grouped_codes_dtype``, the scales applied to the accumulator."""
    gdt = grouped_codes_dtype(x.device)
    acc = grouped_mm(x.to(gdt), w.to(gdt).transpose(1, 2), offs)
    ws = w_scale.reshape(w.shape[0], -1)[group_ids]  # (S, 1) or (S, N)
    return acc.float() * ws if x_scale is None else acc.float() * x_scale.reshape(-1, 1) * ws


# ---- the GEMMs ---------------------------------------------------------------------------------------


def _row_scales(q: QuantizedTensor) -> torch.Tensor:
    s = q.scale_inv
    return s.reshape(1, 1) if s.numel() == 1 else s.reshape(-1, 1)


def _values(q: QuantizedTensor | GroupedWeight | GroupColumns, dtype: torch.dtype) -> torch.Tensor:
    """``q``'s unscaled FP8 values in ``dtype``: its ``values`` where kept, else decoded from its codes."""
    values = getattr(q, "values", None)
    return decode_fp8(q.data, q.fmt, dtype) if values is None else values.to(dtype)


def _values_t(q: QuantizedTensor | GroupColumns, dtype: torch.dtype) -> torch.Tensor:
    """``values(q).t()`` decoded in the codes' storage order (``q`` is a transposed view along the
    tokens): a compiled graph then decodes without a transposing gather."""
    values = getattr(q, "values", None)
    return decode_fp8(q.data.t(), q.fmt, dtype) if values is None else values.t().to(dtype)


def with_values(q: QuantizedTensor, out_dtype: torch.dtype) -> QuantizedTensor:
    """``q`` with its exact FP8 values decoded once (CPU, scales that factor out of the GEMM) for the
    GEMM dtype of ``out_dtype`` outputs, so that two GEMMs on one operand (an output gradient's input-
    and weight-gradient GEMMs) do not decode it twice; ``q`` itself elsewhere."""
    if q.values is not None or q.device.type == "cuda" or q.block[1] < q.shape[-1] or q.fmt.kind != "float":
        return q
    return dataclasses.replace(q, values=decode_fp8(q.data.view(torch.uint8), q.fmt, cpu_gemm_dtype(out_dtype)))


def transpose_experts(w: torch.Tensor) -> torch.Tensor:
    """``w.transpose(1, 2).contiguous()`` for ``w`` ``(E, R, C)``: the compiled tiled copy on CPU
    (``kernels.fused.transpose_last``)."""
    return transpose_last(w)


def with_weight_values(w: GroupedWeight, out_dtype: torch.dtype, *, power_of_two: bool = False) -> GroupedWeight:
    """``w`` with ``values`` computed (CPU) for the GEMM dtype of ``out_dtype`` outputs; ``w`` itself
    elsewhere. The same values the GEMMs would decode or dequantize from ``w`` on each call
    (``power_of_two``: as ``grouped_gemm``'s)."""
    if w.values is not None or w.device.type == "cuda" or w.fmt.kind != "float":
        return w
    if w.scales_factor_out:
        values = _values(w, cpu_gemm_dtype(out_dtype))
    else:
        values = _dequantize(w, _tile_gemm_dtype(out_dtype, power_of_two or w.is_mx))
    return dataclasses.replace(w, values=values)


def _weight_operand(w: GroupedWeight, dtype: torch.dtype, scaled: bool) -> torch.Tensor:
    """``w`` as its CPU GEMM reads it: dequantized (``scaled``) or its unscaled FP8 values, in ``dtype``
    and in the layout the decode would give (a dequantization is contiguous)."""
    if w.values is not None and w.values.dtype == dtype and scaled != w.scales_factor_out:
        if scaled and not w.values.is_contiguous():  # W^T's view of W's dequantization: copied contiguous
            return transpose_experts(w.values.transpose(1, 2))
        return w.values
    return _dequantize(w, dtype) if scaled else decode_fp8(w.data, w.fmt, dtype)


def _tile_gemm_dtype(out_dtype: torch.dtype, power_of_two: bool) -> torch.dtype:
    """The CPU GEMM dtype of tile-dequantized operands: the backend's where the scales are powers of two
    (an FP8 value times a power of two is exact in bf16), else float32 (a bf16 operand would round)."""
    return cpu_gemm_dtype(out_dtype) if power_of_two else torch.float32


def grouped_gemm(
    x: QuantizedTensor,
    w: GroupedWeight,
    offs: torch.Tensor,
    group_ids: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    kind: str = "forward",
    power_of_two: bool = False,
) -> torch.Tensor:
    """``out[rows of e] = dequant(x)[rows of e] @ dequant(w[e]).T`` for ``x`` ``(P, K)`` quantized along K,
    ``w`` ``(E, N, K)``; ``group_ids`` ``(P,)`` is each row's expert (padding rows: any valid id).
    ``power_of_two``: the tile scales are powers of two (the block recipe's default; MX always): CPU
    then multiplies tile-dequantized operands in the backend's bf16, else in float32 (exact operands)."""
    if not isinstance(x, QuantizedTensor) or not isinstance(w, GroupedWeight):
        raise TypeError("grouped_gemm takes FP8 operands (QuantizedTensor, GroupedWeight)")
    _count(kind, x, w)
    factor = x.block[1] >= x.shape[1] and w.scales_factor_out  # never for E2M1 (``scales_factor_out``)
    if x.device.type == "cuda":
        out = _try_scaled_grouped_mm(x, w, offs, out_dtype, kind)
        if out is None:
            xb, wb = x.dequantize(torch.bfloat16), w.dequantize(torch.bfloat16)
            out = grouped_mm(xb, wb.transpose(1, 2), offs)
        return out.to(out_dtype)
    gdt = cpu_gemm_dtype(out_dtype)
    if factor:
        acc = grouped_mm(_values(x, gdt), _weight_operand(w, gdt, False).transpose(1, 2), offs)
        # (acc * x's row scales * w[e]'s scales of each row's expert e), one loop: scale_output
        return scale_output(acc, _row_scales(x), w.row_scales(), group_ids, out_dtype)
    tdt = _tile_gemm_dtype(out_dtype, power_of_two or (x.granularity.is_mx and w.is_mx))
    return grouped_mm(_dequantize(x, tdt), _weight_operand(w, tdt, True).transpose(1, 2), offs).to(out_dtype)


def grouped_gemm_wgrad(
    a: QuantizedTensor | GroupColumns,
    b: QuantizedTensor | GroupColumns,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    power_of_two: bool = False,
    token_align: int = 1,
) -> torch.Tensor:
    """``out[e] = dequant(a)[:, rows of e] @ dequant(b)[:, rows of e].T`` for ``a`` ``(N, P)`` and ``b``
    ``(K, P)`` quantized along P (per tensor, per expert and row, or in tiles inside each expert);
    ``power_of_two`` as in ``grouped_gemm``; ``token_align``: every expert's group of rows starts at a
    multiple of it (CUDA's native kernel needs 16)."""
    _count("wgrad", a, b)
    cuda = a.device.type == "cuda"
    if cuda:
        out = _try_scaled_grouped_mm_wgrad(a, b, offs, out_dtype, token_align)
        if out is not None:
            return out
    gdt = torch.bfloat16 if cuda else cpu_gemm_dtype(out_dtype)
    if isinstance(a, GroupColumns) and isinstance(b, GroupColumns):
        acc = grouped_mm(_values(a, gdt), _values_t(b, gdt), offs)
        return scale_output(acc, a.scale_inv[:, :, None], b.scale_inv[:, None, :], None, out_dtype)
    if not isinstance(a, QuantizedTensor) or not isinstance(b, QuantizedTensor):
        raise TypeError("grouped_gemm_wgrad takes two QuantizedTensor or two GroupColumns operands")
    if a.scales.numel() == 1 and b.scales.numel() == 1:  # per-tensor: the scales factor out of every group
        acc = grouped_mm(_values(a, gdt), _values_t(b, gdt), offs)
        return scale_output(acc, (a.scale_inv * b.scale_inv).reshape(()), None, None, out_dtype)
    if not cuda:
        gdt = _tile_gemm_dtype(out_dtype, power_of_two or (a.granularity.is_mx and b.granularity.is_mx))
    return grouped_mm(_dequantize(a, gdt), _dequantize(b, gdt).t(), offs).to(out_dtype)


class _NotNative(Exception):
    """Why ``torch._scaled_grouped_mm`` cannot take these operands (the fallback's logged reason)."""


def native_grouped_device(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm``'s row-wise FP8 kernel exists for ``device``: CUDA SM90 and a
    torch that has the op (its SM100 kernels take MXFP8 only; ROCm wants ``float8_e4m3fnuz`` operands)."""
    if device.type != "cuda" or getattr(torch, "_scaled_grouped_mm", None) is None or not torch.cuda.is_available():
        return False
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def _e4m3_codes(*codes: torch.Tensor) -> None:
    for c in codes:
        if c.dtype != torch.float8_e4m3fn:
            raise _NotNative(
                f"torch._scaled_grouped_mm takes E4M3 operands only, got {c.dtype} (the hybrid format's E5M2 "
                "gradients; fp8_format='e4m3' keeps every GEMM native)"
            )


def _multiples_of_16(**dims: int) -> None:
    bad = {k: v for k, v in dims.items() if v % SCALED_GROUPED_MM_ALIGN}
    if bad:
        raise _NotNative(f"{', '.join(f'{k}={v}' for k, v in bad.items())} not multiples of 16 (16-byte FP8 rows)")


def _row_scale_vector(q: QuantizedTensor | GroupColumns, rows: int) -> torch.Tensor:
    """``q``'s dequantization scales as the float32 vector of ``rows`` entries the kernel reads (a
    per-tensor scale broadcast; row-wise and per-expert-and-row scales as stored, expert-major)."""
    s = q.scale_inv.float().reshape(-1)
    return (s.expand(rows) if s.numel() == 1 else s).contiguous()


def scaled_grouped_mm_args(
    x: QuantizedTensor, w: GroupedWeight
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat_a, mat_b, scale_a, scale_b)`` of ``torch._scaled_grouped_mm`` (2-D x 3-D, groups along the
    rows of ``x``) for ``grouped_gemm``'s operands: ``x`` codes ``(P, K)`` row-major with per-row (or
    per-tensor) scales, ``w`` codes as ``(E, K, N)`` column-major (``w``'s own ``(E, N, K)`` storage) with
    per-expert, per-output-column scales. Raises ``_NotNative`` where the kernel cannot take them."""
    _no_fp4(x)
    if x.block[1] < x.shape[1] or not w.scales_factor_out:
        raise _NotNative("tile-scaled operands (the kernel takes row-wise scales only)")
    a, b = x.data, w.data
    _e4m3_codes(a, b)
    p, k = a.shape
    e, n, _ = b.shape
    _multiples_of_16(K=k, N=n)
    return (
        a.contiguous(),
        b.contiguous().transpose(1, 2),
        _row_scale_vector(x, p),
        w.row_scales().float().expand(e, n).contiguous(),
    )


def scaled_grouped_mm_wgrad_args(
    a: QuantizedTensor | GroupColumns, b: QuantizedTensor | GroupColumns, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mat_a, mat_b, scale_a, scale_b)`` of ``torch._scaled_grouped_mm`` (2-D x 2-D, groups along the
    token dim P) for ``grouped_gemm_wgrad``'s operands ``a`` ``(N, P)`` and ``b`` ``(K, P)``, each per
    tensor or per expert and row (``GroupColumns``): ``a`` row-major, ``b.T`` ``(P, K)`` column-major,
    scales ``(E * N,)`` and ``(E * K,)`` expert-major. Raises ``_NotNative`` where the kernel cannot take them."""
    for q in (a, b):
        _no_fp4(q)
        if isinstance(q, QuantizedTensor) and q.scales.numel() != 1:
            raise _NotNative("tile-scaled operands (the kernel takes per-expert row scales only)")
    ca, cb = a.data, b.data
    _e4m3_codes(ca, cb)
    (n, p), (k, _) = ca.shape, cb.shape
    _multiples_of_16(N=n, K=k, P=p)
    return (
        ca.contiguous(),
        cb.contiguous().t(),
        _row_scale_vector(a, num_groups * n),
        _row_scale_vector(b, num_groups * k),
    )


_NO_GROUPED_FP4 = "torch has no grouped NVFP4 GEMM (torch._scaled_grouped_mm takes FP8 row-wise or MXFP8 operands)"


def _no_fp4(q: QuantizedTensor | GroupColumns) -> None:
    if q.fmt.sub_byte:
        raise _NotNative(_NO_GROUPED_FP4)


def _scaling_label(q: QuantizedTensor | GroupColumns) -> str:
    """How ``q`` is scaled, for the fallback log: ``per-tensor``, ``row-wise``, ``nvfp4`` or its tile."""
    if isinstance(q, QuantizedTensor) and q.granularity.is_nvfp4:
        return "nvfp4"
    if isinstance(q, GroupColumns) or q.block[1] >= q.shape[-1] and q.scales.numel() > 1:
        return "row-wise"
    return "per-tensor" if q.scales.numel() == 1 else f"{q.block[0]}x{q.block[1]} tiles"


def _run_native(kind: str, device: torch.device, build_args, out_dtype: torch.dtype, **kw) -> torch.Tensor | None:
    """``torch._scaled_grouped_mm(*build_args(), out_dtype=bf16, **kw)`` as ``out_dtype``; None, with the
    reason logged once under ``kind``, where the device, the operands (``_NotNative``) or the op refuse."""
    if not native_grouped_device(device):
        _fallback(kind, "torch._scaled_grouped_mm row-wise needs CUDA SM90 and a torch that has it")
        return None
    try:
        out = torch._scaled_grouped_mm(*build_args(), out_dtype=torch.bfloat16, **kw)
    except _NotNative as why:
        _fallback(kind, str(why))
        return None
    except (RuntimeError, TypeError, ValueError) as err:
        _fallback(kind, f"torch._scaled_grouped_mm refused: {err}")
        return None
    return out.to(out_dtype)


def _try_scaled_grouped_mm(
    x: QuantizedTensor, w: GroupedWeight, offs: torch.Tensor, out_dtype: torch.dtype, kind: str
) -> torch.Tensor | None:
    """Row-wise ``torch._scaled_grouped_mm`` (SM90) of ``grouped_gemm``'s operands (per-tensor scales
    broadcast to rows), bf16 output, fast accumulation in the forward GEMM only (as the dense layers);
    None (reason logged) where it cannot run."""
    label = f"{kind} {_scaling_label(x)}"
    if x.fmt.sub_byte:  # whatever the GPU
        _fallback(label, _NO_GROUPED_FP4)
        return None
    return _run_native(
        label, x.device, lambda: scaled_grouped_mm_args(x, w), out_dtype, offs=offs, use_fast_accum=kind == "forward"
    )


def _try_scaled_grouped_mm_wgrad(
    a: QuantizedTensor | GroupColumns,
    b: QuantizedTensor | GroupColumns,
    offs: torch.Tensor,
    out_dtype: torch.dtype,
    token_align: int,
) -> torch.Tensor | None:
    """``grouped_gemm_wgrad`` on ``torch._scaled_grouped_mm`` (2-D x 2-D, SM90); None (reason logged) where
    it cannot run. Every expert's token group must start at a multiple of 16 rows (``token_align``)."""

    def build_args():
        if token_align % SCALED_GROUPED_MM_ALIGN:
            raise _NotNative(f"token groups padded to {token_align} rows, not to a multiple of 16")
        return scaled_grouped_mm_wgrad_args(a, b, offs.numel())

    if a.fmt.sub_byte:  # whatever the GPU
        _fallback(f"wgrad {_scaling_label(a)}", _NO_GROUPED_FP4)
        return None
    return _run_native(f"wgrad {_scaling_label(a)}", a.device, build_args, out_dtype, offs=offs)
