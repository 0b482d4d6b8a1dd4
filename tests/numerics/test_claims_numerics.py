"""Claims of the README and docstrings that had no test: evaluation leaves the scaling state alone,
recipe knobs (margin, power_of_two, MX floor) act inside the layers, a recipe mismatch names both
recipes, and stochastic rounding is unbiased."""

from __future__ import annotations

import math

import pytest
import torch

import fp8kit
from fp8kit import E4M3, E5M2
from fp8kit import nn as fnn
from tests.helpers.reference import assert_matches, ref_quant, ref_scale


def _x(seed: int = 0, rows: int = 64, cols: int = 256) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-4, 5, (rows, 1), generator=gen).float())


def test_eval_uses_but_does_not_change_the_scaling_state():
    model = fp8kit.convert(torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)))
    model.train()
    for s in range(3):
        model(_x(s)).sum().backward()
    state = {k: v.clone() for k, v in model.state_dict().items() if k.split(".")[-1].startswith("fp8_")}
    assert state and all(int(v.sum()) > 0 for k, v in state.items() if k.endswith("fp8_seen"))
    model.eval()
    big = _x(9) * 100  # far outside the recorded range
    with torch.no_grad():
        y = model[0](big)
    after = model.state_dict()
    for k, v in state.items():
        assert torch.equal(after[k], v), f"{k} changed in eval mode"
    # and the stored scale is the one used: the 100x input saturates at the recorded range
    layer = model[0]
    xd = ref_quant(big, E4M3, tuple(big.shape), "amax", scale=layer.fp8_scale[0].reshape(1, 1))[2]
    wd = ref_quant(layer.weight.detach(), E4M3, (64, 256), "amax", scale=layer.fp8_scale[1].reshape(1, 1))[2]
    assert_matches(y, xd @ wd.t() + layer.bias.double(), "eval output with the stored scales")


def test_current_scaling_margin_and_power_of_two_inside_the_layer():
    x = _x(1)
    amax = x.abs().max().reshape(1, 1)
    for recipe, want in (
        (fp8kit.CurrentScaling(margin=1), ref_scale(amax, E4M3, "amax", margin=1)),
        (fp8kit.CurrentScaling(power_of_two=True), ref_scale(amax, E4M3, "pow2")),
        (fp8kit.CurrentScaling(margin=2, power_of_two=True), ref_scale(amax, E4M3, "pow2", margin=2)),
    ):
        layer = fnn.Linear(256, 32, recipe=recipe)
        q = layer.quantize_operand(x, "input")
        assert torch.equal(q.scale_inv.reshape(1, 1), (1.0 / want).float()), recipe
        y = layer(x)
        xd = ref_quant(x, E4M3, tuple(x.shape), "amax", scale=want)[2]
        w = layer.weight.detach()
        wd = ref_quant(w, E4M3, tuple(w.shape), "amax", scale=ref_scale(w.abs().max().reshape(1, 1), E4M3, "amax"))
        if recipe.margin or recipe.power_of_two:  # the weight gets the same knobs
            rule = "pow2" if recipe.power_of_two else "amax"
            s_w = ref_scale(w.abs().max().reshape(1, 1), E4M3, rule, margin=recipe.margin)
            wd = ref_quant(w, E4M3, tuple(w.shape), "amax", scale=s_w)
        assert_matches(y, xd @ wd[2].t() + layer.bias.double(), f"{recipe}: output")


def test_delayed_scaling_margin_inside_the_layer():
    layer = fnn.Linear(256, 32, recipe=fp8kit.DelayedScaling(margin=2, amax_history_len=4))
    x = _x(2)
    layer(x)
    want = ref_scale(x.abs().max().reshape(1), E4M3, "amax", margin=2)
    assert torch.equal(layer.fp8_scale[0].reshape(1), want)


def test_block_scaling_without_power_of_two_uses_exact_amax_scales():
    x = _x(3)
    layer = fnn.Linear(256, 32, recipe=fp8kit.BlockScaling(power_of_two=False))
    q = layer.quantize_operand(x, "input")
    _, scale, _ = ref_quant(x, E4M3, (1, 128), "amax")
    assert torch.equal(q.scale_inv, (1.0 / scale).float())
    assert not bool((torch.log2(q.scale_inv) == torch.round(torch.log2(q.scale_inv))).all())  # not powers of two


def test_mx_floor_rounding_inside_the_layer_clips_and_rceil_does_not():
    x = _x(4)
    x[:, 0] = 500.0 * 2.0 ** torch.arange(64).remainder(8)  # 500 / 2**8 > 448 / 2**8: floor clips it
    out = {}
    for rounding in ("floor", "rceil"):
        layer = fnn.Linear(256, 32, recipe=fp8kit.MXFP8Scaling(rounding=rounding))
        q = layer.quantize_operand(x, "input")
        codes, scale, deq = ref_quant(x, E4M3, (1, 32), rounding)
        assert torch.equal(q.scale_inv, (1.0 / scale).float()), rounding
        assert torch.equal(q.data.view(torch.uint8), codes.view(torch.uint8)), rounding
        out[rounding] = q.dequantize(torch.float64)[:, 0]
    assert bool((out["floor"] < x[:, 0].double()).any()), "floor rounding clips values above fmt.max * 2**k"
    assert torch.equal(out["rceil"], x[:, 0].double()) or bool(
        ((out["rceil"] - x[:, 0].double()).abs() <= x[:, 0].double() * 2**-4).all()
    )


def test_recipe_mismatch_error_names_both_recipes():
    saved = fnn.Linear(32, 32, recipe=fp8kit.DelayedScaling()).state_dict()
    other = fnn.Linear(32, 32, recipe=fp8kit.MXFP8Scaling())
    with pytest.raises(ValueError) as err:
        other.load_state_dict(saved)
    msg = str(err.value)
    assert "DelayedScaling" in msg and "MXFP8Scaling" in msg, msg


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_stochastic_rounding_is_unbiased(fmt):
    """Mean of many stochastic casts equals the value (within 5 standard errors), and each value rounds
    up with probability (x - lower) / spacing."""
    gen = torch.Generator().manual_seed(0)
    lo = torch.tensor([1.0, 1.5, 3.0, -12.0, 2.0**-8, 96.0])  # representable in both formats
    spacing = torch.tensor([2.0 ** (math.floor(math.log2(abs(v))) - fmt.mantissa_bits) for v in lo.tolist()])
    spacing = torch.where(lo.abs() < fmt.min_normal, torch.full_like(spacing, fmt.min_subnormal), spacing)
    frac = torch.tensor([0.1, 0.25, 0.5, 0.7, 0.9, 0.33])
    x = lo + frac * spacing * torch.sign(lo)
    n = 40000
    draws = fp8kit.cast(x.repeat(n, 1), fmt, rounding="stochastic", generator=gen).float()
    up = (draws.abs() > lo.abs()).float().mean(0)
    assert torch.allclose(up, frac, atol=5 * math.sqrt(0.25 / n)), (up, frac)
    mean = draws.double().mean(0)
    stderr = spacing.double() * (frac * (1 - frac)).double().sqrt() / math.sqrt(n)
    assert bool(((mean - x.double()).abs() <= 5 * stderr + 1e-12).all()), (mean, x)
    # nearest rounding is biased on the same values (so the test can tell the two apart)
    nearest = fp8kit.cast(x, fmt).double()
    assert bool(((nearest - x.double()).abs() > 5 * stderr).any())


def test_stochastic_quantize_is_unbiased_after_scaling():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 512, generator=gen)
    n = 2000
    acc = torch.zeros(1, 512, dtype=torch.float64)
    for _ in range(n):
        acc += fp8kit.quantize(x, E4M3, "row", rounding="stochastic", generator=gen).dequantize(torch.float64)
    bias = float((acc / n - x.double()).mean())
    nearest_err = float((fp8kit.quantize(x, E4M3, "row").dequantize(torch.float64) - x.double()).abs().mean())
    assert abs(bias) < 0.02 * nearest_err, (bias, nearest_err)
