import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8kit import E4M3, E5M2, compute_scale, mx_scale
from fp8kit.numerics.scaling import MAX_SCALE, parse_granularity


def test_compute_scale_formula_and_margin():
    amax = torch.tensor([1.0, 448.0, 3.5, 1e-3])
    assert torch.equal(compute_scale(amax, E4M3), (448.0 / amax).float())
    assert torch.equal(compute_scale(amax, E4M3, margin=2), (448.0 / amax / 4).float())
    assert compute_scale(2.0, E5M2).item() == 57344.0 / 2


def test_power_of_two_rounds_down():
    s = compute_scale(torch.tensor([3.0, 448.0, 500.0]), E4M3, power_of_two=True)
    assert s.tolist() == [128.0, 1.0, 0.5]  # 149.3 -> 128, 1 -> 1, 0.896 -> 0.5


def test_degenerate_amax_rule():
    amax = torch.tensor([0.0, math.inf, -math.inf, math.nan, 1e-45, 1e-30])
    s = compute_scale(amax, E4M3)
    assert s[:4].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert s[4].item() == MAX_SCALE  # capped, so that 1/scale stays a normal float32
    assert s[5].item() == pytest.approx(448 / 1e-30, rel=1e-6)
    prev = compute_scale(amax, E4M3, previous=torch.tensor(7.0))
    assert prev[:4].tolist() == [7.0] * 4


@settings(max_examples=300, deadline=None)
@given(
    amax=st.floats(allow_nan=True, allow_infinity=True, width=32),
    margin=st.integers(0, 8),
    p2=st.booleans(),
)
def test_scale_is_always_finite_and_positive(amax, margin, p2):
    s = compute_scale(torch.tensor(abs(amax) if not math.isnan(amax) else amax), E4M3, margin, p2)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(1.0 / s).all()


def test_mx_scale_rules():
    amax = torch.tensor([1.0, 448.0, 449.0, 1.9 * 2**5, 0.0])
    floor = mx_scale(amax, E4M3, "floor")
    rceil = mx_scale(amax, E4M3, "rceil")
    # floor: scale_inv = 2**(floor(log2 amax) - 8)
    assert (1 / floor).tolist() == [2.0**-8, 2.0**0, 2.0**0, 2.0**-3, 1.0]
    # rceil: scale_inv = 2**ceil(log2(amax / 448)): amax * scale never exceeds 448
    assert (1 / rceil).tolist() == [2.0**-8, 1.0, 2.0, 2.0**-2, 1.0]
    assert ((amax * rceil) <= 448).all()
    assert (amax[2] * floor[2]) > 448  # the OCP floor rule may clip
    with pytest.raises(ValueError, match="rceil"):
        mx_scale(amax, E4M3, "nearest")


@pytest.mark.parametrize(
    "spec,kind,block",
    [
        ("tensor", "tensor", None),
        ("row", "row", None),
        ("column", "column", None),
        ((1, 128), "block", (1, 128)),
        ((128, 128), "block", (128, 128)),
        ("mx", "mx", (1, 32)),
        ([1, 64], "block", (1, 64)),
    ],
)
def test_granularity_spellings(spec, kind, block):
    g = parse_granularity(spec)
    assert g.kind == kind and g.block == block


@pytest.mark.parametrize("bad", ["rows", (0, 128), (1, 2, 3), 128, ("a", 1)])
def test_bad_granularity_is_rejected(bad):
    with pytest.raises(ValueError, match="accepted"):
        parse_granularity(bad)
