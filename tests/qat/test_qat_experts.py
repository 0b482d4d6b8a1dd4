"""``fp8kit.qat`` on MoE experts: ``QATExperts``' forward is PTQ's ``QuantExperts`` at step 0 bit for bit (the
straight-through path; the inference kernels up to float32 summation order), gradients reach every routed
expert's master weight and the tokens, and ``convert`` + export reload the trained experts."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8kit import ptq, qat
from fp8kit.export import load_pretrained, save_pretrained
from fp8kit.ptq.experts import QuantExperts, dequantize_experts_module, quantize_experts_module
from fp8kit.qat.experts import QATExperts, install_qat_experts, qat_experts
from tests.helpers.moe import tiny_moe_model

pytest.importorskip("transformers")

SCHEMES = ["fp8", "fp8-dynamic", "int8-weight-only", "nvfp4", "nvfp4-weight-only", "mxfp4-weight-only"]


def _ids(seed: int, batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loop(ids: torch.Tensor):
    return lambda m: [m(ids[i : i + 2]) for i in range(0, ids.shape[0], 2)]


def _routed(seed: int = 0, tokens: int = 40):
    """Routed tokens of one experts layer: ``(x (T, 64), top-2 indices, routing weights)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    return x, idx, torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)


def _amax(module, x: torch.Tensor) -> tuple[float, float]:
    """The layer's static input amaxes (gate_up: the tokens; down: every expert's activation, a bound)."""
    gu = module.gate_up_proj
    h = torch.nn.functional.silu(x @ gu[:, :32].transpose(1, 2)) * (x @ gu[:, 32:].transpose(1, 2))
    return float(x.abs().max()), float(h.detach().abs().max())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_step0_experts_are_ptq_bit_for_bit(scheme: str) -> None:
    """One Qwen3-MoE experts layer: QAT's forward equals PTQ's straight-through path bit for bit (with and
    without gradients) and its inference kernel to float32 rounding; the quantizers change the output."""
    module = tiny_moe_model("qwen3_moe").model.layers[0].mlp.experts
    x, idx, wts = _routed()
    amax = _amax(module, x) if ptq.get_scheme(scheme).static_activations else None
    q = quantize_experts_module(copy.deepcopy(module), scheme, amax)
    student = install_qat_experts(copy.deepcopy(module), ptq.get_scheme(scheme), amax)
    assert isinstance(student, QATExperts)
    xg = x.clone().requires_grad_(True)
    expect = q(xg, idx, wts)  # x needs a gradient: QuantExperts' straight-through path
    got = student(x.clone().requires_grad_(True), idx, wts)
    assert torch.equal(got, expect)
    with torch.no_grad():
        assert torch.equal(student(x, idx, wts), expect.detach())
        kernel = q(x, idx, wts)  # the inference kernels
        plain = module(x, idx, wts)
    torch.testing.assert_close(got.detach(), kernel, rtol=1e-5, atol=1e-6)
    assert float((got.detach() - plain).norm() / plain.norm()) > 1e-4  # the quantizers do something


@pytest.mark.parametrize("scheme", ["int8-weight-only", "nvfp4-weight-only"])
def test_gradients_are_straight_through_to_weights_and_tokens(scheme: str) -> None:
    """The master weights and the tokens get the gradients of the same layer whose weights are the dequantized
    ones, through plain autograd; every routed expert's weights get one."""
    module = tiny_moe_model("qwen3_moe").model.layers[0].mlp.experts
    x, idx, wts = _routed(1)
    g = torch.randn(x.shape[0], 64, generator=torch.Generator().manual_seed(2))
    student = install_qat_experts(copy.deepcopy(module), ptq.get_scheme(scheme), None)
    xs = x.clone().requires_grad_(True)
    (student(xs, idx, wts) * g).sum().backward()
    ref = copy.deepcopy(module)
    q = quantize_experts_module(copy.deepcopy(module), scheme, None)
    with torch.no_grad():
        for p, proj in enumerate(q.projections):
            getattr(ref, proj).copy_(q.dequantized_weight(p))
    xr = x.clone().requires_grad_(True)
    (ref(xr, idx, wts) * g).sum().backward()
    for proj in ("gate_up_proj", "down_proj"):
        torch.testing.assert_close(getattr(student, proj).grad, getattr(ref, proj).grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-4, atol=1e-6)
    assert all(bool(student.down_proj.grad[e].abs().sum() > 0) for e in set(idx.flatten().tolist()))


def test_prepare_trains_the_experts_and_convert_exports_them(tmp_path) -> None:
    """A whole tiny Qwen3-MoE, W4A4 NVFP4: prepare picks the experts PTQ picks (calibrated shared input scales
    equal PTQ's), QAD moves the experts, and ``convert`` writes an export that reloads the trained logits."""
    base = tiny_moe_model("qwen3_moe").eval()
    cal, train, held = _ids(0), [_ids(s) for s in range(1, 4)], _ids(9)
    ptq_model = ptq.quantize(copy.deepcopy(base), "nvfp4", _loop(cal))
    student = qat.prepare(copy.deepcopy(base), "nvfp4", _loop(cal))
    assert set(qat_experts(student)) == set(ptq_model.ptq_report.experts) and student.qat_report.experts
    for name in ptq_model.ptq_report.experts:
        a, b = qat_experts(student)[name], ptq_model.get_submodule(name)
        assert all(torch.equal(a.input_scale(p), b.input_scale(p)) for p in range(2))
    start = {n: m.down_proj.detach().clone() for n, m in qat_experts(student).items()}
    qat.distill(student, base, train, steps=3, lr=1e-3, progress=False)
    assert any(not torch.equal(m.down_proj, start[n]) for n, m in qat_experts(student).items())
    with torch.no_grad():
        trained = student(held).logits
    frozen = qat.convert(student)
    assert not qat_experts(frozen) and frozen.ptq_report.experts
    assert all(isinstance(frozen.get_submodule(n), QuantExperts) for n in frozen.ptq_report.experts)
    loaded = load_pretrained(save_pretrained(frozen, tmp_path / "ct"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(held).logits, trained, rtol=1e-4, atol=1e-4)


def test_from_ptq_turns_quantized_experts_into_trainable_ones() -> None:
    base = tiny_moe_model("qwen3_moe").eval()
    ptq_model = ptq.quantize(copy.deepcopy(base), "fp8", _loop(_ids(0)))
    with torch.no_grad():
        expect = ptq_model(_ids(9)).logits
    student = qat.from_ptq(ptq_model)
    assert set(qat_experts(student)) == set(student.qat_report.experts) and student.qat_report.experts
    assert all(m.down_proj.requires_grad for m in qat_experts(student).values())
    with torch.no_grad():
        torch.testing.assert_close(student(_ids(9)).logits, expect, rtol=1e-4, atol=1e-4)


def _grids(model) -> dict[str, tuple[torch.Tensor, ...]]:
    """Each PTQ experts module's FP4 weights per projection: dequantized values (+0 and -0 codes alike), block
    scales and NVFP4's per-tensor scales (as bytes / float32)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantExperts):
            for p, proj in enumerate(m.projections):
                s2 = m.weight_scale_2(p)
                scales = m.weight_scale(p).view(torch.uint8)
                out[f"{name}.{proj}"] = (m.dequantized_weight(p), scales, *(() if s2 is None else (s2,)))
    return out


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-weight-only", "mxfp4-weight-only"])
@pytest.mark.parametrize("with_reference", [False, True])
def test_from_ptq_of_gptq_fp4_experts_keeps_their_codes_and_scales(scheme: str, with_reference: bool) -> None:
    """GPTQ'd FP4 experts: from_ptq keeps each expert's block (and per-tensor) scales, so the student
    computes the PTQ model's logits and converts back to its exact codes and scales; scales recomputed from
    the dequantized weights would move codes (checked, so the test can fail)."""
    base = tiny_moe_model("qwen3_moe").eval()
    ptq_model = ptq.quantize(copy.deepcopy(base), scheme, _loop(_ids(0)), gptq=True, awq=False)
    before = {k: tuple(t.clone() for t in v) for k, v in _grids(ptq_model).items()}
    assert before
    recomputed = copy.deepcopy(ptq_model)
    for m in list(recomputed.modules()):
        if isinstance(m, QuantExperts):
            quantize_experts_module(dequantize_experts_module(m), scheme, (1.0, 1.0))  # scales of the dequantized
    moved = [not torch.equal(before[k][1], v[1]) for k, v in _grids(recomputed).items()]
    assert any(moved), "GPTQ left every block its largest code: this model cannot tell the grids apart"
    with torch.no_grad():
        expect = ptq_model(_ids(9)).logits
    student = qat.from_ptq(ptq_model, reference=base if with_reference else None)
    trained = qat_experts(student)
    assert trained and all(m.fixed_scale_inv(0) is not None for m in trained.values())
    if with_reference:  # the master weights left their grid points, towards the float weights
        off = [not torch.equal(m.master_weight(1), m.dequantized_weight(1)) for m in trained.values()]
        assert all(off)
    with torch.no_grad():
        torch.testing.assert_close(student(_ids(9)).logits, expect, rtol=1e-4, atol=1e-4)
    qat.convert(student)
    after = _grids(student)
    for key, tensors in before.items():
        for want, got in zip(tensors, after[key], strict=True):
            assert torch.equal(got, want), key
