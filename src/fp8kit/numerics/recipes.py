"""FP8 and NVFP4 training recipes: frozen, validated, comparable by value.

A recipe says how each GEMM operand is scaled and in which format. Mutable state (amax histories,
scales) lives in the modules (``fp8kit.nn``), never in the recipe, so one recipe can be shared.

``fp8_format="hybrid"`` means E4M3 for inputs and weights (forward) and E5M2 for gradients
(backward); ``"e4m3"`` uses E4M3 everywhere.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .formats import E2M1, E4M3, E5M2, Format
from .scaling import Granularity, compute_scale

__all__ = [
    "BlockScaling",
    "CurrentScaling",
    "DelayedScaling",
    "MXFP8Scaling",
    "NVFP4BlockScaling",
    "Recipe",
    "RowwiseScaling",
    "all_recipes",
    "recipe_from_name",
    "RECIPE_NAMES",
    "TRAINING_RECIPE_NAMES",
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

    def granularity_for(self, role: str) -> str | tuple[int, int] | Granularity:
        """Granularity of an operand, expressed on its 2-D view whose last dim is the GEMM's reduction."""
        return "tensor"

    def rounding_for(self, role: str) -> str:
        """How a ``role`` operand is rounded to its format: ``"nearest"`` (even) or ``"stochastic"``."""
        return "nearest"

    @property
    def transforms_wgrad_operands(self) -> bool:
        """``wgrad_operand`` changes the weight-gradient GEMM's operands (they are quantized on their own)."""
        return False

    def wgrad_operand(self, x: torch.Tensor) -> torch.Tensor:
        """A weight-gradient GEMM operand ``(rows, tokens)`` (the input or the output gradient, transposed) as
        it is quantized: unchanged, or transformed along the token dim in a way that cancels in the product."""
        return x

    def high_precision_blocks(self, num_blocks: int) -> tuple[list[int], str]:
        """The decoder blocks (indices of ``num_blocks``) whose layers the default filter keeps in high
        precision, and why; none for the FP8 recipes."""
        return [], ""

    @property
    def converts_experts(self) -> str | None:
        """Why MoE experts modules cannot run this recipe (they stay in high precision), or None."""
        return None

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
    def wgrad_token_multiple(self) -> int | None:
        """Tokens that one scaling tile (or transform block) of a weight-gradient GEMM operand spans along the
        token dim, or ``None``: each MoE expert's token group is zero-padded to a multiple of it, so that
        none straddles two experts (``nn.experts.token_alignment``)."""
        return self.tile_width

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


def _env_flag(name: str) -> bool:
    """An environment switch as Transformer Engine reads it: ``"1"`` is on."""
    return os.getenv(name, "0") == "1"


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4 training as Transformer Engine's ``NVFP4BlockScaling`` (knobs named as there).

    E2M1 elements in 1x16 blocks along the reduction dim with E4M3 block scales under an FP32 per-tensor
    scale (current scaling of the tensor's amax, ``scaling.nvfp4_scales``) for activations and gradients;
    16x16 blocks for weights (``disable_2d_quantization=False``), so W and W^T share codes and the weight is
    quantized once per step; stochastic rounding of the output gradient (both backward GEMMs); a random
    Hadamard transform of size ``rht_size`` on both inputs of the weight-gradient GEMM along the token dim
    (``hadamard.apply_rht``; it cancels in the product). ``fp8_format`` is the block scales' format and
    ``fp4_format`` the elements', as in TE (the only values accepted). The default module filter keeps the
    first and last decoder blocks in high precision in NVIDIA's proportion (``high_precision_blocks``).
    The three ``disable_*`` knobs default to TE's environment variables (``NVTE_NVFP4_DISABLE_RHT=1``,
    ``NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING=1``, ``NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1``), read when the
    recipe is made: ``fp8kit train --recipe nvfp4`` takes them from there. MoE experts (``nn.experts``) run it
    with one tensor scale per expert weight and each expert's token group padded to ``wgrad_token_multiple``.
    """

    fp8_format: str = "e4m3"
    fp4_format: str = "e2m1"
    disable_rht: bool = field(default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_RHT"))
    disable_stochastic_rounding: bool = field(
        default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
    )
    disable_2d_quantization: bool = field(default_factory=lambda: _env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"))
    rht_size: int = 16

    kind = "nvfp4"

    def __post_init__(self) -> None:
        if self.fp8_format != "e4m3" or self.fp4_format != "e2m1":
            raise ValueError(
                f"NVFP4BlockScaling takes fp8_format='e4m3' (block scales) and fp4_format='e2m1' (elements), got "
                f"{self.fp8_format!r}, {self.fp4_format!r}"
            )
        if self.rht_size < 2 or self.rht_size & (self.rht_size - 1) or self.rht_size > 128:
            raise ValueError(f"rht_size must be a power of two in [2, 128], got {self.rht_size}")
        from .hadamard import random_hadamard

        random_hadamard(self.rht_size)  # built here, eagerly: compiled graphs read it as a constant

    def format_for(self, role: str) -> Format:
        return E2M1

    def granularity_for(self, role: str) -> str | tuple[int, int] | Granularity:
        if role == "weight" and not self.disable_2d_quantization:
            return Granularity("nvfp4", (16, 16))
        return "nvfp4"

    def rounding_for(self, role: str) -> str:
        return "stochastic" if role == "grad" and not self.disable_stochastic_rounding else "nearest"

    def wgrad_operand(self, x: torch.Tensor) -> torch.Tensor:
        """Zero tokens padded to a multiple of the blocks (16, and ``rht_size``; zeros add nothing to the
        product), then the random Hadamard transform along the tokens unless ``disable_rht``."""
        from .hadamard import apply_rht

        pad = (-x.shape[-1]) % self.wgrad_token_multiple
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        return x if self.disable_rht else apply_rht(x, self.rht_size)

    def high_precision_blocks(self, num_blocks: int) -> tuple[list[int], str]:
        """NVIDIA's NVFP4 12B run kept the first 2 and the last 8 of 62 blocks in BF16: that proportion,
        at least the first and the last block; none below 4 blocks (little would be left in NVFP4)."""
        if num_blocks < 4:
            return [], ""
        first = max(1, round(num_blocks * 2 / 62))
        last = max(1, round(num_blocks * 8 / 62))
        kept = sorted(set(range(first)) | set(range(num_blocks - last, num_blocks)))
        why = (
            f"NVFP4 keeps the first {first} and last {last} of {num_blocks} decoder blocks in BF16 (NVIDIA's NVFP4 "
            "recipe: first 2 and last 8 of 62); pass module_filter to choose otherwise"
        )
        return kept, why

    @property
    def transforms_wgrad_operands(self) -> bool:
        return True

    @property
    def wgrad_token_multiple(self) -> int | None:
        """The 1x16 blocks along the tokens, and the transform's ``rht_size`` blocks unless ``disable_rht``."""
        return 16 if self.disable_rht else max(16, self.rht_size)

    @property
    def per_tensor(self) -> bool:
        return False

    @property
    def weight_transposes_codes(self) -> bool:
        return not self.disable_2d_quantization  # 16x16 weight blocks

    @property
    def tile_width(self) -> int | None:
        return 16


_KINDS: dict[str | None, type[Recipe]] = {
    c.kind: c for c in (DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling, MXFP8Scaling, NVFP4BlockScaling)
}
RECIPE_NAMES = ("delayed", "current", "rowwise", "block", "mxfp8")
# every training recipe by name: the FP8 ones (``RECIPE_NAMES``, what ``all`` selects) and NVFP4
TRAINING_RECIPE_NAMES = (*RECIPE_NAMES, "nvfp4")


def all_recipes() -> list[Recipe]:
    """One recipe of each kind with default settings, in ``RECIPE_NAMES`` order."""
    return [recipe_from_name(n) for n in RECIPE_NAMES]


def recipe_from_name(name: str) -> Recipe:
    """``"delayed"``, ``"current"``, ``"rowwise"``, ``"block"``, ``"mxfp8"`` or ``"nvfp4"`` with default settings."""
    key = name.lower().replace("-", "").replace("_", "")
    alias = {"mx": "mxfp8", "blockwise": "block", "deepseek": "block", "tensorwise": "current"}
    key = alias.get(key, key)
    if key not in _KINDS or key is None:
        raise ValueError(f"unknown recipe {name!r}; accepted: {', '.join(TRAINING_RECIPE_NAMES)}")
    return _KINDS[key]()
