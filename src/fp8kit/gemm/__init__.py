"""fp8kit's GEMM floor: every quantized GEMM of training and inference, and the one CPU probe.

* ``probe``: the CPU feature probe (AVX512-BF16/AMX -> bfloat16 GEMMs, VNNI/AMX -> ``torch._int_mm``),
  decided once per process; every CPU GEMM below reads it.
* ``fp8``: ``fp8_gemm``, the training GEMM on ``QuantizedTensor`` operands (per-tensor, per-row, block
  and MX scales; exact CPU emulation, native ``_scaled_mm`` / ``scaled_mm`` on CUDA).
* ``scaled``: ``choose_kernel`` + ``scaled_mm``, the inference GEMM on stored 8-bit codes with
  per-tensor / per-row scales: FP8 and INT8 W8A8, weight-only INT8 (``fp8kit.ptq.QuantLinear``);
  ``block_scaled_mm``, the one on tile-scaled (block FP8) codes (``export.BlockQuantLinear``, block-FP8
  experts).
* ``codes``: ``codes_mm``, the CPU GEMM on 8-bit codes: lean (tiles decoded per call, codes-only
  resident) or on a cached decoded copy.
* ``grouped``: ``grouped_gemm`` / ``grouped_gemm_wgrad``, the MoE experts' FP8 grouped GEMMs (one
  ``torch._grouped_mm`` over all experts on CPU, ``torch._scaled_grouped_mm`` on CUDA), on the same probe
  and decode, and ``grouped_scaled_mm``, the PTQ experts' grouped GEMM on 8-bit codes; imported on use
  (``fp8kit.gemm.grouped``), as it registers custom ops. Their operands (``GroupedWeight``,
  ``GroupColumns``) and quantizers are in ``fp8kit.numerics.grouped_tensor``.
"""

from .codes import TILE_ELEMENTS, codes_mm, decode_codes
from .fp8 import fp8_gemm, native_gemm_fallbacks, scales_factor_out
from .probe import (
    choose_cpu_backend,
    choose_cpu_int8_backend,
    cpu_gemm_backend,
    cpu_int8_backend,
    set_cpu_gemm_backend,
    set_cpu_int8_backend,
)
from .scaled import KERNELS, KernelChoice, choose_kernel, scaled_mm

__all__ = [
    "KERNELS",
    "TILE_ELEMENTS",
    "KernelChoice",
    "choose_cpu_backend",
    "choose_cpu_int8_backend",
    "choose_kernel",
    "codes_mm",
    "cpu_gemm_backend",
    "cpu_int8_backend",
    "decode_codes",
    "fp8_gemm",
    "native_gemm_fallbacks",
    "scaled_mm",
    "scales_factor_out",
    "set_cpu_gemm_backend",
    "set_cpu_int8_backend",
]
