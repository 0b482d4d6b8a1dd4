"""Quantize kernels: an eager reference and fused fast versions that are held bit-exact to it.

* ``reference``: plain PyTorch, exact rounding written out (``formats.cast_reference``).
* ``fused``: the same math compiled with ``torch.compile`` (C++/OpenMP on CPU, Triton on CUDA) so
  that amax, scale and cast read the input twice and write the FP8 output once. On CPU the FP8
  conversions follow the CPU (``fused.cpu_cast_kernel``): torch's own with AVX-512, integer arithmetic
  on the float32 bits (``cast_bits``) elsewhere, both vectorized by inductor; on CUDA torch's own.
  ``decode_fp8`` is the inverse (codes to exact values) and ``cast_values`` the values a cast encodes,
  computed beside it (the operand of a CPU GEMM). Falls back to eager when compilation is unavailable
  (``set_compile_strict(True)`` raises instead).
"""

from .fused import (
    cast_values,
    decode_fp8,
    quantize_blocks_eager,
    quantize_blocks_fused,
    quantize_pair_eager,
    quantize_pair_fused,
    round_bits,
    set_compile_enabled,
    set_compile_strict,
)
from .reference import BlockSpec, quantize_blocks_reference

__all__ = [
    "BlockSpec",
    "cast_values",
    "decode_fp8",
    "quantize_blocks_eager",
    "quantize_blocks_fused",
    "quantize_blocks_reference",
    "quantize_pair_eager",
    "quantize_pair_fused",
    "round_bits",
    "set_compile_enabled",
    "set_compile_strict",
]
