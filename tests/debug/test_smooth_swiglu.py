"""Smooth-SwiGLU and clamped SwiGLU (``fp8kit.nn.swiglu``) on a tiny ``transformers`` Llama."""

from __future__ import annotations

import copy

import pytest
import torch

import fp8kit
from fp8kit import debug
from fp8kit.nn import to_bf16_gemms
from fp8kit.nn.swiglu import SwiGLUOptions, apply_swiglu_options, smooth_scales

from . import plants
from .plants import plant_outlier

transformers = pytest.importorskip("transformers")


def llama(width: int = 64) -> torch.nn.Module:
    from tests.helpers.models import tiny_llama_config

    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=3, hidden_size=width, intermediate_size=2 * width)
    return transformers.LlamaForCausalLM(cfg)


def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def test_smooth_scales_are_powers_of_two_that_flatten_an_outlier_channel():
    h = torch.randn(32, 8)
    h[:, 3] *= 2.0**14
    s = smooth_scales(h, torch.randn(16, 8))
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert float(s[3]) < 2.0**-5 and float(s.median()) == 1.0


@pytest.mark.parametrize("planted", [False, True], ids=["plain", "outlier"])
def test_smooth_swiglu_is_exact_in_high_precision(planted):
    base = plant_outlier(llama(), start=0) if planted else llama()
    x = ids()
    for prepare in (lambda m: m, to_bf16_gemms):  # FP32 GEMMs, and bf16 operands with FP32 accumulation
        ref = prepare(copy.deepcopy(base))
        smooth = prepare(copy.deepcopy(base))
        names = apply_swiglu_options(smooth, smooth=True)
        assert names == [f"model.layers.{i}.mlp" for i in range(3)]
        assert isinstance(smooth.model.layers[0].mlp, SwiGLUOptions)
        with torch.no_grad():
            a, b = ref(input_ids=x).logits, smooth(input_ids=x).logits
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


def down_input_sqnr(model: torch.nn.Module, batch: dict) -> tuple[float, float]:
    """The FP8 readings of layer 2's down_proj input in one training forward: ``(total SQNR, median channel
    SQNR)`` (the total weighs channels by energy: it is the outlier channel's, which a per-tensor scale
    keeps; the other channels are what it crushes)."""
    model.train()
    with debug.inspect(model, tensorboard=False, layers=["model.layers.2.mlp.down_proj"]) as insp:
        model(**batch)
    (rec,) = [r for r in insp.records if r["operand"] == "input"]
    return rec["sqnr_db"], rec["channel_sqnr_db"]


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_smooth_swiglu_lifts_the_fp8_sqnr_of_an_outlier_channel(recipe):
    base = plant_outlier(plants.llama(4), layer=2, start=0, factor=2.0**16)
    batch = plants.batches(1)[0]
    total, plain = down_input_sqnr(fp8kit.convert(copy.deepcopy(base), recipe), batch)
    _, smooth = down_input_sqnr(fp8kit.convert(copy.deepcopy(base), recipe, smooth_swiglu=True), batch)
    assert total > 25.0  # the total SQNR does not see it
    assert smooth >= plain + 10.0, (plain, smooth)
    clean = down_input_sqnr(fp8kit.convert(plants.llama(4), recipe), batch)[1]
    assert smooth > clean - 3.0  # smoothed, the operand is about as precise as without the outlier


def test_clamped_swiglu_bounds_the_down_proj_input():
    model = llama()
    fp8kit.convert(model, fp8kit.CurrentScaling(), swiglu_limit=0.5)
    seen = {}
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda _m, a: seen.update(h=a[0]))
    model(input_ids=ids())
    # gate <= 0.5 and |up| <= 0.5: |silu(gate)| <= max(silu(0.5), -min silu) = silu(0.5), so |h| <= 0.5 silu(0.5)
    bound = 0.5 * float(torch.nn.functional.silu(torch.tensor(0.5)))
    assert 0 < float(seen["h"].abs().max()) <= bound + 1e-6


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="positive number"):
        apply_swiglu_options(llama(), limit=-1.0)
    with pytest.raises(ValueError, match="no SwiGLU MLP"):
        fp8kit.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)), "current", smooth_swiglu=True)
