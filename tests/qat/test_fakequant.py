"""``nvfp4_fake_quant`` equals ``fp8kit.quantize(..., "nvfp4").dequantize`` bit for bit."""

from __future__ import annotations

import pytest
import torch

from fp8kit.numerics.formats import E2M1
from fp8kit.numerics.tensor import quantize
from fp8kit.qat.fakequant import nvfp4_fake_quant


def _reference(x: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return quantize(x, E2M1, "nvfp4", global_scale=g, check_scale=False).dequantize(torch.float32)


@pytest.mark.parametrize("static", [False, True])
def test_fake_quant_is_the_quantizers_dequantized_values_bit_for_bit(static: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(48, 128) * torch.logspace(-30, 30, 48).unsqueeze(1)  # block scales over the whole E4M3 range
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, 7.0, -0.25, -1.25, -5.0, 0.0, -0.0, 12.0])
    x[0, :16], x[1, :16], x[2] = ties, ties * 3, 0.0  # every rounding tie of the E2M1 grid, an all-zero row
    g = torch.tensor(float(x.abs().max()) / 2688 * 1e-3) if static else None  # static: many blocks saturate
    got, ref = nvfp4_fake_quant(x, g), _reference(x, g)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    w = torch.randn(3, 4, 32, dtype=torch.bfloat16)  # leading dims and a low-precision input
    assert torch.equal(nvfp4_fake_quant(w), _reference(w, None))


def test_fake_quant_refuses_what_the_quantizer_refuses() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_fake_quant(torch.randn(4, 24))
    x = torch.randn(2, 16)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        nvfp4_fake_quant(x)
