"""Post-training quantization: schemes by SQNR, real 8-bit storage, calibration, SmoothQuant, FP8 KV."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fp8kit import ptq
from fp8kit.numerics.formats import E4M3, INT8
from fp8kit.ptq.calibrate import InputObserver, choose_amax
from fp8kit.ptq.schemes import Scheme
from fp8kit.ptq.smoothquant import apply_smoothing, find_mappings
from tests.helpers.models import calib, tiny_llama
from tests.helpers.numerics import sqnr_db

transformers = pytest.importorskip("transformers")


def layer_and_data(seed: int = 0, outlier: float = 1.0):
    torch.manual_seed(seed)
    lin = nn.Linear(256, 128)
    xs = [torch.randn(32, 256) for _ in range(4)]
    if outlier != 1.0:
        for x in xs:
            x[:, 7] *= outlier
    return nn.Sequential(lin), xs


# SQNR floors (dB) of the layer output vs FP32. A wrong FP8 format (E5M2 for E4M3: ~6 dB less) falls
# below the FP8 floors; the INT8 floors sit between the correct levels (39.2 / 48.1 dB) and those of a
# scale 2x too coarse (amax/63.5 weights: 42.0; a doubled static amax: 33.5), so such a scale fails
# (tests/numerics/test_mutants.py). FP8 SQNR hardly moves with the scale: exact scale checks are in
# test_numerics_ptq.py, and SmoothQuant on a model with a norm feeding the linears too (here the model is
# a bare Linear, so int8-smoothquant has nothing to smooth).
FLOORS = {"fp8": 27.0, "fp8-dynamic": 27.0, "int8-smoothquant": 37.5, "int8-weight-only": 46.0}


@pytest.mark.parametrize("scheme", list(ptq.SCHEMES))
def test_scheme_sqnr_and_storage(scheme):
    model, xs = layer_and_data()
    ref = [model(x).detach() for x in xs]
    q = ptq.quantize(copy.deepcopy(model), scheme, calib(xs), module_filter=lambda n, m: True)
    layer = q[0]
    assert isinstance(layer, ptq.QuantLinear)
    assert layer.weight.dtype == (torch.float8_e4m3fn if scheme.startswith("fp8") else torch.int8)
    # real 8-bit storage: codes + scales are about half of the BF16 weight
    assert layer.weight_bytes() <= 0.51 * 2 * layer.weight.numel()
    out = torch.cat([q(x) for x in xs])
    db = sqnr_db(torch.cat(ref), out)
    assert db >= FLOORS[scheme], f"{scheme}: {db:.1f} dB"
    assert db < 60  # it does quantize


def test_wrong_format_fails_the_fp8_floor():
    model, xs = layer_and_data()
    ref = torch.cat([model(x).detach() for x in xs])
    from fp8kit.numerics.formats import E5M2

    e5 = Scheme("fp8", E5M2, "tensor", E5M2, "tensor", False, "float-quantized", "negative control")
    q = ptq.quantize(copy.deepcopy(model), e5, calib(xs), module_filter=lambda n, m: True)
    assert sqnr_db(ref, torch.cat([q(x) for x in xs])) < FLOORS["fp8"]


def test_quantlinear_matches_dequantized_reference():
    """The layer computes exactly dequant(codes(x)) @ dequant(W)^T (up to summation order)."""
    model, xs = layer_and_data()
    q = ptq.quantize(copy.deepcopy(model), "fp8", calib(xs), module_filter=lambda n, m: True)[0]
    x = xs[0]
    xd = (x / q.input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * q.input_scale.double()
    ref = xd @ q.dequantized_weight(torch.float64).t() + q.bias.double()
    torch.testing.assert_close(q(x).double(), ref, rtol=1e-5, atol=1e-5)
    # the static scale is amax / 448 of the calibration inputs
    assert float(q.input_scale) == pytest.approx(max(float(t.abs().max()) for t in xs) / E4M3.max, rel=1e-6)


def test_calibration_methods_clip_heavy_tails():
    torch.manual_seed(0)
    obs = InputObserver("layer")
    x = torch.randn(64, 512)
    x[0, 0] = 200.0  # one outlier
    obs.observe(x)
    amax = choose_amax(obs, INT8, "max")
    pct = choose_amax(obs, INT8, "percentile", percentile=99.9)
    mse = choose_amax(obs, INT8, "mse")
    assert amax == pytest.approx(200.0)
    assert pct < 10 and mse < amax
    import fp8kit

    def err(c, data):  # symmetric INT8 with the clipping value c (scale 127 / c)
        deq = fp8kit.quantize(data, INT8, "tensor", scale=INT8.max / c).dequantize(torch.float32)
        return float(((deq - data) ** 2).mean())

    # MSE search lowers the total error; the percentile protects the bulk (all but the outlier)
    assert err(mse, x) < err(amax, x)
    bulk = x.flatten()[1:]
    assert err(pct, bulk) < 0.1 * err(amax, bulk)


def test_smoothquant_is_an_identity_transform_and_helps_outliers():
    model = tiny_llama()
    batches = [torch.randint(0, 256, (2, 32)) for _ in range(3)]
    # plant an outlier channel: a large norm gain on one hidden feature
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[5] = 40.0
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ref = model(x).logits
    smoothed = copy.deepcopy(model)
    eligible = {n for n, m in smoothed.named_modules() if type(m) is nn.Linear and not n.endswith("lm_head")}
    from fp8kit.ptq.calibrate import observe_inputs

    obs = observe_inputs(smoothed, sorted(eligible), calib(batches))
    mappings = find_mappings(smoothed, eligible)
    assert len(mappings) == 3 * len(smoothed.model.layers)
    apply_smoothing(smoothed, mappings, obs, alpha=0.5)
    with torch.no_grad():
        torch.testing.assert_close(smoothed(x).logits, ref, rtol=1e-4, atol=1e-4)
        # and the smoothed model quantizes to INT8 better than plain static INT8
        sq = ptq.quantize(copy.deepcopy(model), "int8-smoothquant", calib(batches))(x).logits
        plain = Scheme("int8-static", INT8, "channel", INT8, "tensor", False, "int-quantized", "control")
        pl = ptq.quantize(copy.deepcopy(model), plain, calib(batches))(x).logits
    assert sqnr_db(ref, sq) > sqnr_db(ref, pl) + 3


def test_output_head_kept_and_report():
    model = tiny_llama(tie=False)
    batches = [torch.randint(0, 256, (2, 16))]
    q = ptq.quantize(model, "fp8-dynamic")
    assert type(q.lm_head) is nn.Linear and "lm_head" in q.ptq_report.skipped
    assert len(q.ptq_report.quantized) == 14
    assert "quantized 14" in str(q.ptq_report)
    assert q(batches[0]).logits.isfinite().all()


@pytest.mark.parametrize("scheme", ["fp8", "int8-smoothquant", "nvfp4"])
def test_a_layer_calibration_never_reaches_stays_high_precision(scheme):
    """A static scheme has no input scale for a layer the forward_loop never runs (a tower fed no input): it
    stays nn.Linear with its reason in the report, and the layers calibration reached are quantized."""
    model = tiny_llama()
    model.model.unused = nn.Linear(64, 64)  # in the module tree, never called by forward
    batches = [torch.randint(0, 256, (2, 16))]
    q = ptq.quantize(model, scheme, calib(batches))
    assert type(q.model.unused) is nn.Linear
    assert "never ran during calibration" in q.ptq_report.skipped["model.unused"]
    assert "model.unused" not in q.ptq_report.input_amax
    assert len(q.ptq_report.quantized) == 14 and q(batches[0]).logits.isfinite().all()


def test_fp8_kv_cache_is_idempotent_under_decoding():
    model = tiny_llama()
    batches = [torch.randint(0, 256, (2, 32)) for _ in range(2)]
    q = ptq.quantize(copy.deepcopy(model), "fp8", calib(batches), kv_cache=True)
    attn = q.model.layers[0].self_attn
    assert float(attn.k_scale) > 0 and float(attn.v_scale) > 0  # exact values: test_numerics_ptq.py
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        full = q(x).logits[:, -1]
        # prefill 11 tokens, then decode the 12th through the cache: re-rounding cached FP8 values is exact
        out = q(x[:, :-1], use_cache=True)
        import inspect

        kw = "cache" if "cache" in inspect.signature(q.forward).parameters else "past_key_values"
        step = q(x[:, -1:], **{kw: out.past_key_values}, use_cache=True).logits[:, -1]
        no_kv = ptq.quantize(copy.deepcopy(model), "fp8", calib(batches))(x).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-4, atol=1e-4)
    assert not torch.equal(full, no_kv)  # the KV rounding is applied
    assert sqnr_db(no_kv, full) > 20
    assert ptq.kv_cache_bytes(q, 100, 1) * 2 == ptq.kv_cache_bytes(q, 100, 2)
    # k/v scales follow the calibration method: MSE search clips at or below the max
    mse = ptq.quantize(copy.deepcopy(model), "fp8", calib(batches), kv_cache=True, calibration="mse")
    k_max, k_mse = float(attn.k_scale), float(mse.model.layers[0].self_attn.k_scale)
    assert 0 < k_mse <= k_max


def test_trained_fp8_model_exports_with_its_scales():
    import fp8kit

    model = tiny_llama()
    fp8kit.convert(model, fp8kit.DelayedScaling(amax_history_len=4))
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randint(0, 256, (2, 16))
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    want = {n: float(model.get_submodule(n).fp8_amax_history[0].max()) / 448 for n in names}
    q = ptq.quantize(model, "fp8")  # no forward_loop: the trained amax histories serve
    assert q.ptq_report.calibration == "trained delayed-scaling amax history"
    for n in names:  # input_scale = max(amax history) / 448
        layer = q.get_submodule(n)
        assert isinstance(layer, ptq.QuantLinear) and float(layer.input_scale) == pytest.approx(want[n], rel=1e-6)
    assert q(torch.randint(0, 256, (1, 8))).logits.isfinite().all()


# ---- bad input -------------------------------------------------------------------------------------


def test_bad_inputs_give_clear_errors():
    model, xs = layer_and_data()
    every = {"module_filter": lambda n, m: True}
    with pytest.raises(ValueError, match="forward_loop"):
        ptq.quantize(copy.deepcopy(model), "fp8", **every)
    with pytest.raises(ValueError, match="never ran the model"):
        ptq.quantize(copy.deepcopy(model), "fp8", lambda m: None, **every)
    with pytest.raises(ValueError, match="NaN or inf"):
        bad = [xs[0].clone()]
        bad[0][3, 3] = float("nan")
        ptq.quantize(copy.deepcopy(model), "fp8", calib(bad), **every)
    with pytest.raises(ValueError, match="only zeros"):
        ptq.quantize(copy.deepcopy(model), "int8-smoothquant", calib([torch.zeros(4, 256)]), **every)
    with pytest.raises(ValueError, match="no nn.Linear"):
        ptq.quantize(nn.Sequential(nn.ReLU()), "fp8-dynamic")
    with pytest.raises(ValueError, match="matched none"):
        ptq.quantize(copy.deepcopy(model), "fp8-dynamic", module_filter=lambda n, m: False)
    with pytest.raises(ValueError, match="unknown PTQ scheme"):
        ptq.quantize(copy.deepcopy(model), "fp4")
    with pytest.raises(ValueError, match="FP8 schemes"):
        ptq.quantize(copy.deepcopy(model), "int8-weight-only", kv_cache=True)
    with pytest.raises(ValueError, match="calibration method"):
        ptq.quantize(copy.deepcopy(model), "fp8", calib(xs), calibration="entropy", **every)


def test_zero_variance_channels_do_not_break_smoothquant():
    """Dead input channels into a norm-fed block: SmoothQuant runs, gives them factor 1, finite output
    (the check lives in test_numerics_ptq.py; a bare Linear has no producer to fold into)."""
    from tests.ptq.test_numerics_ptq import check_smoothquant_zero_variance

    check_smoothquant_zero_variance()
