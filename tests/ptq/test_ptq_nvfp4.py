"""PTQ scheme ``nvfp4`` (W4A4): NVFP4 weights, NVFP4 activations with a static calibrated per-tensor scale and
1x16 block scales at run time. The layer against a torchao transcription of the input's quantization, the
tiny Llama's logits above a floor that wrong activation scales fall below, and the pipeline's refusals."""

import copy

import pytest
import torch
import torch.nn as nn

from fp8kit import ptq, quantize
from tests.helpers.models import tiny_llama
from tests.helpers.numerics import sqnr_db
from tests.helpers.reference import ref_e2m1_values, ref_nvfp4

# Logit SQNR (dB) vs FP32 of tiny_llama (seed 0) on 4x32 random tokens, calibrated on two other batches:
# nvfp4 17.4 (nvfp4-weight-only 20.8). Activation scales 2x too small give 16.6, 6x too small 7.7.
FLOOR = 17.0


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    cal = [torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(s)) for s in (2, 3)]
    with torch.no_grad():
        ref = model(ids).logits
    return model, ids, cal, ref


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def ref_output(layer: ptq.QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The layer's output by the transcription: NVFP4 input with the layer's static per-tensor scale."""
    x2 = x.reshape(-1, layer.in_features)
    codes, scales, g = ref_nvfp4(x2, per_tensor_scale=layer.input_scale.reshape(()))
    xd = ref_e2m1_values(codes) * (scales.float() * g).repeat_interleave(16, dim=1)
    out = xd @ layer.dequantized_weight().t() + layer.bias
    return out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_quantizes_its_input_with_the_static_scale(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    calibrated = 3.0
    layer = ptq.QuantLinear.from_linear(lin, "nvfp4", input_amax=calibrated)
    assert torch.equal(layer.input_scale, torch.tensor([calibrated]) / 2688)
    x = (torch.randn(5, 7, 64) * 1.5).to(dtype)
    x[0, 0, :16] *= 10  # past the calibrated range: its block scale clamps at 448 and saturates
    want = ref_output(layer, x)
    lean = layer(x)
    layer.weight_cache = "cached"
    cached = layer(x)
    layer.kernel = "reference"
    reference = layer(x)
    for got in (lean, cached, reference):  # the same float32 products; bfloat16 rounds the output once
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    if dtype == torch.float32:  # straight through (norm tweaking, ranking): the same forward value
        layer.kernel = None
        xg = x.clone().requires_grad_(True)
        out = layer(xg)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        assert xg.grad is not None and torch.isfinite(xg.grad).all()


def test_tiny_llama_w4a4_above_the_floor_and_wrong_activation_scales_below(llama):
    model, ids, cal, ref = llama
    q = ptq.quantize(copy.deepcopy(model), "nvfp4", lambda m: [m(x) for x in cal])
    layers = {n: m for n, m in q.named_modules() if isinstance(m, ptq.QuantLinear)}
    assert len(layers) == 14 and all(m.scheme.name == "nvfp4" for m in layers.values())
    for name, m in layers.items():  # max calibration: amax / (6 * 448)
        assert torch.equal(m.input_scale, torch.tensor([q.ptq_report.input_amax[name]]) / 2688)
    db = sqnr_db(ref, logits(q, ids))
    assert FLOOR <= db < sqnr_db(ref, logits(ptq.quantize(copy.deepcopy(model), "nvfp4-weight-only"), ids))
    calibrated = {n: m.input_scale.clone() for n, m in layers.items()}
    for factor in (0.5, 1 / 6):  # too small: the run-time blocks saturate
        for n, m in layers.items():
            m.input_scale = calibrated[n] * factor
        assert sqnr_db(ref, logits(q, ids)) < FLOOR, factor
    for n, m in layers.items():
        m.input_scale = calibrated[n]
    assert sqnr_db(ref, logits(q, ids)) == db


def test_gptq_runs_and_the_pipeline_refuses_what_does_not_fit(llama):
    model, ids, cal, ref = llama
    g = ptq.quantize(copy.deepcopy(model), "nvfp4", lambda m: [m(x) for x in cal], gptq=True)
    assert sqnr_db(ref, logits(g, ids)) >= FLOOR
    loop = lambda m: [m(x) for x in cal]  # noqa: E731
    with pytest.raises(ValueError, match="calibration 'max'"):
        ptq.quantize(copy.deepcopy(model), "nvfp4", loop, calibration="mse")
    with pytest.raises(ValueError, match="smooth goes with"):
        ptq.quantize(copy.deepcopy(model), "nvfp4-weight-only", loop, smooth=True)
    with pytest.raises(ValueError, match="awq"):
        ptq.quantize(copy.deepcopy(model), "nvfp4", loop, awq=True)
    with pytest.raises(ValueError, match="static scales"):
        ptq.quantize(copy.deepcopy(model), "nvfp4")


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-weight-only"])
def test_layers_reading_one_input_share_the_weights_per_tensor_scale(llama, scheme):
    """q/k/v and gate/up: one NVFP4 per-tensor weight scale per group (the largest amax's), as serving engines
    fuse them into one GEMM; o_proj and down_proj keep their own."""
    model, ids, cal, ref = llama
    q = ptq.quantize(copy.deepcopy(model), scheme, lambda m: [m(x) for x in cal])
    for block, orig in zip(q.model.layers, model.model.layers, strict=True):
        groups = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
        for parent, names in groups + (("self_attn", ("o_proj",)), ("mlp", ("down_proj",))):
            amax = max(getattr(getattr(orig, parent), n).weight.abs().amax() for n in names)
            for n in names:
                layer = getattr(getattr(block, parent), n)
                assert torch.equal(layer.weight_scale_2, (amax / 2688).reshape(1)), n
                w = getattr(getattr(orig, parent), n).weight.detach()
                want = quantize(w, "e2m1", "nvfp4", global_scale=layer.weight_scale_2)
                assert torch.equal(layer.dequantized_weight(), want.dequantize(torch.float32)), n


@pytest.mark.parametrize("alpha", [0.5, "search"])
def test_smoothquant_folds_serve_w4a4_and_are_reported(llama, alpha):
    """The folds keep the model's function, so W4A4 takes them as W8A8 does: the quantized logits stay above
    the floor and the report lists each fold (mapping and factors) in the order it was made."""
    model, ids, cal, ref = llama
    q = ptq.quantize(copy.deepcopy(model), "nvfp4", lambda m: [m(x) for x in cal], smooth=True, alpha=alpha)
    report = q.ptq_report
    assert sqnr_db(ref, logits(q, ids)) >= FLOOR
    assert [m.source for m, _ in report.smooth_folds] == report.smoothed and report.smoothed
    for mapping, factors in report.smooth_folds:
        assert factors.shape == (model.get_submodule(mapping.targets[0]).in_features,)
        assert torch.isfinite(factors).all() and (factors > 0).all()
    if alpha == 0.5:
        assert len(report.smooth_folds) == 6  # per block: norm -> q/k/v, norm -> gate/up, up -> down


def test_the_w4a4_smoothing_error_is_nvfp4_on_both_operands():
    """``smoothed_error`` for nvfp4: NVFP4 inputs under the max-calibrated tensor scale of ``x / s`` times
    NVFP4 weights ``w * s``, against the float product (the transcription of both sides)."""
    from fp8kit.ptq.smoothquant import smoothed_error

    torch.manual_seed(0)
    x, w = torch.randn(24, 64), torch.randn(32, 64) * 0.05
    x[:, 5] *= 30  # an outlier channel
    x_amax = x.abs().amax(dim=0) * 1.25  # calibration saw more than this sample
    s = torch.rand(64) + 0.5

    def nvfp4_values(t: torch.Tensor, per_tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales, g = ref_nvfp4(t, per_tensor_scale=per_tensor_scale)
        return ref_e2m1_values(codes) * (scales.float() * g).repeat_interleave(16, dim=1)

    xs = nvfp4_values(x / s, per_tensor_scale=(x_amax / s).amax() / 2688)
    want = float((xs @ nvfp4_values(w * s).t() - x @ w.t()).pow(2).mean())
    got = smoothed_error(x, x_amax, [w], "nvfp4", s)
    assert got == pytest.approx(want, rel=1e-5)
    weight_only = float(((x / s) @ nvfp4_values(w * s).t() - x @ w.t()).pow(2).mean())
    assert smoothed_error(x, x_amax, [w], "nvfp4-weight-only", s) == pytest.approx(weight_only, rel=1e-5)


@pytest.mark.parametrize("scheme,top", [("nvfp4", 2688.0), ("fp8", 448.0), ("int8-smoothquant", 127.0)])
def test_static_input_scale_follows_the_amax_rule_and_reads_back(scheme, top):
    """``set_input_amax`` holds the scale rule (``amax / 2688`` for NVFP4 inputs, ``amax / fmt.max`` else),
    ``input_amax`` inverts it; a scheme without a static input scale refuses both."""
    torch.manual_seed(0)
    q = ptq.QuantLinear.from_linear(nn.Linear(32, 16), ptq.get_scheme(scheme), 3.5)
    assert float(q.input_scale) == pytest.approx(3.5 / top, rel=1e-6)
    q.set_input_amax(7.0)
    assert float(q.input_scale) == pytest.approx(7.0 / top, rel=1e-6)
    assert q.input_amax() == pytest.approx(7.0, rel=1e-6)
    dynamic = ptq.QuantLinear.from_linear(nn.Linear(32, 16), ptq.get_scheme("fp8-dynamic"))
    with pytest.raises(ValueError, match="no static input scale"):
        dynamic.input_amax()
    with pytest.raises(ValueError, match="no static input scale"):
        dynamic.set_input_amax(1.0)
