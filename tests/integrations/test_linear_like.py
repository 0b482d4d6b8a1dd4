"""Linear layers that are not plain ``nn.Linear``: transformers' ``Conv1D`` (GPT-2, weight stored ``(in, out)``) and
``nn.Linear`` subclasses, through ``convert`` (training), ``ptq.quantize`` and the export read back by transformers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import fp8kit
from fp8kit import nn as fnn
from fp8kit import ptq
from fp8kit.export import load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).pow(2).mean() / b.pow(2).mean())


def test_convert_trains_gpt2_conv1d_in_place():
    model = tiny_gpt2()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = model(x).logits
    c_attn = model.transformer.h[0].attn.c_attn
    weight, keys = c_attn.weight, list(model.state_dict())
    c_attn.note = "kept"
    calls = []
    c_attn.register_forward_hook(lambda *args: calls.append(1))
    fp8kit.convert(model, "current")
    report = model.fp8_conversion_report
    conv1d = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    assert len(conv1d) == 8 and sorted(report.converted) == sorted(conv1d)
    assert isinstance(c_attn, fnn.Linear) and isinstance(c_attn, Conv1D)  # both: transformers' checks still hold
    assert c_attn.weight is weight and c_attn.note == "kept" and weight.shape == (64, 192)
    assert [k for k in model.state_dict() if not k.endswith("_extra_state")] == keys  # (in, out) layout kept
    out = model(x, labels=x)
    out.loss.backward()
    assert calls and torch.isfinite(out.loss) and torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0
    assert rel(out.logits.detach(), ref) < 1e-2  # FP8 GEMMs on the transposed view, not on (in, out) as (out, in)


class Scaled(nn.Linear):
    """A subclass keeping nn.Linear.forward (an attribute-only subclass)."""


class OwnForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class FalconLike(nn.Linear):
    """Its own forward, computing x @ W.T + b (transformers' FalconLinear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def test_convert_takes_linear_subclasses_that_keep_linear_forward():
    model = nn.Sequential(Scaled(32, 32), OwnForward(32, 32), FalconLike(32, 32))
    fp8kit.convert(model, "current")
    report = model.fp8_conversion_report
    assert report.converted == ["0", "2"] and isinstance(model[0], Scaled) and isinstance(model[0], fnn.Linear)
    assert "does not compute" in report.skipped["1"] and type(model[1]) is OwnForward
    assert isinstance(model[2], FalconLike) and isinstance(model[2], fnn.Linear)


def test_ptq_export_of_gpt2_reloads_in_transformers_and_fp8kit(tmp_path):
    model = tiny_gpt2()
    x = torch.randint(0, 256, (2, 16))
    q = ptq.quantize(copy.deepcopy(model), "fp8-dynamic")
    assert len(q.ptq_report.quantized) == 8  # every Conv1D
    with torch.no_grad():
        ours, ref = q(x).logits, model(x).logits
    out = save_pretrained(q, tmp_path / "gpt2")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["targets"] == ["Linear", "Conv1D"] and qc["dequantize"] is True
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("transformer.h.0.attn.c_attn.weight").shape == (64, 192)  # GPT-2's (in, out)
    reloaded = load_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, ours, rtol=0, atol=0)
        theirs = hf(x).logits
    # transformers dequantizes the weights (same values) and runs the activations in high precision
    assert rel(theirs, ours) < rel(ours, ref)


def test_ptq_leaves_conv1d_out_of_blocked_schemes_with_the_reason():
    with pytest.raises(ValueError, match="Conv1D stores its weight"):
        ptq.quantize(tiny_gpt2(), "nvfp4-weight-only")
