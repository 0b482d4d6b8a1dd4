"""``QuantLinear``: an inference ``nn.Linear`` with 8-bit weights (real storage, not fake-quant).

Weights are held as ``float8_e4m3fn`` or ``int8`` codes with float32 dequant scales
(``weight_scale``: shape ``(1,)`` per tensor or ``(out, 1)`` per channel, ``amax / 448`` for E4M3 and
``amax / 127`` for INT8). Activations are quantized per tensor with a calibrated ``input_scale`` of
shape ``(1,)``, per token at run time, or not at all (weight-only). Weights and activations are
quantized by ``fp8kit.quantize``, the one quantizer that training and debug use too.

The GEMM runs on the exact codes and applies the scales to the high-precision accumulator. Which
kernel does it is chosen per call from the device, the scheme, the layer's shape and the input dtype
(``select_kernel``; the choice and its reason are logged once each on logger ``fp8kit.ptq``;
``QuantLinear.kernel`` forces one):

* CUDA: FP8 W8A8 through ``torch._scaled_mm`` (per-tensor scales, or per-token x per-channel
  scales with a bfloat16 output), INT8 W8A8 through ``torch._int_mm`` (int32 accumulation; ``M <= 16``
  is zero-padded), weight-only INT8 through a ``torch.compile``-generated dequant GEMM.
* CPU: INT8 W8A8 through ``torch._int_mm`` (exact int32 accumulation) when the one-time probe finds
  it faster than FP32; FP8 W8A8 and weight-only INT8 through a GEMM on a cached copy of the exact
  code values (bfloat16 for bfloat16 inputs on CPUs whose bfloat16 GEMM is faster, else float32).
  The cache costs 2 (or 4) bytes per weight beside the 8-bit buffer; CPU ``torch._scaled_mm`` on
  float8 and the per-call float8 -> float32 upcast were measured slower (``BENCHMARKS.md``).
* Anything else (odd shapes, other dtypes, a kernel that raised once): ``_forward_reference``, the
  FP32-upcast math every kernel is tested against.

Operands of at least ``COMPILE_MIN_ELEMENTS`` elements use compiled kernels around the GEMM: the
activation quantizer (``fp8kit.quantize(backend="compiled")``, bit-identical to eager) and one fused
scale-bias-cast loop. ``use_fast_accum`` on CUDA keeps the FP8 tensor cores' partial sums in reduced
precision between cuBLAS's FP32 promotions (the caveat DeepSeek-V3 reports for long K); inference
forward GEMMs only, and the CUDA tests hold it to the reference within ``2**-8`` of the product
magnitudes.

Equality with the reference (tests): INT8 x INT8 products summed in int32 are exact, so
``_int_mm``'s accumulator equals the reference accumulator bit for bit whenever the FP32 partial sums
stay below 2**24 and otherwise differs by FP32 summation order only; products of FP8 (and INT8) codes
are exact in FP32, so every path differs from the reference by accumulation order,
``|out - ref| <= 2 * gamma_{K+2} * (|codes_x| @ |codes_w|^T) * s_x * s_w`` with
``gamma_n = n * 2**-24 / (1 - n * 2**-24)`` (the ``+2`` covers the scale products, which weight-only
INT8 applies per weight in the reference and per output in the kernels), plus one FP32 rounding where
the compiled epilogue fuses a multiply-add, one rounding of the accumulator to bfloat16 where a
bfloat16 GEMM writes its output (bfloat16 inputs only) and, on CUDA with ``use_fast_accum``, the
tensor cores' reduced-precision partial sums.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..formats import Format
from ..scaling import dequant_scale
from ..tensor import quantize as fp8_quantize
from .schemes import Scheme, get_scheme

__all__ = ["KERNELS", "KernelChoice", "QuantLinear", "dequant_scale", "select_kernel"]

log = logging.getLogger("fp8kit.ptq")

KERNELS = ("reference", "scaled_mm", "scaled_mm_rowwise", "int_mm", "codes_mm", "dequant_mm_compiled")


@dataclass(frozen=True)
class KernelChoice:
    """The GEMM a ``QuantLinear`` call runs and why (``name`` is one of ``KERNELS``)."""

    name: str
    reason: str
    gemm_dtype: torch.dtype | None = None


@functools.cache
def _cpu_probe() -> dict[str, float]:
    """Seconds per GEMM at ``(64, 1024) x (1024, 1024)`` in float32, bfloat16 and ``_int_mm`` (best of 5),
    measured once per process on this CPU."""
    m, k, n = 64, 1024, 1024
    a, b = torch.randn(m, k), torch.randn(n, k)
    ab, bb = a.bfloat16(), b.bfloat16()
    ops = {"float32": (lambda: a @ b.t()), "bfloat16": (lambda: ab @ bb.t())}
    if hasattr(torch, "_int_mm"):
        ai, bi = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randint(-127, 128, (n, k), dtype=torch.int8)
        ops["int_mm"] = lambda: torch._int_mm(ai, bi.t())
    out: dict[str, float] = {}
    for name, fn in ops.items():
        try:
            fn()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out[name] = best
        except RuntimeError:
            out[name] = float("inf")
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "unknown"
    log.info(
        "fp8kit.ptq CPU probe (%s): float32 %.2f ms, bfloat16 %.2f ms, _int_mm %.2f ms per 64x1024x1024 GEMM",
        cap,
        out["float32"] * 1e3,
        out["bfloat16"] * 1e3,
        out.get("int_mm", float("inf")) * 1e3,
    )
    return out


_LOGGED: set[tuple[str, str]] = set()


def _log_choice(choice: KernelChoice, device: str) -> None:
    key = (device, choice.reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("fp8kit.ptq %s kernel %s: %s", device, choice.name, choice.reason)


def select_kernel(
    scheme: Scheme | str,
    device: torch.device | str,
    x_dtype: torch.dtype,
    in_features: int,
    out_features: int,
) -> KernelChoice:
    """The GEMM for one call: inputs of ``x_dtype`` into a ``(out_features, in_features)``
    layer of ``scheme`` on ``device``. Pure apart from the one-time CPU probe."""
    scheme = get_scheme(scheme)
    dev = torch.device(device).type
    k, n = in_features, out_features
    if dev == "cuda":
        if scheme.act_format is None:
            return KernelChoice("dequant_mm_compiled", "weight-only INT8: torch.compile dequant GEMM")
        if scheme.is_fp8:
            if not hasattr(torch, "_scaled_mm"):
                return KernelChoice("reference", "this torch has no torch._scaled_mm")
            if k % 16 or n % 16:
                return KernelChoice("reference", f"torch._scaled_mm needs K, N multiples of 16 (got {k}, {n})")
            per_row = scheme.act_strategy == "token" or scheme.weight_strategy == "channel"
            if not per_row:
                return KernelChoice("scaled_mm", "FP8 W8A8 per-tensor scales: torch._scaled_mm (fast accumulation)")
            if x_dtype != torch.bfloat16:
                return KernelChoice("reference", f"row-wise torch._scaled_mm writes bfloat16 only (input is {x_dtype})")
            return KernelChoice("scaled_mm_rowwise", "FP8 W8A8 per-token x per-channel: row-wise torch._scaled_mm")
        if not hasattr(torch, "_int_mm"):
            return KernelChoice("reference", "this torch has no torch._int_mm")
        if k % 8 or n % 8:
            return KernelChoice("reference", f"torch._int_mm needs K, N multiples of 8 (got {k}, {n})")
        return KernelChoice("int_mm", "INT8 W8A8: torch._int_mm, int32 accumulation (M <= 16 zero-padded)")
    if dev != "cpu":
        return KernelChoice("reference", f"no 8-bit kernel wired for device {dev!r}")
    probe = _cpu_probe()
    bf16 = x_dtype == torch.bfloat16 and probe["bfloat16"] < probe["float32"]
    gemm_dtype = torch.bfloat16 if bf16 else torch.float32
    what = "bfloat16 (faster than float32 on this CPU)" if bf16 else "float32"
    if scheme.act_format is not None and not scheme.is_fp8:
        if probe.get("int_mm", float("inf")) < probe["float32"]:
            return KernelChoice("int_mm", "INT8 W8A8: torch._int_mm (exact int32 accumulation, faster than float32)")
    if scheme.act_format is None:
        return KernelChoice("codes_mm", f"weight-only INT8: {what} GEMM on cached codes, scales after", gemm_dtype)
    return KernelChoice("codes_mm", f"{scheme.weight_format.name} W8A8: {what} GEMM on cached exact codes", gemm_dtype)


def _dequant_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x @ w.to(x.dtype).t()).float() * s


def _convert(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.to(dtype)


def _finish(
    acc: torch.Tensor, sx: torch.Tensor | None, ws: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``acc * sx * ws (+ bias)`` in float32, in the reference's order, returned in ``dtype``."""
    out = acc.float() * sx * ws if sx is not None else acc.float() * ws
    if bias is not None:
        out = out + bias
    return out.to(dtype)


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return (out.float() + bias if bias is not None else out).to(dtype)


COMPILE_MIN_ELEMENTS = 1 << 16  # smaller operands run eagerly: no compile time, no compiled-call overhead
_COMPILE = {"enabled": True}


@functools.cache
def _compiled(name: str):
    fn = {"dequant_mm": _dequant_mm, "convert": _convert, "finish": _finish}[name]
    return torch.compile(fn, dynamic=True)


def _run(name: str, *args):
    """``name``'s function compiled (one fused loop on CPU, one Triton kernel on CUDA) for large operands,
    eager otherwise; a compile failure is logged once and the eager function used from then on."""
    eager = {"dequant_mm": _dequant_mm, "convert": _convert, "finish": _finish}[name]
    if _COMPILE["enabled"] and args[0].numel() >= COMPILE_MIN_ELEMENTS and not torch.compiler.is_compiling():
        try:
            return _compiled(name)(*args)
        except Exception as err:  # no C++ compiler / Triton: same math, eagerly
            _COMPILE["enabled"] = False
            log.warning("fp8kit.ptq: torch.compile unavailable for the GEMM epilogue (%s); running eagerly", err)
    return eager(*args)


class QuantLinear(nn.Module):
    """Inference-only linear layer with 8-bit weights and optional 8-bit activations."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Scheme | str) -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        self.in_features, self.out_features = in_features, out_features
        per_channel = self.scheme.weight_strategy == "channel"
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=self.scheme.weight_format.dtype))
        self.register_buffer("weight_scale", torch.ones(out_features, 1) if per_channel else torch.ones(1))
        if self.scheme.static_activations:
            self.register_buffer("input_scale", torch.ones(1))
        else:
            self.input_scale = None
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.kernel: str | None = None  # set to a name in KERNELS to force a kernel (tests, benchmarks)
        self._cache: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._failed: set[str] = set()

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme | str, input_amax: float | None = None) -> QuantLinear:
        """Quantize ``linear``'s weight; ``input_amax`` sets the static activation scale (required for
        static schemes)."""
        scheme = get_scheme(scheme)
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        w = linear.weight.detach().float()
        if not torch.isfinite(w).all():
            raise ValueError("the weight holds NaN or inf; it cannot be quantized")
        gran = "row" if scheme.weight_strategy == "channel" else "tensor"
        qt = fp8_quantize(w, scheme.weight_format, gran)
        q.weight = qt.data.contiguous()
        q.weight_scale = dequant_scale(qt.amax, scheme.weight_format).reshape(q.weight_scale.shape).contiguous()
        if linear.bias is not None:
            q.bias = linear.bias.detach().float().clone()
        if scheme.static_activations:
            if input_amax is None:
                raise ValueError(f"scheme {scheme.name!r} needs a calibrated input amax (run a forward_loop)")
            q.input_scale = dequant_scale(torch.tensor([float(input_amax)]), scheme.act_format)
        return q

    def _apply(self, fn, *args, **kwargs):
        self._cache = None  # .to(device/dtype): drop the compute copy of the old weight
        return super()._apply(fn, *args, **kwargs)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with, ``codes * weight_scale``."""
        return (self.weight.float() * self.weight_scale.reshape(-1, 1)).to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of the stored weight codes and scales (the bias and the CPU compute cache not counted)."""
        return self.weight.numel() * self.weight.element_size() + self.weight_scale.numel() * 4

    # -- activations -------------------------------------------------------------------------------

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of a 2-D input ``(tokens, in_features)`` and their dequant scale: ``(1,)`` for a static
        per-tensor scale, ``(tokens, 1)`` per token. Through ``fp8kit.quantize``; NaN/inf propagate."""
        fmt: Format = self.scheme.act_format
        # compiled kernel (bit-identical to eager) for large inputs; row tiles keep one compiled graph per
        # in_features (a static scalar scale is broadcast to every row: the per-tensor codes exactly)
        backend = "compiled" if _COMPILE["enabled"] and x2.numel() >= COMPILE_MIN_ELEMENTS else "eager"
        if self.scheme.act_strategy == "tensor":
            mult = 1.0 / self.input_scale
            qt = fp8_quantize(x2, fmt, "row", scale=mult, nonfinite="propagate", check_scale=False, backend=backend)
            return qt.data, self.input_scale
        qt = fp8_quantize(x2, fmt, "row", nonfinite="propagate", backend=backend)
        return qt.data, qt.scale_inv

    # -- kernels -----------------------------------------------------------------------------------

    def _forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The FP32-upcast math every kernel is held to: exact code products, FP32 accumulation."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.scheme.act_format is None:  # weight-only
            out = x2.float() @ self.dequantized_weight().t()
        else:
            xq, sx = self.quantize_input(x2)
            acc = xq.float() @ self.weight.float().t()  # exact products, FP32 accumulation
            out = acc * sx.reshape(-1, 1) * self.weight_scale.reshape(1, -1)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _forward_straight_through(self, x: torch.Tensor) -> torch.Tensor:
        """The reference math, differentiable in ``x``: the forward value uses the quantized input, the
        gradient passes the activation quantizer straight through (the weights stay frozen). Used when
        ``x`` requires a gradient (e.g. norm tweaking); inference never takes this path."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.scheme.act_format is not None:
            with torch.no_grad():
                xq, sx = self.quantize_input(x2.detach())
                xd = (xq.float() * sx.reshape(-1, 1)).to(x2.dtype)
            x2 = x2 + (xd - x2).detach()
        out = x2.float() @ self.dequantized_weight().t()
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _codes(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's code values in ``dtype`` (exact), cached until the weight buffer changes."""
        w = self.weight  # the cache holds the weight itself, so its identity and version name it safely
        c = self._cache
        if c is None or c[0] is not w or c[1] != w._version or c[2].dtype != dtype:
            self._cache = c = (w, w._version, w.to(dtype))
        return c[2]

    def _gemm(self, name: str, x2: torch.Tensor, gemm_dtype: torch.dtype | None) -> torch.Tensor:
        """``x2 @ W^T`` (dequantized, bias added) with kernel ``name``, shape ``(M, out)``, in ``x2.dtype``."""
        ws, bias, dtype = self.weight_scale.reshape(1, -1), self.bias, x2.dtype
        if name == "dequant_mm_compiled":
            return _add_bias(_compiled("dequant_mm")(x2, self.weight, ws), bias, dtype)
        if name == "codes_mm" and self.scheme.act_format is None:
            return _run("finish", x2.to(gemm_dtype) @ self._codes(gemm_dtype).t(), None, ws, bias, dtype)
        xq, sx = self.quantize_input(x2)
        sx2 = sx.reshape(-1, 1)
        if name == "int_mm":
            m = xq.shape[0]
            pad = 32 - m if (m <= 16 and xq.is_cuda) else 0
            if pad:
                xq = torch.nn.functional.pad(xq, (0, 0, 0, pad))
            acc = torch._int_mm(xq, self.weight.t())
            return _run("finish", acc[:m] if pad else acc, sx2, ws, bias, dtype)
        if name == "codes_mm":
            acc = _run("convert", xq, gemm_dtype) @ self._codes(gemm_dtype).t()
            return _run("finish", acc, sx2, ws, bias, dtype)
        if name == "scaled_mm":
            out_dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
            out = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=sx.float().reshape(()),
                scale_b=self.weight_scale.float().reshape(()),
                out_dtype=out_dtype,
                use_fast_accum=True,
            )
        elif name == "scaled_mm_rowwise":
            m, n = xq.shape[0], self.out_features
            out = torch._scaled_mm(
                xq,
                self.weight.t(),
                scale_a=sx.float().reshape(-1, 1).expand(m, 1).contiguous(),
                scale_b=self.weight_scale.float().reshape(1, -1).expand(1, n).contiguous(),
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        else:
            raise ValueError(f"unknown QuantLinear kernel {name!r}; accepted: {', '.join(KERNELS)}")
        return _add_bias(out, bias, dtype)

    def kernel_for(self, x: torch.Tensor) -> KernelChoice:
        """The kernel ``forward(x)`` runs (``self.kernel`` forces one)."""
        if self.kernel is not None:
            if self.kernel not in KERNELS:
                raise ValueError(f"unknown QuantLinear kernel {self.kernel!r}; accepted: {', '.join(KERNELS)}")
            dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
            return KernelChoice(self.kernel, "forced by QuantLinear.kernel", dtype)
        choice = select_kernel(self.scheme, x.device, x.dtype, self.in_features, self.out_features)
        if choice.name in self._failed:
            return KernelChoice("reference", f"{choice.name} raised on this layer before")
        return choice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear expects inputs with last dim {self.in_features}, got {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            return self._forward_straight_through(x)
        choice = self.kernel_for(x)
        _log_choice(choice, x.device.type)
        if choice.name == "reference":
            return self._forward_reference(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        try:
            out = self._gemm(choice.name, x2, choice.gemm_dtype).reshape(*shape[:-1], self.out_features)
        except (RuntimeError, TypeError) as err:  # an unsupported GPU or shape: remember, say why, use the reference
            if self.kernel is not None:
                raise
            self._failed.add(choice.name)
            log.warning("fp8kit.ptq: kernel %s failed (%s); using the reference path", choice.name, err)
            return self._forward_reference(x)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"
