"""The FP4 quantize kernels (compiled and eager) held bit-exactly to the eager reference: NVFP4 and MXFP4 codes
and scales, and the E2M1 bit cast the compiled kernels use."""

import pytest
import torch

from fp8kit import E2M1, cast, quantize
from fp8kit.kernels import fused
from fp8kit.numerics.tensor import quantize_with_transpose

CASES = [("nvfp4", "rceil"), ("mxfp4", "rceil"), ("mxfp4", "floor")]


def spread(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=g).float())
    x[1, :32] = 0.0  # an all-zero block
    x[2, 5] = 1e4  # an outlier
    return x


def assert_same(a, b):
    assert torch.equal(a.data, b.data)
    assert torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
    assert (a.global_scale is None and b.global_scale is None) or torch.equal(a.global_scale, b.global_scale)


@pytest.mark.parametrize("gran,mode", CASES)
@pytest.mark.parametrize("backend", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_kernels_match_the_reference(gran, mode, backend, dtype):
    for shape in ((256, 384), (3, 64, 96)):
        x = spread(shape[0] * (shape[1] if len(shape) == 3 else 1), shape[-1]).reshape(shape).to(dtype)
        got = quantize(x, "e2m1", gran, mx_rounding=mode, backend=backend)
        want = quantize(x, "e2m1", gran, mx_rounding=mode, backend="reference")
        assert_same(got, want)
        assert got.shape == shape


@pytest.mark.parametrize("kernel", ["native", "bits"])
def test_either_cpu_cast_setting_gives_the_reference_codes(kernel):
    """E2M1 has no torch dtype: the compiled kernels cast it with integer operations whatever the setting."""
    chosen = fused.cpu_cast_kernel()
    try:
        fused.set_cpu_cast_kernel(kernel)
        x = spread(128, 256, seed=3)
        for gran in ("nvfp4", "mxfp4"):
            assert_same(quantize(x, "e2m1", gran, backend="compiled"), quantize(x, "e2m1", gran, backend="reference"))
    finally:
        fused.set_cpu_cast_kernel(chosen)


def test_compiled_e2m1_bit_cast_matches_the_reference_cast():
    """``fused.cast_bits`` for E2M1, compiled as fp8kit compiles it and eagerly: every finite bfloat16 pattern
    (every tie, the subnormal range, far beyond max, +-0, +-inf) and random float32 bit patterns."""
    compiled = torch.compile(lambda y: fused.cast_bits(y, E2M1), dynamic=False)
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.bfloat16).float()
    rand = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    for y in (patterns, rand.view(torch.float32)):
        y = y[~torch.isnan(y)]
        want = cast(y, "e2m1")
        assert torch.equal(compiled(y), want)
        assert torch.equal(fused.cast_bits(y, E2M1), want)


@pytest.mark.parametrize("gran", ["nvfp4", "mxfp4"])
def test_inside_a_user_compiled_graph_and_the_pair(gran):
    x = spread(128, 192, seed=5)
    want = quantize(x, "e2m1", gran, backend="reference")
    traced = torch.compile(lambda t: quantize(t, "e2m1", gran, backend="compiled").dequantize())
    assert torch.equal(traced(x), want.dequantize())
    q, q_t = quantize_with_transpose(x, "e2m1", gran, backend="compiled")
    assert_same(q, want)
    assert_same(q_t, quantize(x.t().contiguous(), "e2m1", gran, backend="reference"))
