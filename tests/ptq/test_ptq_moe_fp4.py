"""FP4 PTQ of MoE experts (``nvfp4``, ``nvfp4-weight-only``, ``mxfp4-weight-only``; ``fp8kit.ptq.experts``).

Each expert's codes and scales are held bit for bit against ``fp8kit.quantize`` of that expert's weight
alone; one experts layer against a per-token reference built from those quantizations (and NVFP4 inputs
under the layer's static scale), with an SQNR floor over FP32 that one expert's doubled per-tensor scale
falls far below; the calibrated NVFP4 input scales against every token sent through every expert by hand;
whole tiny Qwen3-MoE / Mixtral models, GPTQ, norm tweaking and experts whose dims are not whole blocks.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fp8kit
from fp8kit.numerics.scaling import nvfp4_tensor_scale
from fp8kit.numerics.state_dict import unpack_fp4
from fp8kit.ptq import quantize
from fp8kit.ptq.experts import QuantExperts, dequantize_experts_module, quantize_experts_module
from tests.helpers.moe import qwen3_moe_config, tiny_moe_model
from tests.helpers.numerics import sqnr_db

SCHEMES = ["nvfp4", "nvfp4-weight-only", "mxfp4-weight-only"]
GRAN = {"nvfp4": "nvfp4", "nvfp4-weight-only": "nvfp4", "mxfp4-weight-only": "mxfp4"}


def _ids(seed: int = 0, batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _loop(ids: torch.Tensor):
    return lambda m: [m(ids[i : i + 2]) for i in range(0, ids.shape[0], 2)]


def _layer_inputs(seed: int = 0, tokens: int = 24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    wts = torch.softmax(torch.randn(tokens, 2, generator=g), dim=-1)
    return x, idx, wts


def _quantized_layer(scheme: str):
    """Layer 0's experts of the tiny Qwen3-MoE, a quantized copy, and its inputs (W4A4: the layer's amax)."""
    module = copy.deepcopy(tiny_moe_model("qwen3_moe").model.layers[0].mlp.experts)
    x, idx, wts = _layer_inputs()
    amax = None
    if scheme == "nvfp4":
        h = torch.nn.functional.silu(x @ module.gate_up_proj[:, :32].transpose(1, 2)) * (
            x @ module.gate_up_proj[:, 32:].transpose(1, 2)
        )
        amax = (float(x.abs().max()), float(h.detach().abs().max()))
    q = quantize_experts_module(copy.deepcopy(module), scheme, amax, copy=False)
    return module, q, (x, idx, wts)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_experts_codes_and_scales_are_its_own_quantize(scheme):
    """Packed codes, block scales and NVFP4's per-tensor scale of each expert equal ``fp8kit.quantize`` of that
    expert's ``(out, in)`` weight (the fused gate_up as one matrix: one per-tensor scale for gate and up)."""
    module, q, _ = _quantized_layer(scheme)
    for p, name in enumerate(("gate_up_proj", "down_proj")):
        w = getattr(module, name).detach()
        assert q.weight_codes(p).dtype == torch.uint8 and q.weight_codes(p).shape == (8, w.shape[1], w.shape[2] // 2)
        for e in range(8):
            ref = fp8kit.quantize(w[e], "e2m1", granularity=GRAN[scheme])
            assert torch.equal(unpack_fp4(q.weight_codes(p)[e]), ref.data)
            assert torch.equal(q.weight_scale(p)[e].view(torch.uint8), ref.scales.view(torch.uint8))
            if ref.global_scale is None:
                assert q.weight_scale_2(p) is None
            else:
                assert torch.equal(q.weight_scale_2(p)[e, 0], ref.global_scale)
            assert torch.equal(q.dequantized_weight(p)[e], ref.dequantize(torch.float32))
            assert torch.equal(q.expert_fp4_weight(p, e).dequantize(torch.float32), ref.dequantize(torch.float32))


def _reference(module, q, x, idx, wts, scheme: str) -> torch.Tensor:
    """Token by token: each expert's weights as ``fp8kit.quantize`` of that expert gives them, W4A4 inputs
    quantized to NVFP4 under the layer's static input scale (1x16 blocks are per token), top-k weighted sum."""
    gran = GRAN[scheme]
    w = {
        (p, e): fp8kit.quantize(getattr(module, n).detach()[e], "e2m1", granularity=gran).dequantize(torch.float32)
        for p, n in enumerate(("gate_up_proj", "down_proj"))
        for e in range(8)
    }
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e, h = int(idx[t, j]), x[t : t + 1]
            for p in (0, 1):
                if scheme == "nvfp4":
                    h = fp8kit.quantize(h, "e2m1", granularity="nvfp4", global_scale=q.input_scale(p)).dequantize(
                        torch.float32
                    )
                h = h @ w[p, e].t()
                if p == 0:
                    gate, up = h.chunk(2, dim=-1)
                    h = torch.nn.functional.silu(gate) * up
            out[t] += wts[t, j] * h[0]
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_experts_layer_is_the_per_expert_reference_and_a_wrong_scale_falls_below(scheme):
    module, q, (x, idx, wts) = _quantized_layer(scheme)
    with torch.no_grad():
        out = q(x, idx, wts)
        full = module(x, idx, wts)
    ref = _reference(module, q, x, idx, wts, scheme)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6 * float(ref.abs().max()) + 1e-7)
    floor = {"nvfp4": 10, "nvfp4-weight-only": 12, "mxfp4-weight-only": 12}[scheme]
    good = sqnr_db(full, out)  # 12.0 / 15.2 / 14.1 dB measured
    assert floor < good < 40
    with torch.no_grad():  # one expert's weights at twice their scale (NVFP4) or one E8M0 step up (MXFP4)
        if scheme.startswith("nvfp4"):
            q.down_proj_weight_scale_2[idx[0, 0]] *= 2
        else:
            q.down_proj_weight_scale[idx[0, 0]] += 1
        bad = sqnr_db(full, q(x, idx, wts))
    assert bad < floor - 4, (good, bad)  # 5.1 / 5.5 / 6.0 dB measured


def test_w4a4_input_scales_are_the_max_over_experts_of_every_token_through_every_expert():
    """``nvfp4``: ``gate_up``'s input scale from the layer's tokens, ``down_proj``'s from the max over experts of
    ``act(gate_up_e(x))`` for every token (not only the routed ones), each ``nvfp4_tensor_scale(amax)``."""
    model = tiny_moe_model("qwen3_moe").eval()
    ids = _ids()
    seen: list[torch.Tensor] = []
    experts = model.model.layers[1].mlp.experts
    hook = experts.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).detach().reshape(-1, 64)),
        with_kwargs=True,
    )
    with torch.no_grad():
        _loop(ids)(model)
    hook.remove()
    x = torch.cat(seen)
    gu = experts.gate_up_proj.detach()
    h = torch.nn.functional.silu(x @ gu[:, :32].transpose(1, 2)) * (x @ gu[:, 32:].transpose(1, 2))  # (E, T, I)
    q = quantize(copy.deepcopy(model), "nvfp4", _loop(ids))
    qe = q.model.layers[1].mlp.experts
    assert torch.equal(qe.gate_up_proj_input_scale, nvfp4_tensor_scale(x.abs().max()).reshape(1))
    want = nvfp4_tensor_scale(h.abs().amax(dim=(1, 2)).max()).reshape(1)
    torch.testing.assert_close(qe.down_proj_input_scale, want, rtol=2**-22, atol=0)
    routed = q.ptq_report.expert_tokens["model.layers.1.mlp.experts"]
    assert sum(routed) == ids.numel() * 2


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_whole_models_quantize_every_expert_to_fp4(arch, scheme, monkeypatch):
    model = tiny_moe_model(arch).eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    q = quantize(copy.deepcopy(model), scheme, _loop(ids))
    experts = [m for m in q.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 == len(q.ptq_report.experts)
    for m in experts:
        assert m.scheme.name == scheme and m.weight_codes(0).dtype == torch.uint8
        assert not any(p.dim() == 3 for p in m.parameters())
    calls = []
    project = QuantExperts.project
    monkeypatch.setattr(QuantExperts, "project", lambda self, *a: calls.append(1) or project(self, *a))
    with torch.no_grad():
        out = q(ids).logits
    assert len(calls) == 4  # both projections of both layers ran on the FP4 codes
    assert 11 < sqnr_db(ref, out) < 40  # 15.0 to 18.2 dB measured (every Linear in FP4 too)


def test_gptq_rounds_fp4_experts_with_their_scales_fixed():
    model = tiny_moe_model("qwen3_moe").eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    rtn = quantize(copy.deepcopy(model), "nvfp4-weight-only", _loop(ids))
    gptq = quantize(copy.deepcopy(model), "nvfp4-weight-only", _loop(ids), gptq=True)
    a, b = rtn.model.layers[0].mlp.experts, gptq.model.layers[0].mlp.experts
    for p in (0, 1):
        assert torch.equal(a.weight_scale(p).view(torch.uint8), b.weight_scale(p).view(torch.uint8))
        assert torch.equal(a.weight_scale_2(p), b.weight_scale_2(p))
        assert not torch.equal(a.weight_codes(p), b.weight_codes(p))
    with torch.no_grad():
        assert sqnr_db(ref, gptq(ids).logits) > sqnr_db(ref, rtn(ids).logits) + 2  # 22.5 vs 17.5 dB measured


def test_norm_tweaking_runs_through_fp4_experts_and_dequantize_restores_them():
    model = tiny_moe_model("qwen3_moe").eval()
    ids = _ids()
    q = quantize(copy.deepcopy(model), "nvfp4", _loop(ids), norm_tweak=2)
    assert q.ptq_report.norm_tweak is not None
    experts = q.model.layers[0].mlp.experts
    want = [experts.dequantized_weight(p) for p in (0, 1)]
    back = dequantize_experts_module(experts)
    assert not isinstance(back, QuantExperts)
    assert torch.equal(back.gate_up_proj.data, want[0]) and torch.equal(back.down_proj.data, want[1])


def test_experts_whose_dims_are_not_whole_blocks_stay_in_high_precision():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(qwen3_moe_config(moe_intermediate_size=48)).eval()  # down_proj's input: 48
    q = quantize(copy.deepcopy(model), "mxfp4-weight-only")
    assert not any(isinstance(m, QuantExperts) for m in q.modules())
    why = q.ptq_report.skipped["model.layers.0.mlp.experts"]
    assert "down_proj's input dim 48 is not a multiple of mxfp4-weight-only's 32-element blocks" in why
    q(_ids())  # the rest of the model quantized, the experts as they were
    q = quantize(copy.deepcopy(model), "nvfp4-weight-only")  # 48 = 3 NVFP4 blocks
    assert len(q.ptq_report.experts) == 2
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_experts_module(copy.deepcopy(model.model.layers[0].mlp.experts), "mxfp4-weight-only")
