"""The GEMM backends behind ``fp8kit.fp8_gemm``: each computes the product of the quantized operands."""

from __future__ import annotations

import pytest
import torch

import fp8kit
from fp8kit import gemm
from fp8kit.gemm import probe


@pytest.fixture
def cpu_backend():
    saved = dict(probe._CPU_BACKEND)

    def use(name: str) -> None:
        probe._CPU_BACKEND["name"] = name

    yield use
    probe._CPU_BACKEND.clear()
    probe._CPU_BACKEND.update(saved)


def test_cpu_backend_follows_the_cpu_features():
    assert gemm.choose_cpu_backend({"avx2", "fma"}) == "fp32"
    assert gemm.choose_cpu_backend({"avx2", "avx512_bf16"}) == "bf16"
    assert gemm.choose_cpu_backend({"amx_bf16", "amx_tile"}) == "bf16"
    assert gemm.cpu_gemm_backend() == gemm.choose_cpu_backend(probe._cpu_flags())
    with pytest.raises(ValueError, match="'fp32' or 'bf16'"):
        gemm.set_cpu_gemm_backend("scaled_mm")


def test_int8_backend_follows_the_cpu_features():
    """One probe for training and inference: INT8 x INT8 through _int_mm only with 8-bit dot products."""
    assert gemm.choose_cpu_int8_backend({"avx2", "fma"}) == "float"
    for flag in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert gemm.choose_cpu_int8_backend({"avx2", flag}) == "int_mm"
    assert gemm.cpu_int8_backend() == gemm.choose_cpu_int8_backend(probe._cpu_flags())
    with pytest.raises(ValueError, match="'int_mm' or 'float'"):
        gemm.set_cpu_int8_backend("vnni")
    # the inference kernel choice reads the same probe (no timing): INT8 W8A8 on CPU
    saved = dict(probe._CPU_BACKEND)
    try:
        for backend, kernel in (("int_mm", "int_mm"), ("float", "codes_mm")):
            gemm.set_cpu_int8_backend(backend)
            assert gemm.choose_kernel(torch.int8, True, "tensor", "cpu", torch.float32, 64, 64).name == kernel
    finally:
        probe._CPU_BACKEND.update(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_codes_gives_every_code_exactly(dtype):
    """The floor's decode (FP8 through the integer-operation kernel, INT8 by conversion) equals torch's
    conversion on all 256 codes of each format, bit for bit (NaN where the format has NaN)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for code_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        got = gemm.decode_codes(codes.view(code_dtype).reshape(16, 16), dtype).reshape(-1)
        want = codes.view(code_dtype).to(dtype)
        assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.nan_to_num(0.0).view(bits), want.nan_to_num(0.0).view(bits))


@pytest.mark.compiled
@pytest.mark.parametrize("kernel", ["native", "bits"])
@pytest.mark.parametrize("mode", ["eager_ops", "kernel", "in_graph", "dequantize_tiles"])
def test_decode_gives_every_code(mode, kernel):
    """The CPU decode, with either conversion (``native``: torch's float8 conversion; ``bits``: integer
    operations and one multiply), equals ml_dtypes' value of every code bit for bit: signed zeros,
    subnormals (no flush to zero), the largest values, inf and NaN. Run as plain ops, as fp8kit's
    compiled kernel, fused into a compiled graph, and inside the tile dequantization (unit scales)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    from fp8kit.kernels import fused

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    in_graph = torch.compile(fused.decode_fp8, fullgraph=True)
    before = fused.cpu_cast_kernel()
    fused.set_cpu_cast_kernel(kernel)
    try:
        for fmt, np_dtype in ((fp8kit.E4M3, ml_dtypes.float8_e4m3fn), (fp8kit.E5M2, ml_dtypes.float8_e5m2)):
            want32 = torch.from_numpy(np.arange(256, dtype=np.uint8).view(np_dtype).astype(np.float32))
            for dtype in (torch.float32, torch.bfloat16):
                if mode == "eager_ops":
                    got = fused.decode_cpu(codes, fmt).to(dtype)
                elif mode == "dequantize_tiles":
                    got = fused.dequantize_tiles(codes.reshape(16, 16), torch.ones(1, 1), 16, 16, fmt, dtype).flatten()
                else:
                    got = (fused.decode_fp8 if mode == "kernel" else in_graph)(codes.view(fmt.dtype), fmt, dtype)
                want = want32.to(dtype)
                assert got.dtype == dtype
                assert torch.equal(got.isnan(), want.isnan())
                bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
                assert torch.equal(got.nan_to_num(0.0).view(bits), want.nan_to_num(0.0).view(bits))
                assert torch.equal(got.isinf(), want.isinf())
    finally:
        fused.set_cpu_cast_kernel(before)


@pytest.mark.parametrize("gran", ["tensor", "row"])
def test_fp32_backend_computes_the_exact_product(cpu_backend, gran):
    """Products of FP8 values are exact in FP32; only the summation order may differ from a float64
    GEMM of the same dequantized operands: error below K * 2**-24 of the sum of |products|."""
    cpu_backend("fp32")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-6, 6, (64, 1), generator=g).float())
    b = torch.randn(48, 256, generator=g)
    qa, qb = fp8kit.quantize(a, "e4m3", gran), fp8kit.quantize(b, "e5m2", gran)
    got = fp8kit.fp8_gemm(qa, qb, torch.float32)
    da, db = qa.dequantize(torch.float64), qb.dequantize(torch.float64)
    want = da @ db.t()
    bound = 256 * 2**-24 * (da.abs() @ db.abs().t())
    assert ((got.double() - want).abs() <= bound).all()
    # a wrong scale (x2) or a dropped row scale would be far outside the bound
    assert not torch.allclose(got.double() * 2, want, atol=0, rtol=1e-3)


@pytest.mark.parametrize("gran", ["tensor", "row", "mx"])
def test_bf16_backend_rounds_like_a_tensor_core_with_bf16_output(cpu_backend, gran):
    """bf16 outputs on the bf16 backend: the exact product rounded to bf16 twice at most (the sum in the
    GEMM, then after the scales), so within 2 * 2**-8 of its magnitude (bf16's unit roundoff is 2**-8). A product with a wrong scale or
    in the wrong format would be off by far more."""
    cpu_backend("bf16")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(32, 256, generator=g) * 3
    b = torch.randn(40, 256, generator=g)
    qa, qb = fp8kit.quantize(a, "e4m3", gran), fp8kit.quantize(b, "e4m3", gran)
    got = fp8kit.fp8_gemm(qa, qb, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    want = qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()
    assert ((got.double() - want).abs() <= 2**-7 * want.abs() * 1.001 + 1e-30).all()
    # power-of-two scales make the second rounding exact: one rounding of the FP32 sum, as on a GPU
    # (up to FP32 summation order, which can move a result that lies within 2**-16 of a tie)
    qa2, qb2 = (fp8kit.quantize(t, "e4m3", gran, power_of_two=True) for t in (a, b))
    got2 = fp8kit.fp8_gemm(qa2, qb2, torch.bfloat16)
    want2 = (qa2.dequantize(torch.float64) @ qb2.dequantize(torch.float64).t()).to(torch.bfloat16)
    assert (got2 == want2).float().mean() > 0.995


def test_power_of_two_block_tiles_run_a_bf16_gemm_with_one_rounding(cpu_backend, monkeypatch):
    """Block tiles with power-of-two scales (the block recipe's default) on the bf16 backend: the
    operands are dequantized to bf16 (exact there) and multiplied by a bf16 GEMM, so the result is the
    exact product rounded to bf16 once (up to FP32 summation order); without ``power_of_two`` the FP32
    GEMM runs. A wrong tile scale would miss by far more than one rounding."""
    cpu_backend("bf16")
    g = torch.Generator().manual_seed(2)
    a = torch.randn(64, 384, generator=g) * torch.exp2(
        torch.randint(-8, 8, (64, 3), generator=g).float()
    ).repeat_interleave(128, 1)
    b = torch.randn(128, 384, generator=g)
    qa = fp8kit.quantize(a, "e4m3", (1, 128), power_of_two=True)
    qb = fp8kit.quantize(b, "e4m3", (128, 128), power_of_two=True)
    seen: list[torch.dtype] = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda x, y: seen.append(x.dtype) or real(x, y))
    got = fp8kit.fp8_gemm(qa, qb, torch.bfloat16, power_of_two=True)
    fp32_path = fp8kit.fp8_gemm(qa, qb, torch.bfloat16)
    assert seen == [torch.bfloat16, torch.float32]
    want = (qa.dequantize(torch.float64) @ qb.dequantize(torch.float64).t()).to(torch.bfloat16)
    assert (got == want).float().mean() > 0.995
    da, db = qa.dequantize(torch.float64), qb.dequantize(torch.float64)
    bound = 2**-7 * want.double().abs() + 384 * 2**-24 * (da.abs() @ db.abs().t())  # one bf16 ulp + FP32 order
    assert ((got.double() - want.double()).abs() <= bound).all()
    assert (fp32_path == want).float().mean() > 0.995


def test_recipes_say_whether_their_scales_are_powers_of_two():
    """``Recipe.power_of_two_scales`` picks the CPU GEMM dtype of tile-dequantized operands: MX always,
    block by default, and a block recipe without power-of-two scales must not claim it."""
    from fp8kit.numerics.recipes import BlockScaling, CurrentScaling, DelayedScaling, MXFP8Scaling, RowwiseScaling

    assert MXFP8Scaling().power_of_two_scales and BlockScaling().power_of_two_scales
    assert not BlockScaling(power_of_two=False).power_of_two_scales
    assert CurrentScaling(power_of_two=True).power_of_two_scales and not CurrentScaling().power_of_two_scales
    assert not DelayedScaling().power_of_two_scales and not RowwiseScaling().power_of_two_scales
