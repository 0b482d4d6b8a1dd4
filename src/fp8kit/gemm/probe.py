"""The one CPU GEMM probe: which kernels this CPU runs fast, decided from its feature flags.

Training (``fp8_gemm``) and inference (``scaled_mm``, ``QuantLinear``) read the same decision:

* float backend ``"bf16"`` on CPUs with native bfloat16 dot products (AVX512-BF16 or AMX-BF16): GEMMs on
  8-bit values with bfloat16 outputs run as bfloat16 GEMMs (FP8 and INT8 values are exact in bfloat16,
  oneDNN accumulates in FP32); ``"fp32"`` elsewhere (AVX2: bfloat16 GEMMs there are tens of times
  slower than FP32);
* int8 backend ``"int_mm"`` on CPUs with 8-bit dot products (AVX512-VNNI, AVX-VNNI or AMX-INT8):
  INT8 x INT8 GEMMs through ``torch._int_mm`` (exact int32 accumulation); ``"float"`` elsewhere (the
  codes as exact values in the float backend's dtype).

A rule on features rather than a timing probe: timings depend on the machine's load, and a choice that
changed between processes would change results, breaking bit-exact resume. Decided at import (reading
``/proc/cpuinfo`` takes about a millisecond), so that compiled graphs never trace it; logged once.
"""

from __future__ import annotations

import logging

import torch

__all__ = [
    "choose_cpu_backend",
    "choose_cpu_int8_backend",
    "cpu_gemm_backend",
    "cpu_int8_backend",
    "set_cpu_gemm_backend",
    "set_cpu_int8_backend",
]

log = logging.getLogger("fp8kit")

_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose_cpu_backend(flags: frozenset[str] | set[str]) -> str:
    """How GEMMs on FP8 (and INT8) values run on a CPU with these feature flags: ``"bf16"`` with native
    bfloat16 dot products (AVX512-BF16, AMX-BF16; bfloat16 outputs only, FP32 outputs still upcast),
    else ``"fp32"`` (codes upcast to FP32, multiplied in FP32)."""
    return "bf16" if _BF16_FLAGS & set(flags) else "fp32"


def choose_cpu_int8_backend(flags: frozenset[str] | set[str]) -> str:
    """How INT8 x INT8 GEMMs run on a CPU with these feature flags: ``"int_mm"`` (``torch._int_mm``) with
    8-bit dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX-INT8), else ``"float"`` (the codes as
    exact values in the float backend's dtype)."""
    return "int_mm" if _INT8_FLAGS & set(flags) and hasattr(torch, "_int_mm") else "float"


_FLAGS = _cpu_flags()
_CPU_BACKEND: dict[str, str] = {"name": choose_cpu_backend(_FLAGS), "int8": choose_cpu_int8_backend(_FLAGS)}
_LOGGED: list[bool] = []


def _log_once() -> None:
    if not _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.append(True)
        log.info(
            "fp8kit: CPU GEMM backends: 8-bit floats %s, INT8 x INT8 %s (capability %s)",
            _CPU_BACKEND["name"],
            _CPU_BACKEND["int8"],
            torch.backends.cpu.get_cpu_capability(),
        )


def cpu_gemm_backend() -> str:
    """The CPU float GEMM backend this process uses (``"fp32"`` or ``"bf16"``)."""
    _log_once()
    return _CPU_BACKEND["name"]


def cpu_int8_backend() -> str:
    """The CPU INT8 x INT8 GEMM backend this process uses (``"int_mm"`` or ``"float"``)."""
    _log_once()
    return _CPU_BACKEND["int8"]


def set_cpu_gemm_backend(name: str) -> None:
    """Override the CPU float GEMM backend: ``"fp32"`` (upcast) or ``"bf16"`` (native bf16 GEMMs for
    bfloat16 outputs)."""
    if name not in ("fp32", "bf16"):
        raise ValueError(f"CPU GEMM backend must be 'fp32' or 'bf16', got {name!r}")
    _CPU_BACKEND["name"] = name


def set_cpu_int8_backend(name: str) -> None:
    """Override the CPU INT8 x INT8 GEMM backend: ``"int_mm"`` or ``"float"``."""
    if name not in ("int_mm", "float"):
        raise ValueError(f"CPU INT8 GEMM backend must be 'int_mm' or 'float', got {name!r}")
    _CPU_BACKEND["int8"] = name
