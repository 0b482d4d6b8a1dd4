"""Per-layer sensitivity (``fp8kit.ptq.sensitivity``): a planted bad layer ranks first and ``keep_bf16``
keeps it in high precision."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fp8kit.ptq import QuantLinear, keep_filter, layer_sensitivity, quantize
from fp8kit.ptq.sensitivity import dev_loss
from tests.helpers.models import tiny_llama_config

PLANTED = "model.layers.1.mlp.up_proj"


@pytest.fixture
def planted():
    """A tiny Llama whose ``PLANTED`` layer has one huge weight (on a dead input, so the float model is
    unchanged): under a per-tensor FP8 weight scale every other weight of that layer falls to zero or a
    subnormal code."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config()).eval().requires_grad_(False)
    w = model.get_submodule(PLANTED).weight
    w[5, 7] = 1e4  # one huge weight sets the tensor's scale; the others (std 0.02) fall to 0 or 1 subnormal code
    model.model.layers[1].post_attention_layernorm.weight[7] = 0  # on an input channel that is always zero
    data = [torch.randint(0, 256, (2, 32)) for _ in range(2)]
    return model, (lambda m: [m(input_ids=x) for x in data])


def test_keep_bf16_ranks_the_planted_layer_first_and_keeps_it(planted):
    model, loop = planted
    q = quantize(model, "fp8", loop, keep_bf16=1)
    ranking = q.ptq_report.sensitivity
    assert ranking[0].name == PLANTED, [s.name for s in ranking[:3]]
    assert ranking[0].score > 10 * ranking[1].score
    assert type(q.get_submodule(PLANTED)) is nn.Linear  # kept in high precision
    assert PLANTED in q.ptq_report.skipped and PLANTED not in q.ptq_report.quantized
    assert isinstance(q.get_submodule("model.layers.0.mlp.up_proj"), QuantLinear)


def test_layer_sensitivity_on_dev_loss_and_keep_filter(planted):
    model, loop = planted
    dev = torch.randint(0, 256, (4, 33))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ranking = layer_sensitivity(model, "fp8", loop, dev_loss(dev, batch_size=4))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is untouched
    assert ranking[0].name == PLANTED and ranking[0].score > 0
    assert len(ranking) == 14  # 7 Linears x 2 layers, the head excluded
    q = quantize(model, "fp8", loop, module_filter=keep_filter(ranking, 2))
    assert len(q.ptq_report.quantized) == 12 and type(q.get_submodule(PLANTED)) is nn.Linear


def test_keep_bf16_refuses_bad_values():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="keep_bf16"):
            quantize(model, "fp8-dynamic", lambda m: None, keep_bf16=bad)
    with pytest.raises(ValueError, match="would keep all"):
        quantize(model, "fp8-dynamic", lambda m: None, keep_bf16=14)
