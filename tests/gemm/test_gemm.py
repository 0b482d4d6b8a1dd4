"""The CPU FP8 GEMM emulation equals a float64 GEMM of the same quantized operands."""

import pytest
import torch

from fp8kit import E4M3, E5M2, fp8_gemm, quantize

CASES = [("tensor", "tensor"), ("row", "row"), ((1, 128), (128, 128)), ("mx", "mx"), ((1, 128), (1, 128))]


@pytest.mark.parametrize("ga,gb", CASES, ids=str)
@pytest.mark.parametrize("fa,fb", [(E4M3, E4M3), (E5M2, E4M3)], ids=str)
def test_emulated_gemm_matches_float64(ga, gb, fa, fb):
    a = torch.randn(96, 320) * torch.exp2(torch.randint(-4, 4, (96, 1)).float())
    b = torch.randn(80, 320)
    qa, qb = quantize(a, fa, ga), quantize(b, fb, gb)
    ref = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    got = fp8_gemm(qa, qb, torch.float32).double()
    # FP32 accumulation of exact products: error bounded by K * 2**-24 * sum|a||b| (summation order)
    bound = 320 * 2.0**-24 * (qa.dequantize(torch.float64).abs() @ qb.dequantize(torch.float64).abs().t())
    assert ((got - ref).abs() <= bound + 1e-30).all()
    # and it is close to the exact result in relative terms
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6


def test_fp8_values_and_products_are_exact_in_fp32_and_bf16():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = codes.view(dt).float()
        v = v[torch.isfinite(v)]
        assert torch.equal(v.to(torch.bfloat16).float(), v)  # every FP8 value is a bfloat16 value
        prod32 = v[:, None] * v[None, :]
        prod64 = v.double()[:, None] * v.double()[None, :]
        assert torch.equal(prod32.double(), prod64)  # every product is exact in float32


def test_gemm_shape_errors():
    qa = quantize(torch.randn(4, 8))
    qb = quantize(torch.randn(4, 16))
    with pytest.raises(ValueError, match="same K"):
        fp8_gemm(qa, qb)
