"""AWQ-style scale search (``fp8kit.ptq.awq``): lower weight-only error with outlier input channels,
function-preserving folds."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8kit.ptq import apply_awq, quantize
from fp8kit.ptq.awq import awq_scales
from fp8kit.ptq.smoothquant import find_mappings
from tests.helpers.models import tiny_llama_config


def outlier_inputs(n: int = 512, k: int = 64, outliers: int = 4, size: float = 30.0) -> torch.Tensor:
    x = torch.randn(n, k)
    x[:, :outliers] *= size
    return x


def test_awq_lowers_weight_only_error_with_outlier_channels():
    x = outlier_inputs()
    weights = [0.05 * torch.randn(48, 64), 0.05 * torch.randn(32, 64)]
    s, alpha, errors = awq_scales(x, x.abs().mean(0), weights, "int8-weight-only")
    assert alpha > 0 and errors[0.0] > 0
    assert min(errors.values()) < 0.7 * errors[0.0], errors  # alpha = 0 is plain rounding
    assert s[:4].min() > s[4:].max()  # the salient (outlier) channels get the larger scales


def test_apply_awq_keeps_the_function_and_lowers_quantized_error():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config()).eval()
    with torch.no_grad():  # plant outlier channels in the residual stream, as LLMs have
        model.model.layers[0].input_layernorm.weight[:3] *= 20
        model.model.layers[1].post_attention_layernorm.weight[:3] *= 20
    data = [torch.randint(0, 256, (2, 32)) for _ in range(3)]
    loop = lambda m: [m(input_ids=x) for x in data]  # noqa: E731
    with torch.no_grad():
        ref = [model(input_ids=x).logits for x in data]
        folded = copy.deepcopy(model)
        targets = {n for n, m in folded.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
        alphas = apply_awq(folded, find_mappings(folded, targets), loop, "int8-weight-only")
        assert len(alphas) == 6 and any(a > 0 for a in alphas.values())
        for x, r in zip(data, ref, strict=True):  # the folds alone do not change the model
            torch.testing.assert_close(folded(input_ids=x).logits, r, rtol=1e-4, atol=1e-4)

        def err(m):
            return sum(float((m(input_ids=x).logits - r).pow(2).mean()) for x, r in zip(data, ref, strict=True))

        plain = quantize(copy.deepcopy(model), "int8-weight-only", loop)
        awq = quantize(copy.deepcopy(model), "int8-weight-only", loop, awq=True)
        assert awq.ptq_report.awq and "AWQ" in str(awq.ptq_report)
        assert err(awq) < err(plain), (err(awq), err(plain))


def test_awq_refuses_activation_quantized_schemes():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    with pytest.raises(ValueError, match="weight-only"):
        quantize(model, "int8-smoothquant", lambda m: None, awq=True)
    with pytest.raises(ValueError, match="awq needs calibration data"):
        quantize(model, "int8-weight-only", awq=True)
