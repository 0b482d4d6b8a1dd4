"""Bit-exact casts against ml_dtypes (an independent implementation) and torch's own dtypes."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8kit
from fp8kit import E4M3, E5M2, E8M0, INT8, cast
from fp8kit.numerics.formats import cast_reference, e8m0_decode, e8m0_encode

NP = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
FP8 = [E4M3, E5M2]


pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast")


def oracle(x: torch.Tensor, fmt, saturate: bool) -> np.ndarray:
    """ml_dtypes cast; the saturating variant clips first (NaN passes through np.clip)."""
    a = x.numpy()
    if saturate:
        a = np.clip(a, -fmt.max, fmt.max)
    return a.astype(NP[fmt.name])


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray):
    ours_f = ours.float().numpy()
    ref_f = ref.astype(np.float32)
    nan_ours, nan_ref = np.isnan(ours_f), np.isnan(ref_f)
    assert (nan_ours == nan_ref).all(), f"NaN mismatch at {np.flatnonzero(nan_ours != nan_ref)[:5]}"
    ours_bits = ours.view(torch.uint8).numpy()[~nan_ours]
    ref_bits = ref.view(np.uint8)[~nan_ref]
    bad = np.flatnonzero(ours_bits != ref_bits)
    assert bad.size == 0, (
        f"{bad.size} codes differ, first inputs: {ours_f[~nan_ours][bad[:5]]} vs {ref_f[~nan_ref][bad[:5]]}"
    )


def all_bf16_values() -> torch.Tensor:
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def test_format_constants_match_torch_and_ml_dtypes():
    for fmt in FP8:
        fi = torch.finfo(fmt.dtype)
        assert fmt.max == fi.max
        assert fmt.min_normal == fi.smallest_normal
        mi = ml_dtypes.finfo(NP[fmt.name])
        assert fmt.min_subnormal == float(mi.smallest_subnormal)
    assert E4M3.max == 448 and E5M2.max == 57344
    assert E4M3.bias == 7 and E5M2.bias == 15
    assert E4M3.binades == pytest.approx(math.log2(448 / 2**-9))
    assert INT8.max == 127 and E8M0.bias == 127


@pytest.mark.parametrize("fmt", FP8, ids=str)
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_every_bfloat16_pattern_bit_exact(fmt, saturate, path):
    x = all_bf16_values()
    ours = (
        cast(x, fmt, saturate=saturate) if path == "fast" else cast_reference(x, fmt, saturate=saturate).to(fmt.dtype)
    )
    assert_bits_equal(ours, oracle(x, fmt, saturate))


@pytest.mark.parametrize("fmt", FP8, ids=str)
@pytest.mark.parametrize("saturate", [True, False])
def test_dense_random_float32_bit_exact(fmt, saturate):
    g = torch.Generator().manual_seed(1)
    # random bit patterns cover every exponent; add values concentrated in the format's range
    bits = torch.randint(-(2**31), 2**31 - 1, (400_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = torch.cat(
        [
            bits.view(torch.float32),
            torch.randn(400_000, generator=g) * fmt.max / 4,
            torch.rand(100_000, generator=g) * fmt.min_normal * 2,
        ]
    )
    assert_bits_equal(cast(x, fmt, saturate=saturate), oracle(x, fmt, saturate))


@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_all_256_codes_round_trip(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype)
    values = codes.float()
    ref = np.arange(256, dtype=np.uint8).view(NP[fmt.name]).astype(np.float32)
    np.testing.assert_array_equal(values.numpy(), ref)  # decoding agrees with ml_dtypes
    finite = torch.isfinite(values)
    back = cast(values, fmt, saturate=False)
    assert torch.equal(back.view(torch.uint8)[finite], codes.view(torch.uint8)[finite])
    assert torch.isnan(back.float()[torch.isnan(values)]).all()


@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_every_tie_rounds_to_even(fmt):
    codes = torch.arange(0, 128, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    pos = codes[torch.isfinite(codes)].double()
    mids = ((pos[1:] + pos[:-1]) / 2).float()  # midpoints are exact in float32
    for sign in (1.0, -1.0):
        x = sign * mids
        ours = cast(x, fmt, saturate=False)
        assert_bits_equal(ours, oracle(x, fmt, False))
        assert (ours.view(torch.uint8) & 1 == 0).all(), "a tie did not round to the even code"


@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_special_values(fmt):
    sub = fmt.min_subnormal
    x = torch.tensor(
        [
            0.0,
            -0.0,
            sub / 2,
            sub / 2 * (1 + 2**-20),
            -sub / 2,
            sub * 1.5,
            fmt.min_normal - sub / 2,
            math.inf,
            -math.inf,
            math.nan,
            fmt.max,
            fmt.overflow_threshold,
            -fmt.overflow_threshold,
        ]
    )
    sat = cast(x, fmt).float()
    assert sat[0] == 0 and not torch.signbit(sat[0]) and torch.signbit(sat[1])
    assert sat[2] == 0 and sat[3] == sub and sat[4] == 0 and torch.signbit(sat[4])
    assert sat[5] == 2 * sub  # tie between 1 and 2 subnormal units -> even (2)
    assert sat[6] == fmt.min_normal
    assert sat[7] == fmt.max and sat[8] == -fmt.max and torch.isnan(sat[9])
    non = cast(x, fmt, saturate=False).float()
    if fmt is E4M3:
        assert torch.isnan(non[7]) and torch.isnan(non[8])
        assert non[11] == 448  # 464 is a tie; 448 has the even mantissa
    else:
        assert non[7] == math.inf and non[8] == -math.inf
        assert non[11] == math.inf and non[12] == -math.inf  # 61440 ties up to infinity
    assert_bits_equal(cast(x, fmt, saturate=False), oracle(x, fmt, False))


def test_low_precision_and_float64_inputs():
    x = torch.randn(10_000) * 100
    for dt in (torch.bfloat16, torch.float16):
        xi = x.to(dt)
        assert_bits_equal(cast(xi, E4M3), oracle(xi.float(), E4M3, True))
    # float64: one rounding, not float64 -> float32 -> fp8 (torch's own conversion rounds twice here)
    tricky = torch.tensor([1.0625 + 2**-40, -(1.0625 + 2**-40), 1.0625], dtype=torch.float64)
    assert cast(tricky, E4M3).float().tolist() == [1.125, -1.125, 1.0]
    xd = torch.randn(50_000, dtype=torch.float64) * 10
    ref = np.clip(xd.numpy(), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert_bits_equal(cast(xd, E4M3), ref)


@pytest.mark.parametrize("fmt", FP8, ids=str)
def test_stochastic_rounding_is_unbiased_and_reproducible(fmt):
    values = torch.tensor([1.3, -2.71, 0.1, fmt.min_subnormal * 0.3, 100.7, -fmt.max * 0.93])
    n = 20_000
    x = values.repeat(n, 1)
    g = torch.Generator().manual_seed(123)
    q = cast(x, fmt, rounding="stochastic", generator=g).float()
    mean = q.double().mean(0)
    for j, v in enumerate(values.tolist()):
        support = torch.unique(q[:, j])
        assert 1 <= support.numel() <= 2, f"stochastic rounding of {v} hit {support.tolist()}"
        gap = float((support.max() - support.min()).abs()) or 1.0
        bound = 5 * gap / (2 * math.sqrt(n))  # 5 standard deviations of the sample mean
        assert abs(mean[j].item() - v) <= bound, f"mean {mean[j].item()} vs {v} (bound {bound})"
    q2 = cast(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(123))
    assert torch.equal(q, q2.float())
    q3 = cast(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(7)).float()
    assert not torch.equal(q, q3)


def test_stochastic_exact_values_never_move():
    codes = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    q = cast(codes.repeat(50, 1), E4M3, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    assert torch.equal(q.float(), codes.repeat(50, 1))


def test_int8_cast_is_symmetric_round_half_even():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.6, 200.0, -200.0, -127.9])
    assert cast(x, INT8).tolist() == [0, 2, 2, 0, -2, 127, 127, -127, -127]
    assert cast(x, "int8").dtype == torch.int8


def test_e8m0_codes():
    s = torch.tensor([1.0, 2.0**-127, 2.0**127, 0.5, 2.0**10])
    codes = e8m0_encode(s)
    assert codes.tolist() == [127, 0, 254, 126, 137]
    assert torch.equal(e8m0_decode(codes), s)
    assert torch.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()
    if hasattr(torch, "float8_e8m0fnu"):  # torch's own E8M0 dtype agrees
        assert torch.equal(codes.view(torch.float8_e8m0fnu).float(), s)


def test_bad_input_errors():
    with pytest.raises(TypeError, match="high-precision float"):
        cast(torch.arange(4), E4M3)
    with pytest.raises(TypeError, match="high-precision float"):
        cast(torch.zeros(4, dtype=torch.complex64), E4M3)
    with pytest.raises(TypeError, match="high-precision float"):
        cast(torch.zeros(4).to(torch.float8_e4m3fn), E4M3)
    with pytest.raises(ValueError, match="unknown format"):
        cast(torch.zeros(4), "e3m4")
    with pytest.raises(ValueError, match="rounding"):
        cast(torch.zeros(4), E4M3, rounding="up")
    with pytest.raises(ValueError, match="element format"):
        cast(torch.zeros(4), E8M0)
    assert fp8kit.get_format("E4M3") is E4M3 and fp8kit.get_format(torch.float8_e5m2) is E5M2
