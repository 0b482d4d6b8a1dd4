"""GPTQ (``fp8kit.ptq.gptq``): lower layer output error than round-to-nearest on correlated inputs,
with the scales and code format that ``QuantLinear.from_linear`` stores."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fp8kit.numerics.formats import E4M3, INT8
from fp8kit.numerics.tensor import quantize as fp8_quantize
from fp8kit.ptq import QuantLinear, collect_hessians, gptq_linear, gptq_weight, quantize
from tests.helpers.models import tiny_llama_config


def correlated_inputs(n: int = 2048, k: int = 128, rank: int = 8) -> torch.Tensor:
    """Inputs with low-rank correlated channels (as LLM activations are) plus a little noise."""
    return torch.randn(n, rank) @ torch.randn(rank, k) + 0.05 * torch.randn(n, k)


@pytest.mark.parametrize(("fmt", "per_channel"), [(INT8, True), (E4M3, True), (E4M3, False)])
def test_gptq_lowers_output_error_vs_round_to_nearest(fmt, per_channel):
    x, w = correlated_inputs(), 0.1 * torch.randn(64, 128)
    h = 2 * x.t() @ x / x.shape[0]
    codes, amax, deq = gptq_weight(w, h, fmt, per_channel)
    rtn = fp8_quantize(w, fmt, "row" if per_channel else "tensor").dequantize(torch.float32)
    ref = x @ w.t()
    ratio = float((x @ deq.t() - ref).pow(2).mean() / (x @ rtn.t() - ref).pow(2).mean())
    assert ratio < 0.3, ratio  # measured ~0.03-0.04: a clear margin
    assert codes.dtype == fmt.dtype
    # the dequantized weight is the codes times the scales fixed from the original weight
    assert torch.equal(amax, w.abs().amax(dim=1) if per_channel else w.abs().amax().reshape(1))
    assert torch.allclose(deq, codes.float() * (amax / fmt.max).reshape(-1, 1), rtol=1e-6, atol=0)


def test_gptq_linear_keeps_the_export_format():
    lin = nn.Linear(128, 32).requires_grad_(False)
    x = correlated_inputs(512)
    h = 2 * x.t() @ x / x.shape[0]
    for scheme in ("fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"):
        rtn = QuantLinear.from_linear(lin, scheme, input_amax=float(x.abs().max()))
        q = gptq_linear(lin, h, scheme, input_amax=float(x.abs().max()))
        assert q.weight.dtype == rtn.weight.dtype and q.weight.shape == rtn.weight.shape
        assert torch.equal(q.weight_scale, rtn.weight_scale)  # scales fixed before the sweep
        assert not torch.equal(q.weight, rtn.weight)  # the codes did change
        err_q = (q(x) - lin(x)).pow(2).mean()
        err_r = (rtn(x) - lin(x)).pow(2).mean()
        assert err_q < err_r, (scheme, float(err_q), float(err_r))


def test_gptq_refuses_bad_input():
    w, h = torch.randn(8, 16), torch.eye(16)
    with pytest.raises(ValueError, match="Hessian of shape"):
        gptq_weight(w, torch.eye(8), INT8, True)
    with pytest.raises(ValueError, match="damping"):
        gptq_weight(w, h, INT8, True, damping=0)
    with pytest.raises(ValueError, match="NaN"):
        gptq_weight(w, h * float("nan"), INT8, True)


def test_dead_inputs_get_zero_columns_and_hessians_are_shared_per_input():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config()).eval()
    data = [torch.randint(0, 256, (2, 16)) for _ in range(2)]
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"]
    hs = collect_hessians(model, names, lambda m: [m(input_ids=x) for x in data])
    assert torch.equal(hs[names[0]], hs[names[1]])  # same input, same Hessian
    assert hs[names[2]].shape == (128, 128)
    w, h = torch.randn(4, 6), torch.eye(6)
    h[2, 2] = 0
    codes, _, _ = gptq_weight(w, h, INT8, True)
    assert (codes[:, 2] == 0).all()


def test_quantize_with_gptq_lowers_model_output_error():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config()).eval()
    data = [torch.randint(0, 256, (2, 32)) for _ in range(3)]
    loop = lambda m: [m(input_ids=x) for x in data]  # noqa: E731
    with torch.no_grad():
        ref = [model(input_ids=x).logits for x in data]

        def err(m):
            return sum(float((m(input_ids=x).logits - r).pow(2).mean()) for x, r in zip(data, ref, strict=True))

        for scheme in ("fp8", "int8-weight-only"):
            rtn = quantize(copy.deepcopy(model), scheme, loop)
            gq = quantize(copy.deepcopy(model), scheme, loop, gptq=True)
            assert gq.ptq_report.gptq and "GPTQ" in str(gq.ptq_report)
            assert err(gq) < 0.8 * err(rtn), (scheme, err(gq), err(rtn))


def test_collect_hessians_equals_each_layers_own_product():
    """Each layer's Hessian is its own inputs' ``2 X^T X / N``, computed here without sharing. A later
    layer's input may be allocated at a freed input's address with the same shape and version; a cache
    keyed by address then handed that layer a stale product (measured: the MLPs of both layers here)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(hidden_size=256, intermediate_size=512)).eval().requires_grad_(False)
    data = [torch.randint(0, 256, (4, 128)) for _ in range(4)]
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    hessians = collect_hessians(model, names, lambda m: [m(input_ids=x) for x in data])
    sums = dict.fromkeys(names, 0.0)
    counts = dict.fromkeys(names, 0)

    def own(name):
        def hook(_m, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            sums[name] = sums[name] + x.t() @ x
            counts[name] += x.shape[0]

        return hook

    hooks = [model.get_submodule(n).register_forward_pre_hook(own(n)) for n in names]
    with torch.no_grad():
        for x in data:
            model(input_ids=x)
    for h in hooks:
        h.remove()
    wrong = [n for n in names if not torch.allclose(hessians[n], 2 * sums[n] / counts[n], rtol=1e-5, atol=1e-6)]
    assert not wrong, wrong
