"""Fused (torch.compile) and eager kernels held bit-exactly against the eager reference."""

import pytest
import torch

from fp8kit import E4M3, E5M2, INT8, quantize
from fp8kit.kernels import fused
from fp8kit.kernels import grouped as kernels_grouped

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
    from fp8kit.numerics.tensor import quantize_with_transpose

    x = torch.randn(200, 96) * torch.exp2(torch.randint(-5, 5, (200, 1)).float())
    q, q_t = quantize_with_transpose(x, E4M3, gran, backend=backend)
    assert_same(q, quantize(x, E4M3, gran, backend="reference"))
    assert_same(q_t, quantize(x.t().contiguous(), E4M3, gran, backend="reference"))
    assert q_t.shape == (96, 200)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_compiled_bit_cast_matches_reference_on_every_bfloat16_and_random_bits(fmt):
    """The integer-bit cast inductor vectorizes on CPU (``fused.cast_bits``), compiled as fp8kit
    compiles it, against the reference rounding: all 65,536 bfloat16 patterns (every tie of both
    formats, subnormals, +-0, NaNs of both signs, +-inf, overflow) and random float32 bit patterns."""
    from fp8kit.numerics.formats import cast_reference

    compiled = torch.compile(lambda y: fused.cast_bits(y, fmt, view=False), dynamic=False)
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.bfloat16).float()
    rand_bits = torch.randint(
        -(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32, generator=torch.Generator().manual_seed(0)
    )
    for y in (patterns, rand_bits.view(torch.float32)):
        want = cast_reference(y, fmt, saturate=True).to(fmt.dtype).view(torch.uint8)
        assert torch.equal(compiled(y), want)
        assert torch.equal(fused.cast_bits(y, fmt, view=False), want)  # the same ops run eagerly


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_compiled_native_cast_matches_reference_on_every_bfloat16_ties_and_random_bits(fmt):
    """``fused.cast_native`` (torch's float8 conversion after a NaN-safe saturation), compiled as fp8kit
    compiles it (static and symbolic sizes) and eagerly: all bfloat16 patterns, random float32 bits and
    the midpoints between neighbouring FP8 values, against the reference cast (NaN signs included)."""
    from fp8kit.numerics.formats import cast_reference

    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    grid = grid[grid.isfinite()].sort().values
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.bfloat16).float()
    rand_bits = torch.randint(
        -(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32, generator=torch.Generator().manual_seed(2)
    ).view(torch.float32)
    casts = [torch.compile(lambda y: fused.cast_native(y, fmt, view=False), dynamic=d) for d in (False, True)]
    for y in (patterns, rand_bits, (grid[1:] + grid[:-1]) / 2):
        want = cast_reference(y, fmt, saturate=True).to(fmt.dtype).view(torch.uint8)
        for cast in [*casts, lambda y: fused.cast_native(y, fmt, view=False)]:
            assert torch.equal(cast(y), want)


@pytest.mark.parametrize("kernel", ["native", "bits"])
def test_quantize_gives_reference_codes_with_either_cpu_cast(kernel):
    """The compiled quantize kernels give the reference codes with either CPU convert, whichever
    ``choose_cpu_cast`` picked for this CPU; the rule picks ``native`` exactly on AVX-512."""
    assert fused.choose_cpu_cast("AVX512") == "native" and fused.choose_cpu_cast("AVX2") == "bits"
    assert fused.choose_cpu_cast("DEFAULT") == "bits"
    with pytest.raises(ValueError, match="'native' or 'bits'"):
        fused.set_cpu_cast_kernel("avx")
    x = torch.randn(192, 256) * torch.exp2(torch.randint(-12, 12, (192, 1)).float())
    x[3, 5], x[7, 9] = float("nan"), -float("inf")
    before = fused.cpu_cast_kernel()
    fused.set_cpu_cast_kernel(kernel)
    try:
        for gran, fmt in [("tensor", E4M3), ("row", E5M2), ((1, 128), E4M3), ("mx", E4M3)]:
            kw = {"nonfinite": "propagate"}
            assert_same(
                quantize(x, fmt, gran, backend="compiled", **kw), quantize(x, fmt, gran, backend="reference", **kw)
            )
    finally:
        fused.set_cpu_cast_kernel(before)


@pytest.mark.parametrize("kernel", ["native", "bits"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_cast_values_give_the_values_the_cast_encodes(fmt, kernel):
    """``cast_values`` (the CPU GEMM operand computed beside the cast: ``round_bits`` or the native cast
    read back) and ``round_split`` (Veltkamp's splitting) equal the reference cast's values bit for bit,
    compiled and eager, with either CPU conversion: every bfloat16 pattern, random float32 bits, and
    the exact midpoints between neighbouring FP8 values (ties to even)."""
    from fp8kit.numerics.formats import cast_reference

    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    grid = grid[grid.isfinite()].sort().values
    ties = (grid[1:] + grid[:-1]) / 2
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int16).view(torch.bfloat16).float()
    rand_bits = torch.randint(
        -(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    ).view(torch.float32)
    before = fused.cpu_cast_kernel()
    fused.set_cpu_cast_kernel(kernel)
    try:
        compiled = torch.compile(lambda y: fused.cast_values(y, fmt), dynamic=False)
        # round_split (float arithmetic only) as fp8kit compiles it: FMA contraction off
        split = torch.compile(lambda y: fused.round_split(y, fmt), dynamic=False, options=fused._compile_options())
        for y in (patterns, rand_bits, ties):
            want = cast_reference(y, fmt, saturate=True).to(fmt.dtype).float()
            for got in (compiled(y), fused.cast_values(y, fmt), split(y), fused.round_split(y, fmt)):
                assert torch.equal(got.isnan(), want.isnan())
                assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))
    finally:
        fused.set_cpu_cast_kernel(before)


@pytest.mark.parametrize("gran", ["tensor", "row"])
def test_values_beside_the_codes_in_a_compiled_graph(gran):
    """Inside a compiled CPU graph ``quantize`` also returns the unscaled values (what the GEMM reads);
    they equal the decoded codes exactly, follow ``t()``, and exist only while compiling."""
    x = torch.randn(64, 96, dtype=torch.bfloat16) * 5

    def both(t):
        q = quantize(t, E4M3, gran, backend="compiled", nonfinite="propagate")  # no data-dependent check
        return q.data.view(torch.uint8), q.values, q.t().values

    codes, values, values_t = torch.compile(both, fullgraph=True)(x)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(values.view(torch.int32), want.view(torch.int32))
    assert torch.equal(values_t, values.t())
    assert quantize(x, E4M3, gran, backend="compiled").values is None


def test_eager_kernel_traced_inside_a_user_compiled_graph_keeps_the_float8_dtype():
    """Traced by someone else's ``torch.compile`` the eager kernel casts with ``cast_bits`` and
    returns float8 (not the uint8 codes fp8kit's own compiled kernels hand back)."""
    from fp8kit.kernels import BlockSpec

    x = torch.randn(64, 256) * 3
    spec = BlockSpec(E4M3, (1, 128))
    data, scale, amax = torch.compile(lambda t: fused.quantize_blocks_eager(t, spec), dynamic=False)(x)
    ref = quantize(x, E4M3, (1, 128), backend="reference")
    assert data.dtype == torch.float8_e4m3fn
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))


def test_compile_failure_raises_in_strict_mode_and_warns_otherwise(monkeypatch):
    """Tests run strict (conftest): a kernel that fails to compile fails the test instead of silently
    running eager. Outside strict mode the library warns and falls back to the eager kernels."""

    def broken(kind):
        def fn(*args):
            raise RuntimeError("no C++ compiler")

        return fn

    monkeypatch.setattr(fused, "_compiled", broken)
    x = torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="strict"):
        quantize(x, E4M3, "row", backend="compiled")
    fused.set_compile_strict(False)
    try:
        with pytest.warns(UserWarning, match="using eager kernels"):
            q = quantize(x, E4M3, "row", backend="compiled")
        assert_same(q, quantize(x, E4M3, "row", backend="reference"))
    finally:
        fused.set_compile_strict(True)
        fused.set_compile_enabled(True)  # the fallback switched compilation off process-wide


def test_leading_amax_gives_each_experts_abs_max():
    """``leading_amax`` (eagerly one ``aminmax`` pass per leading index for few large ones, else
    ``abs().amax``; a reduction compiled) is ``x[i].abs().max()`` as float32 for each ``i``: an
    all-negative expert, NaN (propagates to that expert only), -inf, an all-zero expert with -0.0
    (gives +0.0), bfloat16; small experts and experts of 2**16 elements (the aminmax loop)."""
    from fp8kit.numerics.tensor import leading_amax

    for shape in [(5, 8, 16), (5, 256, 256)]:
        w = torch.randn(*shape, dtype=torch.bfloat16) * 10
        w[0] = -w[0].abs() - 1
        w[1, 2, 3] = float("nan")
        w[2, 0, 0] = float("-inf")
        w[3] = -0.0
        want = w.float().abs().amax(dim=(1, 2))
        for got in (leading_amax(w), torch.compile(leading_amax, fullgraph=True)(w), leading_amax(w.float())):
            assert got.dtype == torch.float32 and got.shape == (5,)
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
            assert not got[3].signbit()


def test_tensor_amax_eager_and_compiled_agree_with_abs_max():
    """``tensor_amax`` (one ``aminmax`` pass eagerly, the kernels' row-then-all reduction compiled) is
    max|x| as float32: all-negative tensors, NaN (propagates), -inf, -0.0 (gives +0.0), bfloat16."""
    from fp8kit.numerics.tensor import tensor_amax

    compiled = torch.compile(tensor_amax, fullgraph=True)
    cases = [
        torch.randn(33, 17),
        -torch.rand(4, 9) - 1,
        torch.tensor([[1.0, float("nan")], [2.0, 3.0]]),
        torch.tensor([[float("-inf"), 1.0]]),
        torch.tensor([-0.0, -0.0]),
        torch.tensor(-3.5),
        torch.randn(8, 64, dtype=torch.bfloat16) * 100,
    ]
    for x in cases:
        want = x.float().abs().max()
        for got in (tensor_amax(x), compiled(x)):
            assert got.dtype == torch.float32
            assert torch.equal(got, want) or (want.isnan() and got.isnan()), (x, got, want)
            assert want.isnan() or not torch.signbit(got)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _awkward(*shape):
    """Random values over many binades, with a NaN, an inf and a signed zero."""
    x = torch.randn(*shape) * torch.exp2(torch.randint(-20, 20, shape).float())
    flat = x.view(-1)
    flat[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    return x


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_compiled_gemm_epilogue_matches_the_eager_float32_products(out_dtype):
    """``scale_output`` (the grouped GEMMs' epilogue, one compiled loop) gives the bits of the eager
    ``(acc.float() * s1 * s2[ids]).to(dtype)`` it replaced, for per-tensor, per-row and per-group scales."""
    acc = _awkward(96, 48).to(out_dtype)
    ids = torch.randint(0, 5, (96,))
    cases = [
        (torch.rand(1, 1) * 3, torch.rand(5, 1) * 1e-3, ids),  # per-tensor x, one scale per expert
        (torch.rand(96, 1), torch.rand(5, 48), ids),  # row-wise: per-row x, per-expert per-channel w
        (torch.rand(()), None, None),  # per-tensor weight gradient
    ]
    for s1, s2, i in cases:
        want = acc.float() * s1
        want = (want if s2 is None else want * s2[i]).to(out_dtype)
        got = fused.scale_output(acc, s1, s2, i, out_dtype)
        assert got.dtype == out_dtype and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("block", [(1, 128), (1, 32), (128, 128)], ids=str)
def test_compiled_tile_dequantization_matches_the_expanded_scale_grid(fmt, block):
    """``dequantize_tiles`` reads each tile's scale in the loop; it equals the product with the scale
    grid expanded by ``repeat_interleave`` (the former eager code), ragged edge tiles and a 3-D
    (per-expert) operand included, transposed views too."""
    codes = torch.randint(0, 256, (3, 200, 192), dtype=torch.uint8)
    br, bc = block
    scale_inv = torch.exp2(torch.randint(-10, 10, (3, -(-200 // br), -(-192 // bc))).float())
    for c, s, (b0, b1) in [(codes, scale_inv, block), (codes.transpose(1, 2), scale_inv.transpose(1, 2), block[::-1])]:
        r, k = c.shape[-2:]
        grid = s.repeat_interleave(b0, -2)[..., :r, :].repeat_interleave(b1, -1)[..., :k]
        for dtype in (torch.bfloat16, torch.float32):
            want = (c.view(fmt.dtype).float() * grid).to(dtype)
            got = fused.dequantize_tiles(c, s, b0, b1, fmt, dtype)
            assert got.is_contiguous() and torch.equal(got.isnan(), want.isnan())
            assert torch.equal(_bits(got)[~want.isnan()], _bits(want)[~want.isnan()])


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_compiled_scaled_cast_matches_the_eager_cast(fmt):
    """``cast_scaled`` (row-wise group columns: ``x * scale[group]`` cast in one loop) gives the codes of
    ``formats.cast`` on the eager product, NaN, inf and signed zero included."""
    from fp8kit.numerics.formats import cast

    x = _awkward(120, 40).bfloat16()
    ids = torch.randint(0, 4, (120,))
    scale = torch.exp2(torch.randint(-8, 8, (4, 40)).float()) * 1.37
    want = cast(x.float() * scale[ids], fmt)
    got = kernels_grouped.cast_scaled(x, scale, ids, fmt)
    assert got.dtype == fmt.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kernel", ["native", "bits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_values_written_beside_the_codes_are_the_codes_values(kernel, dtype):
    """``quantize(values=dtype)`` (CPU, compiled kernel): the codes and scales are the reference's, and
    ``values`` are exactly the codes' unscaled values in ``dtype`` (NaN, saturated inf, subnormals), for
    one scale, row scales, scales per group of rows (an expert's weight) and a static scale; tiles that
    do not span whole rows (1x128, MX) and INT8 get no values (the GEMM decodes them)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 256, generator=g) * torch.exp2(torch.randint(-14, 10, (96, 1), generator=g).float())
    x[3, 5], x[7, 9], x[50, 0] = float("nan"), -float("inf"), 2.0**-20
    before = fused.cpu_cast_kernel()
    fused.set_cpu_cast_kernel(kernel)
    try:
        for gran, fmt, scale in [
            ("tensor", E4M3, None),
            ("row", E5M2, None),
            ((32, 256), E4M3, None),
            ("tensor", E5M2, torch.tensor(3.0)),
            ((32, 256), E4M3, torch.tensor([[2.0], [0.5], [7.0]])),
        ]:
            kw = {"nonfinite": "propagate", "scale": scale}
            q = quantize(x.bfloat16(), fmt, gran, backend="compiled", values=dtype, **kw)
            assert_same(q, quantize(x.bfloat16(), fmt, gran, backend="reference", **kw))
            want = q.data.float().to(dtype)
            assert q.values is not None and q.values.dtype == dtype and q.values.shape == x.shape
            assert torch.equal(q.values.isnan(), want.isnan())
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert torch.equal(q.values.nan_to_num(0.0).view(bits), want.nan_to_num(0.0).view(bits))
            # lazy_codes: the kernel writes only the values; the codes come from them on first read
            lazy = quantize(x.bfloat16(), fmt, gran, backend="compiled", values=dtype, lazy_codes=True, **kw)
            assert lazy.codes is None and lazy.shape == x.shape and lazy.nbytes == q.nbytes
            assert torch.equal(lazy.values.view(bits), q.values.view(bits)) and torch.equal(lazy.scales, q.scales)
            assert lazy.t().codes is None and torch.equal(lazy.t().values.view(bits), q.values.t().view(bits))
            assert torch.equal(lazy.data.view(torch.uint8), q.data.view(torch.uint8)) and lazy.codes is not None
            # a known amax (delayed scaling reduces first): the kernel reads x once, same result
            known = quantize(x.bfloat16(), fmt, gran, backend="compiled", values=dtype, amax=q.amax * 1, **kw)
            assert_same(known, q)
            assert torch.equal(known.values.view(bits), q.values.view(bits))
            torch.testing.assert_close(known.amax, q.amax, rtol=0, atol=0, equal_nan=True)
        for gran, fmt in [((1, 128), E4M3), ("mx", E4M3), ("tensor", INT8)]:
            q = quantize(x, fmt, gran, backend="compiled", values=dtype, lazy_codes=True, nonfinite="propagate")
            assert q.values is None and q.codes is not None  # no values: the codes are written as ever
    finally:
        fused.set_cpu_cast_kernel(before)
    with pytest.raises(ValueError, match="values must be"):
        quantize(x, E4M3, "tensor", backend="compiled", values=torch.float16, nonfinite="propagate")
    with pytest.raises(ValueError, match="drop amax="):
        quantize(x, E4M3, "row", amax=torch.ones(3), nonfinite="propagate")
    with pytest.raises(ValueError, match="drop amax="):
        quantize(x, E4M3, (1, 128), amax=torch.ones(96), nonfinite="propagate")
