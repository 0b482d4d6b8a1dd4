"""Exact PTQ numerics: weight and activation scales against ``amax / 448`` and ``amax / 127``, KV-cache
k/v scales against their definition, INT8 floors that a scale off by 2x fails, and SmoothQuant runs
(a norm feeding the linears) and folds its factors.

The ``check_*`` functions raise ``AssertionError`` on a wrong implementation; ``tests/numerics/test_mutants.py``
runs them against planted bugs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fp8kit
from fp8kit import E4M3, INT8, ptq
from fp8kit.ptq.schemes import Scheme
from tests.helpers.models import tiny_llama_config
from tests.helpers.numerics import sqnr_db

EVERY = {"module_filter": lambda n, m: True}


def calib(batches):
    def loop(m):
        for x in batches:
            m(x)

    return loop


def linear_and_data(seed: int = 0):
    """``nn.Linear(256, 128)`` (default init) and 4 Gaussian batches, as ``test_ptq.layer_and_data``."""
    torch.manual_seed(seed)
    lin = nn.Linear(256, 128)
    return nn.Sequential(lin), [torch.randn(32, 256) for _ in range(4)]


def f32_div(a: torch.Tensor, d: float) -> torch.Tensor:
    return (a.double() / d).float()


def check_ptq_scales_exact() -> None:
    """Every scheme: weight scale = amax / fmt.max (per tensor or per output channel), weight codes =
    the rounded ``W / scale``, static input scale = calibration amax / fmt.max."""
    model, xs = linear_and_data()
    w = model[0].weight.detach()
    x_amax = max(float(x.abs().max()) for x in xs)
    for name, scheme in ptq.SCHEMES.items():
        q = ptq.quantize(copy.deepcopy(model), name, calib(xs), **EVERY)[0]
        fmt = scheme.weight_format
        per_channel = scheme.weight_strategy == "channel"
        amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().max().reshape(1)
        want = f32_div(amax, fmt.max)
        assert q.weight_scale.shape == want.shape, f"{name}: weight_scale shape {tuple(q.weight_scale.shape)}"
        assert torch.allclose(q.weight_scale, want, rtol=1e-6, atol=0), f"{name}: weight_scale != amax / {fmt.max}"
        y = w / want.reshape(-1, 1) if per_channel else w / want
        codes = fp8kit.cast(y, E4M3) if fmt.kind == "float" else torch.round(y).clamp(-127, 127).to(torch.int8)
        assert torch.equal(q.weight.view(torch.uint8), codes.view(torch.uint8)), f"{name}: weight codes differ"
        if scheme.static_activations:
            want_in = x_amax / scheme.act_format.max
            assert float(q.input_scale) == pytest.approx(want_in, rel=1e-6), f"{name}: input_scale != amax / max"


# INT8 SQNR floors (dB) on linear_and_data: each sits between the correct level and that of a scale
# off by 2x (one bit of INT8 resolution, ~6 dB); measured levels are in test_int8_floors.
INT8_FLOORS = {"int8-smoothquant": 37.5, "int8-weight-only": 46.0}


def int8_sqnr(name: str) -> float:
    model, xs = linear_and_data()
    ref = torch.cat([model(x).detach() for x in xs])
    q = ptq.quantize(copy.deepcopy(model), name, calib(xs), **EVERY)
    return sqnr_db(ref, torch.cat([q(x) for x in xs]))


def check_int8_floors() -> None:
    for name, floor in INT8_FLOORS.items():
        db = int8_sqnr(name)
        assert db >= floor, f"{name}: {db:.2f} dB < {floor}"


class NormMLP(nn.Module):
    """A Llama-style MLP block: RMSNorm ``post_attention_layernorm`` feeding ``gate_proj``/``up_proj``,
    then ``down_proj`` (names SmoothQuant's mapping finder knows)."""

    def __init__(self, d: int = 64, h: int = 128, outlier: float = 40.0, dead: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=1e-6)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, h, bias=False)
        self.mlp.up_proj = nn.Linear(d, h, bias=False)
        self.mlp.down_proj = nn.Linear(h, d, bias=False)
        with torch.no_grad():
            for lin in (self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / lin.in_features**0.5)
            self.post_attention_layernorm.weight[5] = outlier  # an outlier activation channel
            self.post_attention_layernorm.weight[:dead] = 0.0  # dead channels
            self.mlp.up_proj.weight[:dead] = 0.0  # and dead inputs of down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.post_attention_layernorm(x)
        return self.mlp.down_proj(nn.functional.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


def norm_data(seed: int = 6):
    """Calibration batches, and the evaluation input: the same data (static scales are set for its range)."""
    gen = torch.Generator().manual_seed(seed)
    batches = [torch.randn(32, 64, generator=gen) for _ in range(3)]
    return batches, torch.cat(batches)


PLAIN_INT8 = Scheme("int8-static", INT8, "channel", INT8, "tensor", False, "int-quantized", "control")


def check_smoothquant_runs_and_folds(alpha: float = 0.5) -> None:
    """``int8-smoothquant`` on a norm-fed block: both mappings smoothed, the norm weight divided by
    ``s = max|X|**alpha / max|W|**(1-alpha)``, and INT8 accuracy well above plain static INT8."""
    model = NormMLP()
    batches, x = norm_data()
    with torch.no_grad():
        ref = model(x)
        h = torch.cat([model.post_attention_layernorm(b) for b in batches])
    x_amax = h.abs().amax(0).double()
    w_amax = torch.maximum(model.mlp.gate_proj.weight.abs().amax(0), model.mlp.up_proj.weight.abs().amax(0)).double()
    s = (x_amax**alpha / w_amax ** (1 - alpha)).clamp(1e-4, 1e4)
    q = ptq.quantize(copy.deepcopy(model), "int8-smoothquant", calib(batches), alpha=alpha)
    assert sorted(q.ptq_report.smoothed) == ["mlp.up_proj", "post_attention_layernorm"], q.ptq_report.smoothed
    folded = q.post_attention_layernorm.weight.detach().double()
    want = model.post_attention_layernorm.weight.detach().double() / s
    assert torch.allclose(folded, want, rtol=1e-5, atol=0), "norm weight is not divided by the smoothing factors"
    with torch.no_grad():
        sq = q(x)
        plain = ptq.quantize(copy.deepcopy(model), PLAIN_INT8, calib(batches))(x)
    db_sq, db_plain = sqnr_db(ref, sq), sqnr_db(ref, plain)
    assert db_sq > db_plain + 3, f"SmoothQuant {db_sq:.1f} dB vs plain static INT8 {db_plain:.1f} dB"


def check_smoothquant_zero_variance() -> None:
    """Dead input channels (zero norm gain, zero rows of ``up_proj``): SmoothQuant still runs, their
    factor is 1 (weights unchanged there), and the output is finite and accurate."""
    model = NormMLP(dead=8)
    batches, x = norm_data()
    q = ptq.quantize(copy.deepcopy(model), "int8-smoothquant", calib(batches))
    assert sorted(q.ptq_report.smoothed) == ["mlp.up_proj", "post_attention_layernorm"]
    for name, cols in (("gate_proj", slice(0, 8)), ("down_proj", slice(0, 8))):
        orig = getattr(model.mlp, name).weight.detach()[:, cols]
        got = getattr(q.mlp, name).dequantized_weight()[:, cols]
        row_amax = getattr(q.mlp, name).weight_scale.reshape(-1, 1) * 127
        err = float(((got - orig).abs() / row_amax).max())
        assert err <= 0.5 / 127 + 1e-6, f"{name}: dead channels were rescaled (error {err:.3g} of row amax)"
    with torch.no_grad():
        out, ref = q(x), model(x)
    assert out.isfinite().all()
    assert sqnr_db(ref, out) > 25


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config()).eval()


def check_kv_scales() -> None:
    """``k_scale`` / ``v_scale`` = max |key| / 448 and max |value| / 448 over the calibration data, keys
    taken after RoPE (what the attention kernel receives), recorded here by an attention function of our
    own."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_llama()
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, 256, (2, 32), generator=gen) for _ in range(2)]
    seen: dict[int, list[float]] = {}

    def record(module, query, key, value, attention_mask, **kw):
        k, v = float(key.abs().max()), float(value.abs().max())
        old = seen.get(module.layer_idx, [0.0, 0.0])
        seen[module.layer_idx] = [max(old[0], k), max(old[1], v)]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("fp8kit_test_record", record)
    model.config._attn_implementation = "fp8kit_test_record"
    with torch.no_grad():
        calib(batches)(model)
    model.config._attn_implementation = "sdpa"
    q = ptq.quantize(copy.deepcopy(model), "fp8", calib(batches), kv_cache=True)
    for i, layer in enumerate(q.model.layers):
        k_amax, v_amax = seen[i]
        attn = layer.self_attn
        assert float(attn.k_scale) == pytest.approx(k_amax / 448, rel=1e-6), f"layer {i}: k_scale"
        assert float(attn.v_scale) == pytest.approx(v_amax / 448, rel=1e-6), f"layer {i}: v_scale"


# ---- tests ---------------------------------------------------------------------------------------------


def test_ptq_scales_exact():
    check_ptq_scales_exact()


def test_int8_floors():
    """Correct: 39.4 / 48.3 dB; weight scale amax/63.5 or a doubled static amax fall under the floors
    (checked by tests/numerics/test_mutants.py)."""
    check_int8_floors()


def test_smoothquant_runs_and_folds():
    check_smoothquant_runs_and_folds()


def test_smoothquant_zero_variance_channels():
    check_smoothquant_zero_variance()


def test_kv_scales_follow_their_definition():
    check_kv_scales()
