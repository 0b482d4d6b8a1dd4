"""``fp8kit.qat``: the QAT forward is PTQ's at step 0 bit for bit, the gradients pass the quantizers straight
through, distillation lowers the KL to the teacher, ``convert`` + export reload the trained model, and learned
scales stay finite and positive."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fp8kit import ptq, qat
from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.qat.linear import SCALE_RANGE, QATLinear
from tests.helpers.models import calib, tiny_llama, token_batches

pytest.importorskip("transformers")

# (scheme, learn_scales): every PTQ scheme, and learned scales where they apply (8-bit schemes)
STEP0 = [
    ("fp8", False),
    ("fp8", True),
    ("fp8-dynamic", True),
    ("int8-weight-only", False),
    ("int8-weight-only", True),
    ("int8-smoothquant", True),
    ("nvfp4", False),
    ("nvfp4-weight-only", False),
    ("mxfp4-weight-only", False),
]


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


@pytest.fixture(scope="module")
def data():
    return token_batches(256, 6, (4, 32))  # 0-1 calibrate, 2-4 train, 5 held out


def reference_kernels(model):
    for m in model.modules():
        if isinstance(m, ptq.QuantLinear):
            m.kernel = "reference"
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize(("scheme", "learn"), STEP0)
def test_step0_forward_is_ptq_bit_for_bit(base, data, scheme, learn):
    """Round-to-nearest PTQ (SmoothQuant folds off: QAT trains the model as it is) on QuantLinear's
    reference path, and the prepared model, give identical logits, with or without gradients."""
    smooth = {"smooth": False} if scheme == "int8-smoothquant" else {}
    ptq_model = reference_kernels(ptq.quantize(copy.deepcopy(base), scheme, calib(data[:2]), **smooth))
    student = qat.prepare(copy.deepcopy(base), scheme, calib(data[:2]), learn_scales=learn)
    assert set(qat.qat_layers(student)) == set(ptq_model.ptq_report.quantized)
    assert student.qat_report.skipped == ptq_model.ptq_report.skipped
    expect = logits(ptq_model, data[5])
    assert torch.equal(logits(student, data[5]), expect)
    assert torch.equal(student(data[5]).logits.float(), expect)  # the training path computes the same
    assert not torch.equal(expect, logits(base, data[5]))  # the quantizers do something


@pytest.mark.parametrize("scheme", ["int8-weight-only", "nvfp4-weight-only", "fp8-dynamic"])
def test_weight_gradient_is_straight_through(base, scheme):
    """The master weight's gradient is the gradient of the dequantized weight (the rounding passed as the identity)."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    layer = QATLinear(copy.deepcopy(lin), scheme)
    x = torch.randn(8, 64, requires_grad=True)
    g = torch.randn(8, 32)
    (layer(x) * g).sum().backward()
    ql = ptq.QuantLinear.from_linear(lin, scheme)
    xd = x.detach().clone().requires_grad_(True)
    wd = ql.dequantized_weight().requires_grad_(True)
    xin = xd
    if scheme == "fp8-dynamic":
        codes, s = ql.quantize_input(xd.detach())
        xin = xd + (codes.float() * s - xd).detach()
    (nn.functional.linear(xin, wd, lin.bias) * g).sum().backward()
    torch.testing.assert_close(layer.weight.grad, wd.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, xd.grad, rtol=1e-5, atol=1e-6)


def test_distillation_lowers_the_kl_to_the_teacher():
    """A teacher with a peaked next-token distribution (its head scaled up), an NVFP4 W4A4 student: the KL falls
    on the batches it trains on and on a batch it never sees (a wrong or dropped gradient fails this)."""
    teacher = tiny_llama(tie=False)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8)
    data = token_batches(256, 12, (4, 32))
    student = qat.prepare(copy.deepcopy(teacher), "nvfp4", calib(data[:2]))
    before = qat.kl_to_teacher(logits(student, data[11]), logits(teacher, data[11])).item()
    result = qat.distill(student, teacher, data[2:11], steps=30, lr=5e-5, progress=False)
    after = qat.kl_to_teacher(logits(student, data[11]), logits(teacher, data[11])).item()
    assert len(result.kl) == 30 and result.kl[-1] < 0.7 * result.kl[0]
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize(
    ("scheme", "fmt", "learn"),
    [("nvfp4", "compressed-tensors", False), ("nvfp4", "modelopt", False), ("fp8", "compressed-tensors", True)],
)
def test_convert_after_training_exports_and_reloads_the_trained_model(base, data, tmp_path, scheme, fmt, learn):
    student = qat.prepare(copy.deepcopy(base), scheme, calib(data[:2]), learn_scales=learn)
    qat.distill(student, base, data[2:5], steps=4, lr=3e-3, scale_lr=1e-2, progress=False)
    trained = logits(student, data[5])
    frozen = reference_kernels(qat.convert(student))
    assert not qat.qat_layers(frozen) and frozen.ptq_report.quantized
    torch.testing.assert_close(logits(frozen, data[5]), trained, rtol=0, atol=0)
    untrained = reference_kernels(ptq.quantize(copy.deepcopy(base), scheme, calib(data[:2])))
    assert (logits(untrained, data[5]) - trained).abs().max() > 1e-3  # training changed the model
    loaded = reference_kernels(load_pretrained(save_pretrained(frozen, tmp_path / "export", format=fmt)))
    assert loaded.ptq_report.scheme == scheme
    for name in frozen.ptq_report.quantized:
        assert torch.equal(loaded.get_submodule(name).weight, frozen.get_submodule(name).weight), name
    torch.testing.assert_close(logits(loaded, data[5]), trained, rtol=1e-5, atol=1e-5)


def test_learned_scales_stay_finite_and_positive_under_bad_input():
    torch.manual_seed(0)
    layer = QATLinear(nn.Linear(32, 16), "fp8", input_amax=3.0, learn_scales=True)
    start_w, start_x = layer.weight_amax.detach().clone(), layer.input_amax.detach().clone()
    opt = torch.optim.SGD(layer.scale_parameters(), lr=1e6)  # a step far larger than any scale
    for x in (torch.zeros(4, 32), torch.full((4, 32), float("inf")), 1e30 * torch.randn(4, 32), torch.randn(4, 32)):
        opt.zero_grad()
        layer(x).float().nan_to_num().sum().backward()
        for p in layer.scale_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all()
        opt.step()
        layer.project_scales_()
        for p, start in ((layer.weight_amax, start_w), (layer.input_amax, start_x)):
            assert torch.isfinite(p).all() and (p > 0).all()
            assert (p >= start / SCALE_RANGE).all() and (p <= start * SCALE_RANGE).all()
    with torch.no_grad():
        layer.input_amax.fill_(float("nan"))
    layer.project_scales_()
    assert torch.equal(layer.input_amax.detach(), start_x)
    with torch.no_grad():
        layer.weight_amax.fill_(0.0)
    with pytest.raises(ValueError, match="weight clipping value must be finite and > 0"):
        layer(torch.randn(2, 32))


def test_bad_settings_get_one_clear_error(base, data):
    with pytest.raises(ValueError, match="learn_scales"):
        qat.prepare(copy.deepcopy(base), "nvfp4-weight-only", learn_scales=True)
    with pytest.raises(ValueError, match="forward_loop"):
        qat.prepare(copy.deepcopy(base), "fp8")
    with pytest.raises(ValueError, match="no QATLinear"):
        qat.convert(copy.deepcopy(base))
    student = qat.prepare(copy.deepcopy(base), "int8-weight-only")
    with pytest.raises(ValueError, match="lr must be"):
        qat.distill(student, base, data[2:3], steps=1, lr=0.0)
    student.model.embed_tokens.weight.data[0] = float("nan")
    with pytest.raises(ValueError, match="loss at step 0 is nan"):
        qat.distill(student, base, [torch.zeros(1, 8, dtype=torch.long)], steps=1, progress=False)


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-weight-only"])
def test_from_ptq_of_round_to_nearest_is_prepare_bit_for_bit(base, data, scheme):
    """A block's largest NVFP4 code is 6 after round to nearest, so re-quantizing the dequantized weight gives
    back its codes and scales: the model from_ptq makes computes what prepare's does."""
    ptq_model = ptq.quantize(copy.deepcopy(base), scheme, calib(data[:2]), gptq=False, awq=False)
    student = qat.from_ptq(ptq_model)
    prepared = qat.prepare(copy.deepcopy(base), scheme, calib(data[:2]))
    assert set(qat.qat_layers(student)) == set(qat.qat_layers(prepared))
    assert student.qat_report.input_amax == prepared.qat_report.input_amax
    assert torch.equal(logits(student, data[5]), logits(prepared, data[5]))


@pytest.mark.parametrize("scheme", ["nvfp4", "fp8", "int8-weight-only"])
def test_from_ptq_starts_where_gptq_ended_and_trains(base, data, tmp_path, scheme):
    """From PTQ with GPTQ: the QAT model keeps PTQ's input amaxes and most of GPTQ's change (FP4: all of it, its
    block scales kept), and a distilled, converted model exports and reloads."""
    ptq_model = reference_kernels(ptq.quantize(copy.deepcopy(base), scheme, calib(data[:2]), gptq=True))
    expect = logits(ptq_model, data[5])
    rtn = logits(qat.prepare(copy.deepcopy(base), scheme, calib(data[:2])), data[5])
    amax = dict(ptq_model.ptq_report.input_amax)
    student = qat.from_ptq(ptq_model)
    got = logits(student, data[5])
    assert (got - expect).abs().max() < 0.5 * (rtn - expect).abs().max()
    assert student.qat_report.input_amax == amax
    qat.distill(student, base, data[2:5], steps=2, lr=1e-3, progress=False)
    trained = logits(student, data[5])
    assert not torch.equal(trained, got)
    qat.convert(student)
    save_pretrained(student, tmp_path / "out", format="compressed-tensors")
    torch.testing.assert_close(logits(load_pretrained(tmp_path / "out"), data[5]), trained, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-weight-only", "mxfp4-weight-only"])
@pytest.mark.parametrize("with_reference", [False, True])
def test_from_ptq_of_gptq_fp4_keeps_its_codes_and_scales(base, data, scheme, with_reference):
    """GPTQ leaves some FP4 blocks without their largest code: from_ptq keeps PTQ's block (and per-tensor)
    scales, so the student computes the PTQ model's logits and converts back to its exact codes and scales,
    with master weights on the codes or, given the float reference, inside their rounding intervals."""
    ptq_model = reference_kernels(ptq.quantize(copy.deepcopy(base), scheme, calib(data[:2]), gptq=True))
    before = {n: m.fp4_weight() for n, m in ptq_model.named_modules() if isinstance(m, ptq.QuantLinear)}
    expect = logits(ptq_model, data[5])
    student = qat.from_ptq(ptq_model, reference=base if with_reference else None)
    torch.testing.assert_close(logits(student, data[5]), expect, rtol=1e-5, atol=1e-5)
    if with_reference:  # the master weights left the grid points, towards the float weights
        moved = [
            not torch.equal(m.weight, m.fp4_weight().dequantize(torch.float32))
            for m in qat.qat_layers(student).values()
        ]
        assert all(moved)
    reference_kernels(qat.convert(student))
    for name, qt in before.items():
        after = student.get_submodule(name).fp4_weight()
        assert torch.equal(after.dequantize(torch.float32), qt.dequantize(torch.float32)), name  # (+-0 alike)
        assert torch.equal(after.scales.float(), qt.scales.float()), name
        assert (after.global_scale is None) == (qt.global_scale is None)
        if qt.global_scale is not None:
            assert torch.equal(after.global_scale, qt.global_scale), name
    torch.testing.assert_close(logits(student, data[5]), expect, rtol=1e-5, atol=1e-5)


def test_from_ptq_reference_takes_ptqs_smoothquant_folds(base, data):
    """PTQ with SmoothQuant rounds the folded weights (columns times the factors, a folded producer's rows
    divided by them): from_ptq compares those with its codes, not the unfolded reference's."""
    ptq_model = reference_kernels(ptq.quantize(copy.deepcopy(base), "nvfp4", calib(data[:2]), gptq=True, smooth=True))
    folds = {m.source: s for m, s in ptq_model.ptq_report.smooth_folds}
    expect = logits(ptq_model, data[5])
    student = qat.from_ptq(ptq_model, reference=base)
    torch.testing.assert_close(logits(student, data[5]), expect, rtol=1e-5, atol=1e-5)
    blk = "model.layers.0"
    s_attn, s_mlp, s_down = (
        folds[f"{blk}.input_layernorm"],
        folds[f"{blk}.post_attention_layernorm"],
        folds[f"{blk}.mlp.up_proj"],
    )
    folded = {
        f"{blk}.self_attn.q_proj": base.get_submodule(f"{blk}.self_attn.q_proj").weight * s_attn,
        f"{blk}.mlp.up_proj": base.get_submodule(f"{blk}.mlp.up_proj").weight * s_mlp / s_down.reshape(-1, 1),
        f"{blk}.mlp.down_proj": base.get_submodule(f"{blk}.mlp.down_proj").weight * s_down,
    }
    for name, want in folded.items():
        layer = student.get_submodule(name)
        m = layer.fp4_scale_inv.repeat_interleave(16, dim=1)
        same = torch.round(want / m * 2) == torch.round(layer.fp4_weight().dequantize(torch.float32) / m * 2)
        same &= (want / m).abs() < 2  # the fine part of the E2M1 grid, where round(2 v) / 2 is its rounding
        assert same.float().mean() > 0.3, name
        torch.testing.assert_close(layer.weight.detach()[same], want[same].detach(), rtol=1e-6, atol=0), name


def test_from_ptq_reference_needs_an_fp4_scheme(base, data):
    ptq_model = ptq.quantize(copy.deepcopy(base), "int8-weight-only", calib(data[:2]), gptq=True)
    with pytest.raises(ValueError, match="FP4"):
        qat.from_ptq(ptq_model, reference=base)


def test_from_ptq_refuses_a_float_model(base):
    with pytest.raises(ValueError, match="qat.prepare"):
        qat.from_ptq(copy.deepcopy(base))
