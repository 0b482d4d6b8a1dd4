"""Where a job runs: ``--device auto|cpu|cuda|cuda:N`` resolved and checked before any model is loaded, and
what the chosen device runs natively.

Native FP8 GEMMs on NVIDIA GPUs (``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm``, the kernels
``fp8kit.gemm`` dispatches to): per-tensor and row-wise FP8 from SM89 (Ada, Hopper, Blackwell), the 1x128 /
128x128 block-scaled GEMM on Hopper (SM90) only, MXFP8 from Blackwell (SM100). A recipe the GPU cannot run
natively is refused unless ``emulate`` is set; it then runs on dequantized BF16 operands (the GEMM floor's
logged fallback) after a one-line warning. The CPU emulates every recipe (``fp8kit.gemm.probe``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DeviceError",
    "DeviceReport",
    "device_report",
    "emulated_on",
    "native_on",
    "needs",
    "resolve_device",
    "work_dtype",
]

log = logging.getLogger("fp8kit")

# What each training recipe and PTQ scheme needs for native GEMMs: (lowest capability, highest major or None).
_NATIVE: dict[str, tuple[tuple[int, int], int | None]] = {
    "delayed": ((8, 9), None),
    "current": ((8, 9), None),
    "rowwise": ((8, 9), None),
    "block": ((9, 0), 9),
    "mxfp8": ((10, 0), None),
    "nvfp4": ((10, 0), None),  # the training recipe and the W4A4 PTQ scheme: FP4 tensor cores are SM100+
    "fp8": ((8, 9), None),
    "fp8-dynamic": ((8, 9), None),
    "int8-smoothquant": ((8, 0), None),
    "int8-weight-only": ((0, 0), None),
    "fp8-block": ((0, 0), None),  # block-FP8 layers dequantize their weight tiles (export.block_linear)
    # FP4 weight-only layers dequantize their weight for a high-precision GEMM on every device
    "nvfp4-weight-only": ((0, 0), None),
    "mxfp4-weight-only": ((0, 0), None),
}


class DeviceError(ValueError):
    """A ``--device`` that this machine cannot serve, found before any model is loaded (exit code 2)."""


def _kind(recipe: Any) -> str:
    """The name of a recipe (a ``Recipe``, its name or alias) or of a PTQ scheme (``+kv`` dropped)."""
    if hasattr(recipe, "kind"):
        return recipe.kind
    name = str(recipe).strip().lower().removesuffix("+kv")
    if name in _NATIVE:
        return name
    from ..numerics.recipes import recipe_from_name

    return recipe_from_name(name).kind


def needs(recipe: Any) -> str:
    """What a recipe or scheme needs to run natively, in words (``"SM89+"``, ``"SM90 (Hopper) only"``)."""
    (major, minor), top = _NATIVE[_kind(recipe)]
    if (major, minor) == (0, 0):
        return "any CUDA GPU"
    if top == major:
        return f"SM{major}{minor} (Hopper) only" if major == 9 else f"SM{major}x only"
    return f"SM{major}{minor}+"


def native_on(recipe: Any, capability: tuple[int, int]) -> bool:
    """Whether a GPU of compute ``capability`` runs ``recipe``'s (or a PTQ scheme's) GEMMs natively."""
    low, top = _NATIVE[_kind(recipe)]
    return tuple(capability) >= low and (top is None or capability[0] <= top)


def emulated_on(recipes: Iterable[Any], capability: tuple[int, int]) -> list[str]:
    """The recipes (or schemes) of ``recipes`` that a GPU of ``capability`` cannot run natively."""
    return [_kind(r) for r in recipes if not native_on(r, capability)]


def _parse(spec: str) -> tuple[str, int | None]:
    text = (spec or "auto").strip().lower()
    if text in ("auto", "cpu", "cuda"):
        return text, None
    if text.startswith("cuda:") and text[5:].isdigit():
        return "cuda", int(text[5:])
    raise DeviceError(f"--device {spec!r} is not a device: give auto, cpu, cuda or cuda:N")


def _local_rank() -> int:
    """This process's GPU under torchrun (``LOCAL_RANK``), 0 elsewhere."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(spec: str | torch.device = "auto", *, recipe: Any = None, emulate: bool = False) -> torch.device:
    """The ``torch.device`` a job runs on: ``auto`` (CUDA when present, else the CPU), ``cpu``, ``cuda``
    (under torchrun: the process's ``LOCAL_RANK`` GPU) or ``cuda:N``. ``recipe``: a recipe, a PTQ scheme or
    a list of them; a CUDA device that cannot run one natively raises ``DeviceError`` unless ``emulate``,
    which logs a one-line warning instead. Raises ``DeviceError`` (one line naming the fix) for a CUDA
    device this machine does not have. Loads nothing."""
    kind, index = _parse(str(spec))
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"--device {spec} but this machine has no CUDA GPU (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}): run with --device cpu, or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    index = _local_rank() if index is None else index
    if index >= count:
        raise DeviceError(f"--device {spec}: this machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
    device = torch.device("cuda", index)
    if recipe is not None:
        _check_native(device, recipe, emulate)
    return device


def _check_native(device: torch.device, recipe: Any, emulate: bool) -> None:
    recipes = recipe if isinstance(recipe, (list, tuple)) else [recipe]
    capability = torch.cuda.get_device_capability(device)
    slow = emulated_on(recipes, capability)
    if not slow:
        return
    sm = f"SM{capability[0]}{capability[1]}"
    what = ", ".join(f"{k} (needs {needs(k)})" for k in slow)
    if not emulate:
        native = ", ".join(k for k in _NATIVE if native_on(k, capability)) or "none"
        raise DeviceError(
            f"{what} has no native GEMM on this {sm} GPU: pass --emulate to run it on dequantized BF16 "
            f"operands, or choose one of: {native}"
        )
    log.warning("fp8kit: %s emulated on this %s GPU (dequantized BF16 GEMMs, slower than native)", what, sm)


def work_dtype(device: torch.device) -> torch.dtype:
    """The dtype models are loaded in for inference and quantization: BF16 on CUDA, FP32 on the CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class DeviceReport:
    """What a device is and runs: its name, compute capability (CUDA) and the recipes/schemes native there."""

    device: str
    name: str
    capability: tuple[int, int] | None
    native: tuple[str, ...]
    emulated: tuple[str, ...]
    memory_bytes: int | None

    def line(self) -> str:
        """One line for run summaries and ``fp8kit info``."""
        if self.capability is None:
            return f"{self.device} ({self.name}); no native FP8 GEMM: every recipe and scheme runs on exact codes"
        cap = f", SM{self.capability[0]}{self.capability[1]}" if self.capability else ""
        mem = f", {self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else ""
        native = ", ".join(self.native) or "none"
        emulated = f"; emulated: {', '.join(self.emulated)}" if self.emulated else ""
        return f"{self.device} ({self.name}{cap}{mem}); native: {native}{emulated}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "name": self.name,
            "capability": list(self.capability) if self.capability else None,
            "native": list(self.native),
            "emulated": list(self.emulated),
            "memory_bytes": self.memory_bytes,
        }


def device_report(device: torch.device | str) -> DeviceReport:
    """The ``DeviceReport`` of ``device``; the CPU runs every recipe emulated (``fp8kit.gemm.probe``)."""
    device = torch.device(device)
    if device.type != "cuda":
        from ..gemm.probe import cpu_gemm_backend

        name = f"CPU, {torch.backends.cpu.get_cpu_capability()}, {cpu_gemm_backend()} GEMMs"
        return DeviceReport(str(device), name, None, (), tuple(_NATIVE), None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = tuple(torch.cuda.get_device_capability(index))
    props = torch.cuda.get_device_properties(index)
    native = tuple(k for k in _NATIVE if native_on(k, capability))
    emulated = tuple(k for k in _NATIVE if k not in native)
    return DeviceReport(f"cuda:{index}", props.name, capability, native, emulated, int(props.total_memory))
