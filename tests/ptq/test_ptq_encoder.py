"""PTQ of a BERT-style encoder (LayerNorm with bias, GELU MLP, post-LN): embedding cosine to the
unquantized model; SmoothQuant folds only where the model's function is kept."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8kit.ptq import quantize
from fp8kit.ptq.smoothquant import SmoothMapping, find_mappings, fold_scales

COSINE = 0.995  # every scheme measured >= 0.999 here; a wrong fold measured ~0.9 or lower


@pytest.fixture(scope="module")
def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = BertModel(cfg, add_pooling_layer=False).eval().requires_grad_(False)
    with torch.no_grad():  # a trained encoder's LayerNorms are not the identity: give them outlier channels
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn_like(m.weight))
                m.weight[:2] *= 8
                m.bias.copy_(0.2 * torch.randn_like(m.bias))
    data = [torch.randint(0, 128, (4, 24)) for _ in range(3)]
    return model, data


def embed(model, x):
    return model(input_ids=x).last_hidden_state.mean(dim=1)


def cosine(a, b, data):
    return min(float(F.cosine_similarity(embed(a, x), embed(b, x), dim=-1).min()) for x in data)


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"])
def test_encoder_embeddings_stay_close(bert, scheme):
    model, data = bert
    loop = lambda m: [m(input_ids=x) for x in data]  # noqa: E731
    with torch.no_grad():
        q = quantize(copy.deepcopy(model), scheme, loop, gptq=True)
        assert len(q.ptq_report.quantized) == 12  # q, k, v, attention.output, intermediate, output per layer
        if scheme == "int8-smoothquant":
            assert q.ptq_report.smoothed == [f"encoder.layer.{i}.attention.self.value" for i in range(2)]
        assert cosine(q, model, data) > COSINE


def test_smoothing_folds_keep_the_encoder_function_and_a_layernorm_fold_would_not(bert):
    model, data = bert
    targets = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():
        good = copy.deepcopy(model)
        for mp in find_mappings(good, targets):
            fold_scales(good, mp, torch.rand(64) * 4 + 0.25)
        assert cosine(good, model, data) > 0.99999
        # the post-LN LayerNorm also feeds the residual: folding into it (as into Llama's pre-LN norms) is wrong
        wrong = copy.deepcopy(model)
        mp = SmoothMapping("encoder.layer.0.attention.output.LayerNorm", ["encoder.layer.0.intermediate.dense"])
        fold_scales(wrong, mp, torch.rand(64) * 4 + 0.25)
        assert cosine(wrong, model, data) < COSINE


def test_layernorm_with_bias_fold_keeps_a_pre_ln_block():
    """Where a LayerNorm feeds only the smoothed layers (pre-LN), the fold divides its weight and bias."""
    block = nn.ModuleDict({"norm": nn.LayerNorm(16), "fc": nn.Linear(16, 8)}).requires_grad_(False)
    with torch.no_grad():
        block.norm.weight.normal_()
        block.norm.bias.normal_()
    x = torch.randn(5, 16)
    ref = block.fc(block.norm(x))
    fold_scales(block, SmoothMapping("norm", ["fc"]), torch.rand(16) + 0.5)
    torch.testing.assert_close(block.fc(block.norm(x)), ref, rtol=1e-5, atol=1e-5)
