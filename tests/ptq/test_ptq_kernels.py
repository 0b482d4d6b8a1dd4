"""PTQ inference kernels: every 8-bit GEMM path of ``QuantLinear`` equals the FP32-upcast reference.

Bound (see ``fp8kit.ptq.linear``): code products are exact in FP32, so two paths differ by FP32
summation order only, ``|out - ref| <= 2 * gamma_{K+2} * (|codes_x| @ |codes_w|^T) * s_x * s_w``, plus
one bfloat16 rounding of the accumulator where a bfloat16 GEMM writes bfloat16 (bfloat16 inputs) and,
on CUDA, the FP8 tensor cores' fast accumulation (about 14 significant bits between promotions).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import fp8kit.gemm.codes as gemm_codes
from fp8kit import E4M3, INT8
from fp8kit.gemm import probe
from fp8kit.numerics.formats import cast_reference
from fp8kit.ptq import QuantLinear, resident_bytes, set_weight_cache
from fp8kit.ptq.linear import KernelChoice, dequant_scale, select_kernel

SCHEMES = ["fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"]
CPU_KERNELS = {
    "fp8": ["codes_mm"],
    "fp8-dynamic": ["codes_mm"],
    "int8-smoothquant": ["codes_mm", "int_mm"],
    "int8-weight-only": ["codes_mm"],
}


def _layer(scheme: str, k: int = 96, n: int = 80, bias: bool = True, device: str = "cpu") -> QuantLinear:
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.exp2(torch.randint(-3, 3, (n, 1)).float()))  # rows of different ranges
    return QuantLinear.from_linear(lin, scheme, input_amax=4.0).to(device)


def _inputs(m: int, k: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    x = torch.randn(m, k) * torch.exp2(torch.randint(-2, 2, (m, 1)).float())
    return x.to(device=device, dtype=dtype)


def _bound(q: QuantLinear, x: torch.Tensor, extra_rel: float) -> torch.Tensor:
    """Per-element bound on ``|kernel - reference|`` (float64)."""
    x2 = x.reshape(-1, q.in_features)
    k = q.in_features + 2
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    ws = q.weight_scale.double().reshape(1, -1)
    if q.scheme.act_format is None:
        mag = x2.double().abs() @ q.weight.double().abs().t() * ws
    else:
        xq, sx = q.quantize_input(x2)
        mag = xq.double().abs() @ q.weight.double().abs().t() * sx.double().reshape(-1, 1) * ws
    ref = q._forward_reference(x).double().reshape(mag.shape)
    out_ulp = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}[x.dtype]  # one rounding of the output
    return (2 * gamma + extra_rel) * mag + out_ulp * ref.abs() + 1e-30


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weight_and_input_scales_are_amax_over_format_max(scheme):
    lin = nn.Linear(96, 80)
    q = QuantLinear.from_linear(lin, scheme, input_amax=3.7)
    fmt = q.scheme.weight_format
    w = lin.weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True) if q.scheme.weight_strategy == "channel" else w.abs().amax().reshape(1)
    assert torch.equal(q.weight_scale, (amax / fmt.max).reshape(q.weight_scale.shape))  # float32, bit for bit
    assert q.weight.dtype == fmt.dtype and q.weight_scale.dtype == torch.float32
    if q.scheme.static_activations:
        assert q.input_scale.shape == (1,) and q.input_scale.dtype == torch.float32
        assert torch.equal(q.input_scale, torch.tensor([3.7]) / q.scheme.act_format.max)
    # codes are the round-to-nearest codes of w / scale (an independent float64 oracle)
    oracle = cast_reference((w.double() * (fmt.max / amax.double().reshape(-1, 1))).float(), fmt, saturate=True)
    assert torch.equal(q.weight.float(), oracle.float())


@pytest.mark.parametrize("fmt", [E4M3, INT8], ids=["e4m3", "int8"])
def test_all_zero_rows_get_a_finite_scale_and_zero_output(fmt):
    scheme = "fp8-dynamic" if fmt is E4M3 else "int8-smoothquant"
    lin = nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight[3] = 0.0
        lin.bias.zero_()
    q = QuantLinear.from_linear(lin, scheme, input_amax=2.0)
    assert torch.isfinite(q.weight_scale).all() and (q.weight_scale > 0).all()
    assert float(q.weight_scale[3]) == 1.0 and not q.weight[3].float().any()
    assert torch.equal(dequant_scale(torch.tensor([0.0, 448.0, float("inf")]), E4M3), torch.tensor([1.0, 1.0, 1.0]))
    x = _inputs(8, 64, torch.float32)
    x[2] = 0.0  # an all-zero token (per-token scale from amax 0)
    for kernel in CPU_KERNELS[scheme] + ["reference"]:
        q.kernel = kernel
        out = q(x)
        assert torch.isfinite(out).all() and not out[:, 3].any() and not out[2].any()


@pytest.mark.parametrize("cache", ["lean", "cached"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cpu_kernels_equal_the_reference(scheme, dtype, cache, small_tiles):
    q = _layer(scheme)
    q.weight_cache = cache
    for m in (1, 7, 33):
        x = _inputs(m, q.in_features, dtype).reshape(1, m, -1)
        ref = q._forward_reference(x)
        for kernel in CPU_KERNELS[scheme]:
            q.kernel = kernel
            out = q(x)
            assert out.shape == ref.shape and out.dtype == dtype
            diff = (out.double() - ref.double()).abs().reshape(m, -1)
            bound = _bound(q, x, 2.0**-8 if dtype == torch.bfloat16 else 0.0)
            assert (diff <= bound).all(), f"{kernel}: max excess {float((diff - bound).max())}"
    # the bound is tight enough to catch a wrong scale: the kernel output scaled by 1 + 2**-6 fails it
    q.kernel = CPU_KERNELS[scheme][-1]
    x = _inputs(16, q.in_features, torch.float32)
    bad = (q(x).double() - q.bias.double()) * (1 + 2.0**-6) + q.bias.double()
    assert ((bad - q._forward_reference(x).double()).abs() > _bound(q, x, 0.0)).any()


@pytest.mark.parametrize(
    "scheme,kernel",
    [("fp8", "scaled_mm"), ("fp8-dynamic", "scaled_mm_rowwise"), ("int8-weight-only", "dequant_mm_compiled")],
)
def test_cuda_kernel_code_runs_through_cpu_torch(scheme, kernel):
    """The CUDA kernels' calls (``torch._scaled_mm`` argument layout, scales, the compiled dequant GEMM)
    run on CPU torch's implementations of the same ops: without a GPU, CI still checks the code."""
    q = _layer(scheme, k=64, n=48)
    q.kernel = kernel
    for m in (1, 17):
        x = _inputs(m, 64, torch.bfloat16)
        diff = (q(x).double() - q._forward_reference(x).double()).abs()
        assert (diff <= _bound(q, x, 2.0**-8)).all()


def test_int_mm_accumulator_is_bit_exact_and_output_equals_reference():
    """INT8 x INT8 in int32 is exact; with K * 127**2 < 2**24 the FP32 reference accumulator is exact
    too, so the two accumulators and the scaled outputs agree bit for bit."""
    q = _layer("int8-smoothquant", k=256, n=64)
    x = _inputs(40, 256, torch.float32)
    xq, _ = q.quantize_input(x)
    assert torch.equal(torch._int_mm(xq, q.weight.t()).float(), xq.float() @ q.weight.float().t())
    q.kernel = "int_mm"
    assert torch.equal(q(x), q._forward_reference(x))


def test_compiled_epilogue_for_large_outputs_equals_the_reference():
    """Outputs of at least ``COMPILE_MIN_ELEMENTS`` get the torch.compile'd scale/bias epilogue (one fused
    loop; it may contract multiply-add into an FMA, one FP32 rounding fewer than the reference)."""
    from fp8kit.gemm import scaled

    q = _layer("int8-smoothquant", k=64, n=256)
    x = _inputs(scaled.COMPILE_MIN_ELEMENTS // 256, 64, torch.float32)
    q.kernel = "int_mm"
    out = q(x)
    assert scaled.use_compiled(scaled.COMPILE_MIN_ELEMENTS), "the epilogue failed to compile"
    diff = (out.double() - q._forward_reference(x).double()).abs()
    assert (diff <= _bound(q, x, 2.0**-23)).all()


def test_cpu_selection_is_logged_and_matches_reference(caplog, monkeypatch):
    from fp8kit.ptq import linear as ptq_linear

    monkeypatch.setattr(ptq_linear, "_LOGGED", set())  # logged once per process: start afresh
    for scheme in SCHEMES:
        q = _layer(scheme)
        x = _inputs(5, q.in_features, torch.float32)
        with caplog.at_level(logging.INFO, logger="fp8kit.ptq"):
            choice = q.kernel_for(x)
            out = q(x)
        assert choice.name in CPU_KERNELS[scheme] and choice.reason
        assert ((out.double() - q._forward_reference(x).double()).abs() <= _bound(q, x, 0.0)).all()
    assert "kernel" in caplog.text


def test_codes_cache_follows_the_weight():
    q = _layer("fp8")
    q.kernel, q.weight_cache = "codes_mm", "cached"
    x = _inputs(4, q.in_features, torch.float32)
    q(x)
    other = _layer("fp8")
    q.load_state_dict(other.state_dict())  # in-place copy: the cached codes must be rebuilt
    assert torch.equal(q(x), other._forward_reference(x))
    q.weight = (-other.weight.float()).to(torch.float8_e4m3fn)  # a new tensor
    assert torch.equal(q(x), q._forward_reference(x))


def test_odd_shapes_fall_back_on_cuda_with_a_reason():
    c = select_kernel("fp8", "cuda", torch.bfloat16, 100, 64)
    assert c.name == "reference" and "multiples of 16" in c.reason
    c = select_kernel("int8-smoothquant", "cuda", torch.bfloat16, 64, 36)
    assert c.name == "reference" and "multiples of 8" in c.reason
    c = select_kernel("fp8-dynamic", "cuda", torch.float32, 64, 64)
    assert c.name == "reference" and "bfloat16" in c.reason
    assert select_kernel("fp8", "cuda", torch.bfloat16, 64, 64).name == "scaled_mm"
    assert select_kernel("fp8-dynamic", "cuda", torch.bfloat16, 64, 64).name == "scaled_mm_rowwise"
    assert select_kernel("int8-smoothquant", "cuda", torch.bfloat16, 64, 64).name == "int_mm"
    assert select_kernel("int8-weight-only", "cuda", torch.bfloat16, 64, 64).name == "dequant_mm_compiled"


def test_a_failing_kernel_falls_back_to_the_reference(monkeypatch, caplog):
    q = _layer("int8-smoothquant")
    x = _inputs(6, q.in_features, torch.float32)
    monkeypatch.setattr("fp8kit.ptq.linear.select_kernel", lambda *a, **k: KernelChoice("int_mm", "test"))

    def broken(*_a, **_k):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(torch, "_int_mm", broken)
    with caplog.at_level(logging.WARNING, logger="fp8kit.ptq"):
        out = q(x)
    assert torch.equal(out, q._forward_reference(x)) and "int_mm failed" in caplog.text
    assert q.kernel_for(x).name == "reference"  # remembered: no second attempt
    q.kernel = "int_mm"  # forced kernels raise instead of falling back
    with pytest.raises(RuntimeError, match="no kernel image"):
        q(x)


# -- lean (codes-only) vs cached weights on CPU ----------------------------------------------------------


@pytest.fixture
def small_tiles(monkeypatch):
    """Lean tiles of 16 rows for K = 96 (layers of 80-88 rows: several tiles, a ragged last one)."""
    monkeypatch.setattr(gemm_codes, "TILE_ELEMENTS", 96 * 16)


@pytest.fixture
def float_int8(monkeypatch):
    """INT8 W8A8 through the float GEMM on codes (what a CPU without VNNI runs) instead of _int_mm."""
    monkeypatch.setitem(probe._CPU_BACKEND, "int8", "float")


def _held(obj, seen: set[int]) -> int:
    """Storage bytes of every tensor in ``obj`` (a module's ``vars``, recursively), each storage once."""
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_held(o, seen) for o in obj)
    return 0


def _integer_layer(scheme: str, k: int = 96, n: int = 88) -> tuple[QuantLinear, torch.Tensor]:
    """A layer and an input whose products and sums are all exact in FP32 and bfloat16 in any order:
    integer codes |c| <= 14, power-of-two scales, activations quantized to integer codes (static scale 1;
    per token: every row's amax is 14, scale 2**-5, codes 32 * x). Every kernel then gives the reference
    bit for bit, so a misplaced tile, a wrong decode or a wrong scale shows as inequality."""
    g = torch.Generator().manual_seed(3)
    q = QuantLinear.from_linear(nn.Linear(k, n, bias=False), scheme, input_amax=127.0)
    codes = torch.randint(-14, 15, (n, k), generator=g).float()
    q.weight = codes.to(q.scheme.weight_format.dtype)
    scale = torch.exp2(torch.randint(-4, 3, q.weight_scale.shape, generator=g).float())
    q.weight_scale = scale
    if q.input_scale is not None:
        q.input_scale = torch.ones(1)
    x = torch.randint(-14, 15, (9, k), generator=g).float()
    x[:, 0] = 14.0
    return q, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_lean_equals_cached_bit_for_bit_on_exact_sums(scheme, dtype, small_tiles, float_int8):
    q, x = _integer_layer(scheme)
    x = x.to(dtype)
    q.kernel = "codes_mm"
    ref = q._forward_reference(x)
    q.weight_cache = "lean"
    lean = q(x)
    q.weight_cache = "cached"
    cached = q(x)
    assert torch.equal(lean, cached) and torch.equal(lean, ref)
    assert ref.abs().max() > 0
    # the same layer with one tile's codes negated differs: the comparison sees every tile
    q.weight_cache = "lean"
    q.weight = torch.cat([q.weight[:80], (-q.weight[80:].float()).to(q.weight.dtype)])
    assert not torch.equal(q(x)[:, 80:], lean[:, 80:]) and torch.equal(q(x)[:, :80], lean[:, :80])


def test_lean_tiles_bound_the_transient(small_tiles, monkeypatch):
    """The lean GEMM decodes at most ``TILE_ELEMENTS`` weights at a time, in whole rows, covering all rows."""
    q = _layer("fp8", k=96, n=88)
    sizes: list[int] = []
    real = gemm_codes.decode_codes

    def spy(codes, dtype):
        sizes.append(codes.shape[0])
        assert codes.numel() <= gemm_codes.TILE_ELEMENTS and codes.shape[1] == 96
        return real(codes, dtype)

    monkeypatch.setattr(gemm_codes, "decode_codes", spy)
    q(_inputs(4, 96, torch.bfloat16))
    assert sizes == [16, 16, 16, 16, 16, 8]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lean_weights_cost_about_one_byte_each(scheme, float_int8):
    """Counted from the tensors the layer actually holds after forwards (codes, scales, bias, caches):
    lean <= 1.1 bytes per weight; cached keeps a bfloat16 (bfloat16 inputs on a bfloat16 CPU backend) or
    float32 copy beside the codes, >= 3 bytes per weight; switching back to lean releases it."""
    k, n = 256, 192
    q = _layer(scheme, k=k, n=n)
    x = _inputs(5, k, torch.bfloat16)
    q(x)
    held = _held(vars(q), set())
    assert held == resident_bytes(q)
    assert held / (k * n) <= 1.1, held / (k * n)
    q.weight_cache = "cached"
    q.kernel = "codes_mm"
    out = q(x)
    cached = _held(vars(q), set())
    assert cached == resident_bytes(q) and cached / (k * n) >= 3.0
    q.weight_cache = "lean"
    assert torch.equal(q(x), out) and _held(vars(q), set()) == held


def test_weight_cache_setting_and_bad_value():
    model = nn.Sequential(_layer("fp8"), nn.ReLU(), _layer("int8-weight-only", k=80, n=96))
    assert {m.weight_cache for m in model if isinstance(m, QuantLinear)} == {"lean"}
    set_weight_cache(model, "cached")
    assert {m.weight_cache for m in model if isinstance(m, QuantLinear)} == {"cached"}
    assert "weight_cache=cached" in repr(model[0])
    with pytest.raises(ValueError, match="lean, cached"):
        set_weight_cache(model, "fp32")
    model[0].weight_cache = "big"
    with pytest.raises(ValueError, match="lean, cached"):
        model(_inputs(2, 96, torch.float32))


@pytest.mark.compiled
def test_compiled_lean_model_has_no_graph_break(small_tiles):
    """torch.compile(fullgraph=True) over lean QuantLinear layers (several tiles each) compiles one graph
    (a graph break would raise) and gives the eager result."""
    for scheme in SCHEMES:
        torch._dynamo.reset()
        model = nn.Sequential(_layer(scheme, k=96, n=96), nn.ReLU(), _layer(scheme, k=96, n=40))
        x = _inputs(3, 96, torch.float32)
        assert torch.equal(torch.compile(model, fullgraph=True)(x), model(x)), scheme


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_cuda_kernels_equal_the_reference(scheme, m):
    q = _layer(scheme, k=256, n=512, device="cuda")
    x = _inputs(m, 256, torch.bfloat16, "cuda")
    choice = q.kernel_for(x)
    assert choice.name != "reference", choice.reason
    out, ref = q(x), q._forward_reference(x)
    assert not q._failed, "the CUDA kernel raised and fell back"
    diff = (out.double() - ref.double()).abs()
    assert (diff <= _bound(q, x, 2.0**-8)).all(), float((diff - _bound(q, x, 2.0**-8)).max())


@pytest.mark.cuda
@cuda
def test_cuda_odd_shapes_run_the_reference():
    q = _layer("fp8", k=100, n=72, device="cuda")
    x = _inputs(8, 100, torch.bfloat16, "cuda")
    assert q.kernel_for(x).name == "reference"
    assert torch.equal(q(x), q._forward_reference(x))
