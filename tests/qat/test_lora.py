"""LoRA (peft) on a quantized base: adapters below quantized layers get the gradients they would get on the
dequantized float base (a dropped input gradient fails this), and ``merge_lora`` re-quantizes base + adapter."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8kit import ptq
from fp8kit.qat.lora import lora_config, merge_lora
from tests.helpers.models import calib, tiny_llama, token_batches

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def dequantized_base(q):
    """The float model computing with ``q``'s dequantized weights (nn.Linear layers)."""
    f = copy.deepcopy(q)
    for name in q.ptq_report.quantized:
        layer = q.get_submodule(name)
        lin = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        with torch.no_grad():
            lin.weight.copy_(layer.dequantized_weight())
        parent, _, attr = name.rpartition(".")
        setattr(f.get_submodule(parent), attr, lin)
    return f


def adapter_grads(model, ids):
    model.zero_grad()
    model(ids).logits.float().pow(2).mean().backward()
    params = {n: p for n, p in model.named_parameters() if "lora_" in n and ".layers.0." in n}
    return {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in params.items()}


def with_adapters(model, config):
    torch.manual_seed(1)  # the same adapter initialisation on both bases
    return peft.get_peft_model(model, config)


@pytest.fixture(scope="module")
def data():
    return token_batches(256, 2, (2, 16))


@pytest.mark.parametrize("scheme", ["int8-weight-only", "nvfp4-weight-only"])
def test_adapter_gradients_below_quantized_layers_match_the_dequantized_base(data, scheme, monkeypatch):
    q = ptq.quantize(tiny_llama(), scheme, calib(data[:1]))
    f = dequantized_base(q)
    kw = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False}
    pq = with_adapters(q, lora_config(**kw))
    pf = with_adapters(f, peft.LoraConfig(**kw))
    gq, gf = adapter_grads(pq, data[1]), adapter_grads(pf, data[1])
    assert len(gq) == 2 * len(TARGETS) and gq.keys() == gf.keys()
    for n in gq:
        torch.testing.assert_close(gq[n], gf[n], rtol=1e-4, atol=1e-6, msg=n)
    # a base that drops its input gradient (computes without it) gives other adapter gradients
    forward = ptq.QuantLinear.forward
    monkeypatch.setattr(ptq.QuantLinear, "forward", lambda self, x: forward(self, x.detach()))
    dropped = adapter_grads(pq, data[1])
    assert any(not torch.allclose(dropped[n], gf[n], rtol=1e-4, atol=1e-6) for n in gf)


def test_merge_lora_requantizes_base_plus_adapter(data):
    q = ptq.quantize(tiny_llama(), "nvfp4-weight-only", calib(data[:1]))
    pq = with_adapters(q, lora_config(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    layer = pq.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        expect_w = layer.get_base_layer().dequantized_weight() + layer.get_delta_weight("default")
    with pytest.raises(ValueError, match="merge_lora"):
        layer.merge()
    merged = merge_lora(pq)
    new = merged.model.layers[0].self_attn.q_proj
    assert isinstance(new, ptq.QuantLinear) and new.scheme.name == "nvfp4-weight-only"
    lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(expect_w)
    again = ptq.QuantLinear.from_linear(lin, "nvfp4-weight-only")
    assert torch.equal(new.weight, again.weight) and torch.equal(new.dequantized_weight(), again.dequantized_weight())
    assert merged.ptq_report.scheme == "nvfp4-weight-only"
