"""Fused (torch.compile) and eager kernels held bit-exactly against the eager reference."""

import pytest
import torch

from fp8kit import E4M3, E5M2, INT8, quantize
from fp8kit.kernels import fused

CASES = [
    ("tensor", E4M3),
    ("row", E4M3),
    ((1, 128), E4M3),
    ((128, 128), E4M3),
    ("mx", E4M3),
    ("tensor", E5M2),
    ("column", INT8),
]


def assert_same(a, b):
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("gran,fmt", CASES, ids=str)
@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_fast_matches_reference_bit_exactly(gran, fmt, backend):
    x = torch.randn(256, 384) * torch.exp2(torch.randint(-6, 6, (256, 1)).float())
    assert_same(quantize(x, fmt, gran, backend=backend), quantize(x, fmt, gran, backend="reference"))


@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_ragged_and_low_precision_inputs(backend):
    x = (torch.randn(200, 300) * 5).to(torch.bfloat16)
    for gran in [(1, 128), (128, 128), "mx"]:
        assert_same(quantize(x, E4M3, gran, backend=backend), quantize(x, E4M3, gran, backend="reference"))


def test_compile_can_be_switched_off():
    x = torch.randn(64, 64)
    fused.set_compile_enabled(False)
    try:
        assert_same(quantize(x, backend="compiled"), quantize(x, backend="reference"))
    finally:
        fused.set_compile_enabled(True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gran", ["tensor", "row", (1, 128), (128, 128), "mx"], ids=str)
def test_cuda_matches_cpu_reference(gran):
    x = torch.randn(512, 384)
    ref = quantize(x, E4M3, gran, backend="reference")
    got = quantize(x.cuda(), E4M3, gran, backend="compiled")
    assert torch.equal(got.data.cpu().view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.scales.cpu(), ref.scales)


@pytest.mark.parametrize("gran", ["row", (1, 128), "mx", (128, 128)], ids=str)
@pytest.mark.parametrize("backend", ["eager", "compiled"])
def test_quantize_with_transpose_matches_two_quantizes(gran, backend):
    from fp8kit.tensor import quantize_with_transpose

    x = torch.randn(200, 96) * torch.exp2(torch.randint(-5, 5, (200, 1)).float())
    q, q_t = quantize_with_transpose(x, E4M3, gran, backend=backend)
    assert_same(q, quantize(x, E4M3, gran, backend="reference"))
    assert_same(q_t, quantize(x.t().contiguous(), E4M3, gran, backend="reference"))
    assert q_t.shape == (96, 200)
