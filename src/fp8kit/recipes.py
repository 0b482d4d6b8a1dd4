"""FP8 training recipes: frozen, validated, comparable by value.

A recipe says how each GEMM operand is scaled and in which format. Mutable state (amax histories,
scales) lives in the modules (``fp8kit.nn``), never in the recipe, so one recipe can be shared.

``fp8_format="hybrid"`` means E4M3 for inputs and weights (forward) and E5M2 for gradients
(backward); ``"e4m3"`` uses E4M3 everywhere.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .formats import E4M3, E5M2, Format
from .scaling import compute_scale

__all__ = [
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXFP8Scaling",
    "Recipe",
    "RowwiseScaling",
    "all_recipes",
    "recipe_from_name",
    "RECIPE_NAMES",
]

_FORMATS = ("hybrid", "e4m3")


@dataclass(frozen=True)
class Recipe:
    """Base class. ``kind`` names the scaling family; subclasses add their knobs."""

    fp8_format: str = "hybrid"

    kind = "base"

    def __post_init__(self) -> None:
        if self.fp8_format not in _FORMATS:
            raise ValueError(f"fp8_format must be one of {_FORMATS}, got {self.fp8_format!r}")

    def format_for(self, role: str) -> Format:
        """Element format of an operand role: ``"input"``, ``"weight"`` or ``"grad"``."""
        if role == "grad" and self.fp8_format == "hybrid":
            return E5M2
        return E4M3

    def granularity_for(self, role: str) -> str | tuple[int, int]:
        """Granularity of an operand, expressed on its 2-D view whose last dim is the GEMM's reduction."""
        return "tensor"

    @property
    def per_tensor(self) -> bool:
        return True

    @property
    def power_of_two_scales(self) -> bool:
        """Every scale this recipe computes is a power of two (its ``power_of_two`` knob; MX always), so an
        FP8 value times its scale is exact in bf16 (CPU GEMMs on dequantized tiles use that)."""
        return bool(getattr(self, "power_of_two", False))

    @property
    def fast_accumulation(self) -> bool:
        """The forward GEMM may use the GPU's fast FP8 accumulation (per-tensor and row-wise recipes, as
        torchao); the gradients' GEMMs and tile recipes keep Hopper's periodic FP32 promotion (DeepSeek-V3)."""
        return False

    @property
    def weight_transposes_codes(self) -> bool:
        """The quantized weight's transpose is its codes transposed (one scale, or square tiles), so the
        transposed GEMM operand needs no second quantization."""
        return self.per_tensor

    @property
    def scales_whole_rows(self) -> bool:
        """One scale per whole row of an operand (row-wise): a split of the reduction dim splits every
        scale, and the transposed operand needs its own per-column scales."""
        return False

    @property
    def tile_width(self) -> int | None:
        """Width of the scaling tiles along the reduction dim (block, MX), or ``None`` (no tiles)."""
        return None

    @property
    def quantize_kwargs(self) -> dict[str, Any]:
        """The recipe's settings as ``fp8kit.quantize`` keyword arguments."""
        return {}

    def scale_from_amax(
        self, amax: torch.Tensor, role: str, previous: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        """The per-tensor scale of a ``role`` operand whose absolute maximum is ``amax``: the pure rule
        ``fmt.max / amax / 2**margin`` (``compute_scale``, with the recipe's margin and power-of-two
        rounding); ``previous`` is kept where ``amax`` is zero or non-finite (else 1.0)."""
        margin = getattr(self, "margin", 0)
        return compute_scale(amax, self.format_for(role), margin, self.power_of_two_scales, previous=previous)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, **asdict(self)}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Recipe:
        d = json.loads(text)
        cls = _KINDS.get(d.pop("kind", None))
        if cls is None:
            raise ValueError(f"unknown recipe in {text!r}")
        return cls(**d)


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scale from the amax history of earlier steps (Transformer Engine semantics).

    ``scale = fmt.max / reduce(amax_history) / 2**margin`` where ``reduce`` is the max of the window
    (``"max"``) or the latest entry (``"most_recent"``). The history rolls once per step.

    First-step rule: a tensor that has never been seen has an empty history; it is quantized with the
    scale of its own current amax (current scaling) instead of a blind 1.0, and that amax becomes the
    first history entry.
    """

    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0

    kind = "delayed"

    @property
    def fast_accumulation(self) -> bool:
        return True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")


@dataclass(frozen=True)
class CurrentScaling(Recipe):
    """Per-tensor scale from this step's amax (just-in-time)."""

    power_of_two: bool = False
    margin: int = 0

    kind = "current"

    @property
    def fast_accumulation(self) -> bool:
        return True

    @property
    def quantize_kwargs(self) -> dict[str, Any]:
        return {"margin": self.margin, "power_of_two": self.power_of_two}


@dataclass(frozen=True)
class RowwiseScaling(Recipe):
    """One scale per row of each operand along the GEMM's reduction dim (per token / per channel).

    E4M3 everywhere by default, as torchao's row-wise recipe and DeepSeek-V3: a row's own scale leaves no
    need for E5M2's range, and CUDA's row-wise grouped GEMM (``torch._scaled_grouped_mm``, the MoE
    experts) takes E4M3 operands only. ``fp8_format="hybrid"`` gives E5M2 gradients."""

    fp8_format: str = "e4m3"

    kind = "rowwise"

    def granularity_for(self, role: str) -> str | tuple[int, int]:
        return "row"

    @property
    def per_tensor(self) -> bool:
        return False

    @property
    def fast_accumulation(self) -> bool:
        return True

    @property
    def scales_whole_rows(self) -> bool:
        return True


@dataclass(frozen=True)
class BlockScaling(Recipe):
    """DeepSeek-V3 tiles: 1x128 for activations and gradients, 128x128 for weights; E4M3 everywhere.

    Scales are powers of two by default (as Transformer Engine's ``Float8BlockScaling``), which makes
    dequantization exact. Ragged edge tiles serve dimensions that are not multiples of 128.
    """

    fp8_format: str = "e4m3"
    block_size: int = 128
    power_of_two: bool = True

    kind = "block"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def granularity_for(self, role: str) -> str | tuple[int, int]:
        b = self.block_size
        return (b, b) if role == "weight" else (1, b)

    @property
    def per_tensor(self) -> bool:
        return False

    @property
    def weight_transposes_codes(self) -> bool:
        return True  # square weight tiles

    @property
    def tile_width(self) -> int | None:
        return self.block_size

    @property
    def quantize_kwargs(self) -> dict[str, Any]:
        return {"power_of_two": self.power_of_two}


@dataclass(frozen=True)
class MXFP8Scaling(Recipe):
    """OCP MXFP8: 1x32 blocks along the reduction dim with E8M0 scales; E4M3 everywhere by default."""

    fp8_format: str = "e4m3"
    rounding: str = "rceil"

    kind = "mxfp8"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rounding not in ("rceil", "floor"):
            raise ValueError(f"rounding must be 'rceil' or 'floor', got {self.rounding!r}")

    def granularity_for(self, role: str) -> str | tuple[int, int]:
        return "mx"

    @property
    def per_tensor(self) -> bool:
        return False

    @property
    def power_of_two_scales(self) -> bool:
        return True

    @property
    def tile_width(self) -> int | None:
        return 32

    @property
    def quantize_kwargs(self) -> dict[str, Any]:
        return {"mx_rounding": self.rounding}


_KINDS: dict[str | None, type[Recipe]] = {
    c.kind: c for c in (DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling, MXFP8Scaling)
}
RECIPE_NAMES = ("delayed", "current", "rowwise", "block", "mxfp8")


def all_recipes() -> list[Recipe]:
    """One recipe of each kind with default settings, in ``RECIPE_NAMES`` order."""
    return [recipe_from_name(n) for n in RECIPE_NAMES]


def recipe_from_name(name: str) -> Recipe:
    """``"delayed"``, ``"current"``, ``"rowwise"``, ``"block"`` or ``"mxfp8"`` with default settings."""
    key = name.lower().replace("-", "").replace("_", "")
    alias = {"mx": "mxfp8", "blockwise": "block", "deepseek": "block", "tensorwise": "current"}
    key = alias.get(key, key)
    if key not in _KINDS or key is None:
        raise ValueError(f"unknown recipe {name!r}; accepted: {', '.join(RECIPE_NAMES)}")
    return _KINDS[key]()
