"""Norm tweaking (``quantize(norm_tweak=N)``, ``fp8kit.ptq.norm_tweak``): only norm weights change, the
calibration KL to the high-precision model falls, and gradients pass the quantizers straight through."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8kit.ptq import QuantLinear, quantize
from fp8kit.ptq.norm_tweak import norm_parameters, tweak_norms
from tests.helpers.models import tiny_llama_config


@pytest.fixture
def llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval().requires_grad_(False)
    with torch.no_grad():  # a trained model's activations are not tiny: larger weights, uneven norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.rand_like(p))
            else:
                p.mul_(4)
    calib = [torch.randint(0, 256, (4, 32)) for _ in range(4)]
    return model, calib


def kl_to(ref: nn.Module, model: nn.Module, data) -> float:
    """Mean KL(ref || model) per token over ``data``."""
    total = 0.0
    with torch.no_grad():
        for x in data:
            t = F.log_softmax(ref(input_ids=x).logits.float().reshape(-1, 256), -1)
            s = F.log_softmax(model(input_ids=x).logits.float().reshape(-1, 256), -1)
            total += float(F.kl_div(s, t, log_target=True, reduction="batchmean"))
    return total / len(data)


@pytest.mark.parametrize("scheme", ["fp8", "int8-smoothquant"])
def test_straight_through_gradient_and_unchanged_forward(scheme):
    lin = nn.Linear(64, 32).requires_grad_(False)
    x = torch.randn(8, 64)
    q = QuantLinear.from_linear(lin, scheme, input_amax=float(x.abs().max()))
    with torch.no_grad():
        ref = q(x)  # the inference kernels
    xg = x.clone().requires_grad_(True)
    out = q(xg)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)  # same quantized math, other accumulation order
    g = torch.randn_like(out)
    out.backward(g)
    # straight through the activation quantizer, through the frozen dequantized weight
    assert torch.allclose(xg.grad, g @ q.dequantized_weight(), rtol=1e-5, atol=1e-6)


def test_norm_tweak_lowers_kl_and_changes_only_norm_weights(llama):
    model, calib = llama
    plain = quantize(copy.deepcopy(model), "fp8", lambda m: [m(input_ids=x) for x in calib], calibration="mse")
    tuned = quantize(
        copy.deepcopy(model),
        "fp8",
        lambda m: [m(input_ids=x) for x in calib],
        calibration="mse",
        norm_tweak=40,
        norm_tweak_lr=1e-2,
    )
    res = tuned.ptq_report.norm_tweak
    assert res is not None and not res.reverted and res.steps == 40
    assert res.parameters == sum(p.numel() for p in norm_parameters(model).values()) == 5 * 64
    assert res.loss_after < 0.93 * res.loss_before, res  # measured 0.87x; frozen norms give 1.0x
    # the reported losses are the real calibration KL of the models (whether it carries to other text is
    # measured on SmolLM2's dev split, BENCHMARKS.md: a random tiny model has nothing to generalise)
    assert abs(kl_to(model, tuned, calib) - res.loss_after) < 1e-3 * res.loss_after
    assert abs(kl_to(model, plain, calib) - res.loss_before) < 1e-3 * res.loss_before
    # only the norm weights moved: codes, scales and every other parameter are as calibrated
    p_sd, t_sd = plain.state_dict(), tuned.state_dict()
    assert p_sd.keys() == t_sd.keys()
    changed = {k for k in p_sd if not torch.equal(p_sd[k], t_sd[k])}
    assert changed and changed <= set(norm_parameters(model))
    assert not any(p.requires_grad for p in tuned.parameters())  # flags restored
    assert "norm tweaking" in str(tuned.ptq_report)


def test_tweaked_norms_travel_in_the_export(llama, tmp_path):
    from fp8kit.export import load_pretrained, save_pretrained

    model, calib = llama
    tuned = quantize(model, "fp8", lambda m: [m(input_ids=x) for x in calib], norm_tweak=10, norm_tweak_lr=1e-2)
    assert not tuned.ptq_report.norm_tweak.reverted
    loaded = load_pretrained(save_pretrained(tuned, tmp_path / "q"))
    norms = norm_parameters(tuned)
    for name, p in norm_parameters(loaded).items():
        assert torch.equal(p, norms[name]), name
    x = calib[0]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, tuned(input_ids=x).logits, rtol=1e-4, atol=1e-4)


def test_norm_tweak_reverts_when_it_does_not_help(llama):
    model, calib = llama
    q = quantize(copy.deepcopy(model), "fp8", lambda m: [m(input_ids=x) for x in calib])
    start = {k: v.clone() for k, v in norm_parameters(q).items()}
    from fp8kit.ptq.layer_error import swap_submodule

    originals = {n: swap_submodule(q, n, copy.deepcopy(model.get_submodule(n))) for n in q.ptq_report.quantized}
    for n, m in originals.items():  # put the quantized layers back; keep the originals as the teacher
        originals[n] = swap_submodule(q, n, m)
    res = tweak_norms(q, originals, lambda m: [m(input_ids=x) for x in calib], steps=5, lr=50.0)
    assert res.reverted and res.loss_after == res.loss_before
    assert all(torch.equal(p, start[k]) for k, p in norm_parameters(q).items())


def test_norm_tweak_with_fp8_kv_cache_restores_the_cache_mode(llama):
    model, calib = llama
    q = quantize(copy.deepcopy(model), "fp8", lambda m: [m(input_ids=x) for x in calib], kv_cache=True, norm_tweak=3)
    modes = {m._fp8kit_kv["mode"] for m in q.modules() if hasattr(m, "_fp8kit_kv")}
    assert modes == {"quantize"}
    assert q.ptq_report.norm_tweak.steps == 3


def test_norm_tweak_on_an_encoder_uses_the_output_error():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    model = BertModel(cfg, add_pooling_layer=False).eval().requires_grad_(False)
    data = [torch.randint(0, 128, (4, 24)) for _ in range(2)]
    q = quantize(model, "fp8", lambda m: [m(input_ids=x) for x in data], norm_tweak=5, norm_tweak_lr=1e-3)
    res = q.ptq_report.norm_tweak
    assert res.metric == "relative squared output error" and res.loss_after <= res.loss_before
    assert res.parameters == sum(p.numel() for p in norm_parameters(model).values()) > 0


def test_norm_tweak_refuses_bad_input(llama):
    model, calib = llama
    loop = lambda m: [m(input_ids=x) for x in calib]  # noqa: E731
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="norm_tweak"):
            quantize(copy.deepcopy(model), "fp8", loop, norm_tweak=bad)
    with pytest.raises(ValueError, match="norm_tweak needs calibration data"):
        quantize(copy.deepcopy(model), "fp8-dynamic", None, norm_tweak=2)
    mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).requires_grad_(False)
    with pytest.raises(ValueError, match="has none"):
        quantize(mlp, "fp8", lambda m: m(torch.randn(4, 16)), module_filter=lambda n, m: True, norm_tweak=2)
