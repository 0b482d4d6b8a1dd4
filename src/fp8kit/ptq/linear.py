"""``QuantLinear``: an inference ``nn.Linear`` with 8-bit or 4-bit weights (real storage, not fake-quant).

FP4 weight-only schemes (``nvfp4-weight-only``, ``mxfp4-weight-only``) hold the E2M1 codes packed two per
byte (``weight``, ``(out, in / 2)`` uint8, ``state_dict.pack_fp4``), their block scales (``weight_scale``:
``(out, in / 16)`` float8_e4m3fn for NVFP4, ``(out, in / 32)`` E8M0 uint8 codes for MXFP4) and NVFP4's
per-tensor dequant multiplier ``weight_scale_2`` (``amax / 2688``, ModelOpt's name and convention), from
``fp8kit.quantize(w, "e2m1", "nvfp4" | "mxfp4")``. Their GEMM is the floor's ``block_scaled_mm``: the
exact float32 dequantized weight (``codes * block scale (* weight_scale_2)``; lean: decoded in tiles of
whole rows inside the GEMM; ``weight_cache="cached"``: kept) with FP32 accumulation; ``_forward_reference``
computes the same. The ``nvfp4`` scheme (W4A4) also quantizes the input to NVFP4: 1x16 E4M3 block scales
at run time under the static per-tensor ``input_scale`` (``amax / 2688`` of the calibrated amax, ModelOpt's
convention), ``fp8kit.quantize(x, "e2m1", "nvfp4", global_scale=input_scale)``; the GEMM takes the exact
dequantized input (the emulation of the NVFP4 tensor-core GEMM up to FP32 summation order).

Weights are held as ``float8_e4m3fn`` or ``int8`` codes with float32 dequant scales
(``weight_scale``: shape ``(1,)`` per tensor or ``(out, 1)`` per channel, ``amax / 448`` for E4M3 and
``amax / 127`` for INT8). Activations are quantized per tensor with a calibrated ``input_scale`` of
shape ``(1,)``, per token at run time, or not at all (weight-only). Weights and activations are
quantized by ``fp8kit.quantize``, the one quantizer that training and debug use too.

The GEMM runs on the exact codes and applies the scales to the high-precision accumulator, through
fp8kit's one GEMM floor (``fp8kit.gemm.scaled``: ``choose_kernel`` picks the kernel per call from the
device, the scheme, the layer's shape, the input dtype and the one CPU feature probe; the choice and
its reason are logged once each on logger ``fp8kit.ptq``; ``QuantLinear.kernel`` forces one). On CUDA
``torch._scaled_mm`` (FP8), ``torch._int_mm`` (INT8), a compiled dequant GEMM (weight-only); on CPU
``torch._int_mm`` for INT8 W8A8 on CPUs with VNNI/AMX, else a bfloat16 (AVX512-BF16/AMX, bfloat16
inputs) or float32 GEMM on the exact code values; ``_forward_reference`` (FP32 upcast) for anything
else and as the oracle every kernel is tested against.

Weight memory on CPU (``weight_cache``): ``"lean"`` (default) keeps only the 8-bit codes and scales
resident, about 1 byte per weight, and decodes the weight tile by tile inside each GEMM (at most
``fp8kit.gemm.TILE_ELEMENTS`` weights at a time); ``"cached"`` keeps a decoded copy of the codes
beside them (+2 bytes per weight in bfloat16, +4 in float32) and saves the decode on every call, the
faster choice for small batches where memory allows (``BENCHMARKS.md``). INT8 W8A8 on ``torch._int_mm``
and every CUDA kernel read the codes directly and never cache. ``set_weight_cache(model, mode)`` sets
every layer of a model; ``resident_bytes(module)`` counts what a module holds. Lean and cached feed
the same exact values to the same GEMM, each output element one dot product over all of K, so they
can differ only where the BLAS sums a narrower N in another order (bit-identical in every case checked
on AVX-512 oneDNN/MKL); the tests assert bit-identity where any order is exact, the bound below otherwise.

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

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from ..gemm.scaled import KERNELS, KernelChoice, block_scaled_mm, choose_kernel, scaled_mm, use_compiled
from ..numerics.formats import E2M1, Format
from ..numerics.scaling import NVFP4_TENSOR_MAX, dequant_scale, nvfp4_tensor_scale, parse_granularity
from ..numerics.state_dict import pack_fp4, unpack_fp4
from ..numerics.tensor import QuantizedTensor
from ..numerics.tensor import quantize as fp8_quantize
from .schemes import Scheme, get_scheme

__all__ = [
    "KERNELS",
    "WEIGHT_CACHE_MODES",
    "KernelChoice",
    "QuantLinear",
    "dequant_scale",
    "holding_dequantized_weights",
    "resident_bytes",
    "select_kernel",
    "set_weight_cache",
]

log = logging.getLogger("fp8kit.ptq")

WEIGHT_CACHE_MODES = ("lean", "cached")
_LOGGED: set[tuple[str, str]] = set()


def _log_choice(choice: KernelChoice, device: str) -> None:
    key = (device, choice.reason)
    if key not in _LOGGED and not torch.compiler.is_compiling():  # logged by the first eager call
        _LOGGED.add(key)
        log.info("fp8kit.ptq %s kernel %s: %s", device, choice.name, choice.reason)


def select_kernel(
    scheme: Scheme | str,
    device: torch.device | str,
    x_dtype: torch.dtype,
    in_features: int,
    out_features: int,
) -> KernelChoice:
    """The GEMM for one call: inputs of ``x_dtype`` into a ``(out_features, in_features)`` layer of
    ``scheme`` on ``device`` (``fp8kit.gemm.choose_kernel`` for the scheme's formats and strategies)."""
    scheme = get_scheme(scheme)
    if scheme.is_fp4:
        raise ValueError(
            f"{scheme.name} layers run gemm.scaled.block_scaled_mm (or the reference); no kernel to select"
        )
    return choose_kernel(
        scheme.weight_format.dtype,
        scheme.weight_strategy == "channel",
        scheme.act_strategy if scheme.act_format is not None else None,
        device,
        x_dtype,
        in_features,
        out_features,
    )


def _held_tensors(obj: object):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _held_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _held_tensors(item)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of the distinct tensor storages that ``module`` and its submodules hold: parameters,
    buffers and any tensor kept as an attribute (e.g. a ``QuantLinear``'s decoded weight cache)."""
    seen: set[int] = set()
    total = 0
    for m in module.modules():
        for t in _held_tensors(list(vars(m).values())):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


@contextmanager
def holding_dequantized_weights(model: nn.Module) -> Iterator[None]:
    """While active, each ``QuantLinear`` of ``model`` keeps its float32 dequantized weight for the
    straight-through path (the gradient passes over a frozen quantized model: norm tweaking) instead of
    decoding its codes at every forward; released on exit (4 bytes per weight meanwhile). The values are
    the same either way."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in layers:
        m._held_weight = None
    try:
        yield
    finally:
        for m in layers:
            m.__dict__.pop("_held_weight", None)


def set_weight_cache(model: nn.Module, mode: str) -> nn.Module:
    """Set ``weight_cache`` (``"lean"`` or ``"cached"``) on every ``QuantLinear`` of ``model``; returns it."""
    if mode not in WEIGHT_CACHE_MODES:
        raise ValueError(f"weight_cache must be one of {', '.join(WEIGHT_CACHE_MODES)}; got {mode!r}")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.weight_cache = mode
    return model


class QuantLinear(nn.Module):
    """Inference-only linear layer with 8-bit weights and optional 8-bit activations, or FP4 weights."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Scheme | str) -> None:
        super().__init__()
        self.scheme = get_scheme(scheme)
        self.in_features, self.out_features = in_features, out_features
        per_channel = self.scheme.weight_strategy == "channel"
        if self.scheme.is_fp4:
            self._fp4_buffers()
        else:
            self.weight_scale_2: torch.Tensor | None = None  # NVFP4's per-tensor scale (FP4 schemes)
            self.register_buffer(
                "weight", torch.zeros(out_features, in_features, dtype=self.scheme.weight_format.dtype)
            )
            self.register_buffer("weight_scale", torch.ones(out_features, 1) if per_channel else torch.ones(1))
        if self.scheme.static_activations:
            self.register_buffer("input_scale", torch.ones(1))
        else:
            self.input_scale = None
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.kernel: str | None = None  # set to a name in KERNELS to force a kernel (tests, benchmarks)
        self.weight_cache = "lean"  # or "cached": keep the decoded codes for the CPU GEMM (see module doc)
        self._cache: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._fp4_cache: tuple | None = None  # (weight, version, scale, version, float32 weight)
        self._failed: set[str] = set()

    def _fp4_buffers(self) -> None:
        """The FP4 scheme's packed codes, block scales and (NVFP4) per-tensor scale, as the module doc says."""
        gran = parse_granularity(self.scheme.weight_granularity)
        block = gran.block_shape(self.out_features, self.in_features)[1]
        if self.in_features % block:
            raise ValueError(
                f"{self.scheme.name} quantizes the input dim in blocks of {block}; in_features={self.in_features} "
                "is not a multiple (keep this layer in high precision)"
            )
        rows, groups = self.out_features, self.in_features // block
        self.register_buffer("weight", torch.zeros(rows, self.in_features // 2, dtype=torch.uint8))
        if gran.is_nvfp4:
            self.register_buffer("weight_scale", torch.ones(rows, groups).to(torch.float8_e4m3fn))
            self.register_buffer("weight_scale_2", torch.ones(1))
        else:
            self.register_buffer("weight_scale", torch.full((rows, groups), 127, dtype=torch.uint8))  # E8M0 1.0
            self.weight_scale_2 = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        scheme: Scheme | str,
        input_amax: float | None = None,
        weight_global_scale: torch.Tensor | None = None,
    ) -> QuantLinear:
        """Quantize ``linear``'s weight; ``input_amax`` sets the static activation scale (required for
        static schemes); ``weight_global_scale``: NVFP4's per-tensor weight scale when it is shared with
        other layers (``fp8kit.quantize``'s ``global_scale``), else the weight's own."""
        scheme = get_scheme(scheme)
        q = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        w = linear.weight.detach().float()
        if not torch.isfinite(w).all():
            raise ValueError("the weight holds NaN or inf; it cannot be quantized")
        shared = {"global_scale": weight_global_scale} if weight_global_scale is not None else {}
        qt = fp8_quantize(w, scheme.weight_format, scheme.weight_granularity, **shared)
        if scheme.is_fp4:
            q.set_fp4_weight(qt)
        else:
            q.weight = qt.data.contiguous()
            q.weight_scale = dequant_scale(qt.amax, scheme.weight_format).reshape(q.weight_scale.shape).contiguous()
        if linear.bias is not None:
            q.bias = linear.bias.detach().float().clone()
        if scheme.static_activations:
            if input_amax is None:
                raise ValueError(f"scheme {scheme.name!r} needs a calibrated input amax (run a forward_loop)")
            q.set_input_amax(float(input_amax))
        return q

    def set_input_amax(self, amax: float) -> None:
        """Set the static input scale for the clipping value ``amax``: ``amax / 2688`` for NVFP4 inputs,
        ``amax / fmt.max`` otherwise."""
        if self.input_scale is None:
            raise ValueError(f"{self.scheme.name} layers have no static input scale")
        if self.scheme.act_strategy == "nvfp4":
            scale = nvfp4_tensor_scale(float(amax)).reshape(1)
        else:
            scale = dequant_scale(torch.tensor([float(amax)]), self.scheme.act_format)
        self.input_scale = scale.to(self.input_scale.device)

    def input_amax(self) -> float:
        """The clipping value the static input scale is set for (``set_input_amax``'s inverse)."""
        if self.input_scale is None:
            raise ValueError(f"{self.scheme.name} layers have no static input scale")
        top = NVFP4_TENSOR_MAX if self.scheme.act_strategy == "nvfp4" else self.scheme.act_format.max
        return float(self.input_scale.float().reshape(())) * top

    def set_fp4_weight(self, qt: QuantizedTensor) -> None:
        """Store an ``(out, in)`` weight quantized by ``fp8kit.quantize(w, "e2m1", <the scheme's granularity>)``."""
        if not self.scheme.is_fp4 or tuple(qt.shape) != (self.out_features, self.in_features):
            raise ValueError(f"set_fp4_weight takes the {tuple(self.weight.shape)} weight of an FP4 scheme's layer")
        self.weight = pack_fp4(qt.data).contiguous()
        self.weight_scale = qt.scales.contiguous()
        if qt.global_scale is not None:
            self.weight_scale_2 = qt.global_scale.reshape(1).clone()

    def fp4_weight(self) -> QuantizedTensor:
        """An FP4 scheme's weight as the GEMM floor's operand: the unpacked codes with their scales."""
        gran = parse_granularity(self.scheme.weight_granularity)
        block = gran.block_shape(self.out_features, self.in_features)
        global_scale = None if self.weight_scale_2 is None else self.weight_scale_2.reshape(())
        codes = unpack_fp4(self.weight)
        return QuantizedTensor(codes, self.weight_scale, E2M1, gran, block, torch.float32, global_scale=global_scale)

    def _apply(self, fn, *args, **kwargs):
        self._cache = None  # .to(device/dtype): drop the compute copy of the old weight
        self._fp4_cache = None
        return super()._apply(fn, *args, **kwargs)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the layer computes with, ``codes * weight_scale`` (FP4: per block, times ``weight_scale_2``)."""
        if self.scheme.is_fp4:
            return self.fp4_weight().dequantize(dtype)
        return (self.weight.float() * self.weight_scale.reshape(-1, 1)).to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of the stored weight codes and scales (the bias and the CPU compute cache not counted;
        ``resident_bytes(layer)`` counts everything the layer holds)."""
        scale_2 = 0 if self.weight_scale_2 is None else self.weight_scale_2.numel() * 4
        scales = self.weight_scale.numel() * self.weight_scale.element_size()
        return self.weight.numel() * self.weight.element_size() + scales + scale_2

    # -- activations -------------------------------------------------------------------------------

    def quantize_fp4_input(self, x2: torch.Tensor) -> QuantizedTensor:
        """A 2-D input ``(tokens, in_features)`` in NVFP4 (``nvfp4`` scheme): block scales from ``x2``, the
        static per-tensor ``input_scale``. Non-finite input raises (E2M1 cannot encode it)."""
        return fp8_quantize(x2, E2M1, "nvfp4", global_scale=self.input_scale, check_scale=False)

    def _gemm_input(self, x2: torch.Tensor) -> QuantizedTensor | torch.Tensor:
        """An FP4 layer's GEMM operand: the NVFP4 input (W4A4) or ``x2`` itself (weight-only)."""
        return x2 if self.scheme.act_format is None else self.quantize_fp4_input(x2)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of a 2-D input ``(tokens, in_features)`` and their dequant scale: ``(1,)`` for a static
        per-tensor scale, ``(tokens, 1)`` per token. Through ``fp8kit.quantize``; NaN/inf propagate."""
        fmt: Format = self.scheme.act_format
        # compiled kernel (bit-identical to eager) for large inputs; row tiles keep one compiled graph per
        # in_features (a static scalar scale is broadcast to every row: the per-tensor codes exactly)
        backend = "compiled" if use_compiled(x2.numel()) else "eager"
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
        if self.scheme.is_fp4:
            xin = self._gemm_input(x2)
            xd = xin.dequantize(torch.float32) if isinstance(xin, QuantizedTensor) else xin.float()
            out = xd @ self.dequantized_weight().t()
        elif self.scheme.act_format is None:  # weight-only
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
                if self.scheme.is_fp4:
                    xd = self.quantize_fp4_input(x2.detach()).dequantize(x2.dtype)
                else:
                    xq, sx = self.quantize_input(x2.detach())
                    xd = (xq.float() * sx.reshape(-1, 1)).to(x2.dtype)
            x2 = x2 + (xd - x2).detach()
        out = x2.float() @ self._straight_through_weight().t()
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _straight_through_weight(self) -> torch.Tensor:
        """``dequantized_weight()``; inside ``holding_dequantized_weights`` kept from one call to the next
        until the codes or the scales change (decoding FP8 codes costs about as much as the GEMM)."""
        held = self.__dict__.get("_held_weight", False)
        if held is False:
            return self.dequantized_weight()
        w, s = self.weight, self.weight_scale
        if held is None or held[0] is not w or held[1] != w._version or held[2] is not s or held[3] != s._version:
            self._held_weight = held = (w, w._version, s, s._version, self.dequantized_weight())
        return held[4]

    def _codes(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight's code values in ``dtype`` (exact), cached until the weight buffer changes."""
        w = self.weight  # the cache holds the weight itself, so its identity and version name it safely
        c = self._cache
        if c is None or c[0] is not w or c[1] != w._version or c[2].dtype != dtype:
            self._cache = None  # free the old copy before making the new one
            self._cache = c = (w, w._version, w.to(dtype))
        return c[2]

    def _gemm(self, choice: KernelChoice, x2: torch.Tensor) -> torch.Tensor:
        """``x2 @ W^T`` (dequantized, bias added) with kernel ``choice``, shape ``(M, out)``, in ``x2.dtype``."""
        if self.weight_cache not in WEIGHT_CACHE_MODES:
            raise ValueError(f"weight_cache must be one of {', '.join(WEIGHT_CACHE_MODES)}; got {self.weight_cache!r}")
        cached = None
        if choice.name == "codes_mm" and self.weight_cache == "cached":
            cached = self._codes(choice.gemm_dtype)
        elif self._cache is not None:
            self._cache = None  # switched to lean (or another kernel): release the copy
        if self.scheme.act_format is None:
            return scaled_mm(choice, x2, self.weight, self.weight_scale, None, self.bias, x2.dtype, cached)
        xq, sx = self.quantize_input(x2)
        return scaled_mm(choice, xq, self.weight, self.weight_scale, sx, self.bias, x2.dtype, cached)

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

    def _fp4_compute_weight(self) -> torch.Tensor:
        """An FP4 layer's ``dequantized_weight()``, kept until its codes or scales change (``weight_cache="cached"``)."""
        w, s, c = self.weight, self.weight_scale, self._fp4_cache
        if c is None or c[0] is not w or c[1] != w._version or c[2] is not s or c[3] != s._version:
            self._fp4_cache = None  # free the old copy before making the new one
            self._fp4_cache = c = (w, w._version, s, s._version, self.dequantized_weight())
        return c[4]

    def _forward_fp4(self, x: torch.Tensor) -> torch.Tensor:
        """An FP4 layer: the GEMM floor's ``block_scaled_mm`` on the dequantized weight (and NVFP4 input)."""
        if self.kernel not in (None, "reference"):
            raise ValueError(f"{self.scheme.name} layers run block_scaled_mm or 'reference', not {self.kernel!r}")
        if self.kernel == "reference":
            return self._forward_reference(x)
        if self.weight_cache not in WEIGHT_CACHE_MODES:
            raise ValueError(f"weight_cache must be one of {', '.join(WEIGHT_CACHE_MODES)}; got {self.weight_cache!r}")
        cached = self._fp4_compute_weight() if self.weight_cache == "cached" else None
        if cached is None:
            self._fp4_cache = None
        xin = self._gemm_input(x.reshape(-1, self.in_features))
        out = block_scaled_mm(xin, self.fp4_weight(), self.bias, x.dtype, cached=cached)
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"QuantLinear expects inputs with last dim {self.in_features}, got {tuple(x.shape)}")
        if x.requires_grad and torch.is_grad_enabled():
            return self._forward_straight_through(x)
        if self.scheme.is_fp4:
            return self._forward_fp4(x)
        choice = self.kernel_for(x)
        _log_choice(choice, x.device.type)
        if choice.name == "reference":
            return self._forward_reference(x)
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        try:
            out = self._gemm(choice, x2).reshape(*shape[:-1], self.out_features)
        except (RuntimeError, TypeError) as err:  # an unsupported GPU or shape: remember, say why, use the reference
            if self.kernel is not None:
                raise
            self._failed.add(choice.name)
            log.warning("fp8kit.ptq: kernel %s failed (%s); using the reference path", choice.name, err)
            return self._forward_reference(x)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}, "
            f"weight_cache={self.weight_cache}"
        )
