"""``BlockQuantLinear``: the inference layer of the block-FP8 checkpoint format (DeepSeek-V3 style).

Weights are ``float8_e4m3fn`` codes with one float32 dequant multiplier per 128x128 tile
(``weight_scale_inv``, shape ``(ceil(out / 128), ceil(in / 128))``, ``real = code * scale_inv``);
activations are quantized at run time per 1x128 group along K with ``scale_inv = amax / 448``, as the
serving kernels (DeepGEMM, vLLM, SGLang, ``transformers``' Triton kernel) do. The GEMM is the floor's
``gemm.scaled.block_scaled_mm``: the exact dequantized values with FP32 accumulation (exact emulation of
the FP8 products), on a float32 copy of the weight the layer keeps until its codes or scales change.

``dynamic_activations=False`` keeps the activations in high precision: what ``transformers`` computes
when it loads a block-FP8 checkpoint on a machine without an FP8 GPU (it dequantizes the weights).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..gemm.scaled import block_scaled_mm
from ..numerics.formats import E4M3
from ..numerics.scaling import parse_granularity
from ..numerics.tensor import QuantizedTensor, quantize

__all__ = ["BlockQuantLinear", "BLOCK"]

BLOCK = 128


class BlockQuantLinear(nn.Module):
    """Inference-only linear layer with 128x128-tile FP8 weights and dynamic 1x128 FP8 activations."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: int = BLOCK) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        tiles = (-(-out_features // block), -(-in_features // block))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.ones(tiles))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self.dynamic_activations = True
        self._cache: tuple | None = None  # (weight, version, scale_inv, version, float32 weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: int = BLOCK, power_of_two: bool = False) -> BlockQuantLinear:
        """Quantize ``linear``'s weight per ``block`` x ``block`` tile with ``fp8kit.quantize`` (the
        quantizer of the block training recipe; ``power_of_two`` as the recipe's)."""
        w = linear.weight.detach().float()
        if not torch.isfinite(w).all():
            raise ValueError("the weight holds NaN or inf; it cannot be quantized")
        return cls.from_tiles(quantize(w, E4M3, (block, block), power_of_two=power_of_two), linear.bias)

    @classmethod
    def from_tiles(cls, tiles: QuantizedTensor, bias: torch.Tensor | None = None) -> BlockQuantLinear:
        """The layer of an ``(out, in)`` E4M3 weight already quantized in square tiles (``tiles.block``), e.g.
        the FP8 weight a block-recipe training layer computes with (``fp8kit.nn.Linear.fp8_weights``)."""
        (out_features, in_features), (block, other) = tiles.shape, tiles.block
        if block != other or tiles.data.dtype != torch.float8_e4m3fn:
            raise ValueError(f"from_tiles takes E4M3 codes in square tiles, got {tiles.data.dtype} {tiles.block}")
        q = cls(in_features, out_features, bias is not None, block)
        q.weight = tiles.data.contiguous()
        q.weight_scale_inv = tiles.scales.float().reshape(q.weight_scale_inv.shape).contiguous()
        if bias is not None:
            q.bias = bias.detach().float().clone()
        return q

    def weight_tiles(self) -> QuantizedTensor:
        """The weight's codes and tile scales as the GEMM floor's operand."""
        block = (self.block, self.block)
        return QuantizedTensor(
            self.weight, self.weight_scale_inv.float(), E4M3, parse_granularity(block), block, torch.float32
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes * weight_scale_inv`` per tile, the weight the layer computes with."""
        return self.weight_tiles().dequantize(dtype)

    def _apply(self, fn, *args, **kwargs):
        self._cache = None  # .to(device/dtype): drop the float32 copy of the old weight
        return super()._apply(fn, *args, **kwargs)

    def _compute_weight(self) -> torch.Tensor:
        """``dequantized_weight()``, cached until the codes or the scales change (exact either way)."""
        w, s, c = self.weight, self.weight_scale_inv, self._cache
        if c is None or c[0] is not w or c[1] != w._version or c[2] is not s or c[3] != s._version:
            self._cache = c = (w, w._version, s, s._version, self.dequantized_weight())
        return c[4]

    def quantize_groups(self, x2: torch.Tensor) -> QuantizedTensor:
        """A 2-D input quantized to E4M3 per 1x``block`` group (``scale_inv = amax / 448``)."""
        return quantize(x2.float(), E4M3, (1, self.block), nonfinite="propagate")

    def quantize_input(self, x2: torch.Tensor) -> torch.Tensor:
        """A 2-D input rounded to E4M3 per 1x``block`` group, dequantized."""
        return self.quantize_groups(x2).dequantize(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"BlockQuantLinear expects inputs with last dim {self.in_features}, got {tuple(x.shape)}")
        x2 = x.reshape(-1, self.in_features)
        xq = self.quantize_groups(x2) if self.dynamic_activations else x2
        out = block_scaled_mm(xq, self.weight_tiles(), self.bias, x.dtype, cached=self._compute_weight())
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}x{self.block}"
