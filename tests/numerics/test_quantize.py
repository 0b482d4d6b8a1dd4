"""Round-trip accuracy of ``quantize`` at every granularity (SQNR in dB), ragged tiles, bad input."""

import math

import pytest
import torch

from fp8kit import E4M3, E5M2, INT8, cast, compute_scale, mx_scale, quantize
from tests.helpers.numerics import sqnr_db

GRANULARITIES = ["tensor", "row", "column", (1, 128), (128, 128), "mx"]
ROW_LOCAL = ["row", (1, 128), "mx"]  # one scale never spans two rows


def min_row_sqnr(ref, approx):
    return min(sqnr_db(ref[i], approx[i]) for i in range(ref.shape[0]))


@pytest.fixture
def gauss():
    return torch.randn(256, 512)


@pytest.fixture
def row_scaled():
    """Rows whose magnitudes span 2**-10 .. 2**10 (tokens of very different size)."""
    return torch.randn(256, 512) * torch.exp2(torch.randint(-10, 10, (256, 1)).float())


@pytest.mark.parametrize("gran", GRANULARITIES, ids=str)
def test_gaussian_sqnr_per_format(gauss, gran):
    # E4M3 (3 mantissa bits) reaches ~31.5 dB, E5M2 (2 bits) ~25.6 dB: the thresholds tell them apart
    e4 = sqnr_db(gauss, quantize(gauss, E4M3, gran).dequantize())
    e5 = sqnr_db(gauss, quantize(gauss, E5M2, gran).dequantize())
    assert e4 >= 30.5, e4
    assert 24.5 <= e5 <= 28.0, e5


@pytest.mark.parametrize("gran", GRANULARITIES, ids=str)
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_tile_amax_maps_to_format_max(gauss, gran, fmt):
    """A right scale sends each tile's amax to the format's max (MX: within one binade below it)."""
    q = quantize(gauss, fmt, gran)
    x2 = gauss
    br, bc = q.block
    nbr, nbc = q.scales.shape
    for i in range(nbr):
        for j in range(nbc):
            tile = q.data[i * br : (i + 1) * br, j * bc : (j + 1) * bc].float().abs().max().item()
            amax = x2[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max().item()
            s_inv = q.scale_inv[i, j].item()
            if gran == "mx":
                assert fmt.max / 2 <= tile <= fmt.max
                assert math.log2(s_inv) == round(math.log2(s_inv))  # E8M0: a power of two
            else:
                assert tile == fmt.max
                assert s_inv == pytest.approx(amax / fmt.max, rel=1e-6)
        if i > 2:
            break


@pytest.mark.parametrize("gran", GRANULARITIES, ids=str)
def test_row_scaled_data_needs_row_local_scales(row_scaled, gran):
    worst = min_row_sqnr(row_scaled, quantize(row_scaled, E4M3, gran).dequantize())
    if gran in ROW_LOCAL:
        assert worst >= 29.0, worst
    else:
        assert worst < 10.0, worst  # small rows underflow when a scale spans rows


def test_column_scaled_data_needs_column_scales(row_scaled):
    x = row_scaled.T.contiguous()
    col = quantize(x, E4M3, "column").dequantize()
    row = quantize(x, E4M3, "row").dequantize()
    assert min_row_sqnr(x.T, col.T) >= 29.0
    assert min_row_sqnr(x.T, row.T) < 10.0


@pytest.mark.parametrize("gran", GRANULARITIES, ids=str)
def test_heavy_tailed_data(gran):
    x = torch.distributions.StudentT(2.0).sample((256, 512))
    assert sqnr_db(x, quantize(x, E4M3, gran).dequantize()) >= 31.0
    assert sqnr_db(x, quantize(x, E5M2, gran).dequantize()) >= 25.0


def test_outliers_hurt_int8_per_tensor_but_not_fp8():
    x = torch.randn(256, 512)
    x[:, 7] *= 1000.0  # one outlier channel
    fp8 = sqnr_db(x[:, 8:], quantize(x, E4M3).dequantize()[:, 8:])
    int8 = sqnr_db(x[:, 8:], quantize(x, INT8).dequantize()[:, 8:])
    assert fp8 >= 30.0 and int8 < 5.0, (fp8, int8)
    assert sqnr_db(x, quantize(x, INT8, "column").dequantize()) >= 38.0


def _tile_by_tile(x, fmt, block, mx=None):
    """Obviously-correct oracle: loop over tiles, amax -> scale -> cast, no padding tricks."""
    out = torch.empty_like(x)
    br, bc = block
    for i in range(0, x.shape[0], br):
        for j in range(0, x.shape[1], bc):
            t = x[i : i + br, j : j + bc]
            amax = t.abs().max()
            s = mx_scale(amax, fmt, mx) if mx else compute_scale(amax, fmt)
            out[i : i + br, j : j + bc] = cast(t * s, fmt).float() * (1.0 / s)  # data * scale_inv
    return out


@pytest.mark.parametrize("shape", [(200, 300), (130, 100), (5, 33), (1, 129)])
@pytest.mark.parametrize(
    "gran,block,mx",
    [((1, 128), (1, 128), None), ((128, 128), (128, 128), None), ("mx", (1, 32), "rceil"), ((16, 64), (16, 64), None)],
    ids=str,
)
@pytest.mark.parametrize("backend", ["eager", "reference"])
def test_ragged_tiles_match_tile_loop(shape, gran, block, mx, backend):
    x = torch.randn(shape) * 3
    q = quantize(x, E4M3, gran, backend=backend)
    assert q.data.shape == x.shape
    assert q.scales.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    assert torch.equal(q.dequantize(), _tile_by_tile(x, E4M3, block, mx))


def test_mx_floor_can_clip_rceil_cannot():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 1.9  # amax mantissa above 1.75: the floor rule puts it above 448 -> clipped
    floor = quantize(x, E4M3, "mx", mx_rounding="floor")
    rceil = quantize(x, E4M3, "mx", mx_rounding="rceil")
    assert floor.data.float().max() == 448 and floor.dequantize()[0, 0] == 1.75
    assert rceil.dequantize()[0, 0] == 1.875  # 1.9 rounded to E4M3, not clipped
    assert floor.scales.dtype == torch.uint8 and rceil.nbytes == 32 + 1


def test_footprint_and_dtypes():
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    q = quantize(x, E4M3, (1, 128))
    assert q.data.dtype == torch.float8_e4m3fn and q.scale_inv.dtype == torch.float32
    assert q.nbytes == 256 * 512 + 256 * 4 * 4
    assert q.dequantize().dtype == torch.bfloat16 and q.dequantize(torch.float32).dtype == torch.float32
    assert quantize(x, INT8, "row").data.dtype == torch.int8


def test_nd_input_and_transpose():
    x = torch.randn(4, 8, 64)
    q = quantize(x, E4M3, "row")
    assert q.data.shape == x.shape and q.scales.shape == (32, 1)
    assert sqnr_db(x, q.dequantize()) > 30
    q2 = quantize(torch.randn(64, 256), E4M3, (1, 128))
    t = q2.t()
    assert torch.equal(t.dequantize(), q2.dequantize().t())
    assert t.block == (128, 1)


def test_static_scale():
    x = torch.randn(64, 64)
    q = quantize(x, E4M3, scale=2.0)
    assert torch.equal(q.data, cast(x * 2.0, E4M3))
    assert q.scale_inv.item() == 0.5
    with pytest.raises(ValueError, match="shape"):
        quantize(x, E4M3, "row", scale=torch.ones(3))
    with pytest.raises(ValueError, match="finite and positive"):
        quantize(x, E4M3, scale=0.0)


def test_zero_tensor_and_nonfinite_input():
    z = quantize(torch.zeros(8, 8), E4M3)
    assert z.scale_inv.item() == 1.0 and torch.equal(z.dequantize(), torch.zeros(8, 8))
    x = torch.randn(4, 64)
    x[1, 3] = math.nan
    x[2, 5] = math.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(x, E4M3, "row")
    q = quantize(x, E4M3, "row", nonfinite="propagate")
    assert torch.isfinite(q.scale_inv).all()  # never a NaN scale
    d = q.dequantize()
    assert torch.isnan(d[1, 3]) and d[2, 5] == 448  # scale 1.0 for that row; inf saturates
    assert torch.isfinite(d[0]).all() and sqnr_db(x[0], d[0]) > 30 and sqnr_db(x[3], d[3]) > 30


def test_bad_input():
    with pytest.raises(TypeError, match="high-precision"):
        quantize(torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="high-precision"):
        quantize(torch.ones(4).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="unknown format"):
        quantize(torch.ones(4), "fp4")
    with pytest.raises(ValueError, match="accepted"):
        quantize(torch.ones(4, 4), granularity="diagonal")
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(256), granularity=(128, 128))
    with pytest.raises(ValueError, match="MX granularity"):
        quantize(torch.ones(4, 32), INT8, "mx")
    with pytest.raises(ValueError, match="empty"):
        quantize(torch.ones(0, 4))
    with pytest.raises(ValueError, match="backend"):
        quantize(torch.ones(4, 4), backend="cuda")
