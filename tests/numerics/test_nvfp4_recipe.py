"""``NVFP4BlockScaling``: Transformer Engine's knobs and environment switches, what the recipe answers per
operand, its weight-gradient operand (tokens padded, Hadamard-transformed), and where its name is accepted."""

from __future__ import annotations

import argparse

import pytest
import torch

import fp8kit
from fp8kit.numerics.formats import E2M1
from fp8kit.numerics.recipes import RECIPE_NAMES, Recipe, recipe_from_name
from fp8kit.numerics.scaling import Granularity


def test_defaults_follow_transformer_engine():
    r = fp8kit.NVFP4BlockScaling()
    assert recipe_from_name("nvfp4") == r and recipe_from_name("NVFP4").kind == "nvfp4"
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization, r.rht_size) == (
        False,
        False,
        False,
        16,
    )
    assert all(r.format_for(role) is E2M1 for role in ("input", "weight", "grad"))
    assert r.granularity_for("weight") == Granularity("nvfp4", (16, 16)) and r.granularity_for("input") == "nvfp4"
    assert [r.rounding_for(role) for role in ("input", "weight", "grad")] == ["nearest", "nearest", "stochastic"]
    assert r.weight_transposes_codes and not r.per_tensor and r.tile_width == 16
    assert Recipe.from_json(r.to_json()) == r
    off = fp8kit.NVFP4BlockScaling(disable_stochastic_rounding=True, disable_2d_quantization=True)
    assert off.rounding_for("grad") == "nearest" and off.granularity_for("weight") == "nvfp4"
    assert not off.weight_transposes_codes


@pytest.mark.parametrize(
    ("var", "knob"),
    [
        ("NVTE_NVFP4_DISABLE_RHT", "disable_rht"),
        ("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "disable_stochastic_rounding"),
        ("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "disable_2d_quantization"),
    ],
)
def test_environment_switches_set_the_knob_defaults(monkeypatch, var, knob):
    monkeypatch.setenv(var, "1")
    assert getattr(fp8kit.NVFP4BlockScaling(), knob) is True
    assert getattr(fp8kit.NVFP4BlockScaling(**{knob: False}), knob) is False
    monkeypatch.setenv(var, "0")
    assert getattr(recipe_from_name("nvfp4"), knob) is False


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"fp8_format": "hybrid"}, "fp8_format='e4m3'"), ({"fp4_format": "e4m3"}, "e2m1"), ({"rht_size": 12}, "rht_size")],
)
def test_bad_knobs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        fp8kit.NVFP4BlockScaling(**kw)


def test_wgrad_operand_pads_tokens_with_zeros_and_rotates_them():
    torch.manual_seed(0)
    t = torch.randn(8, 40)
    plain = fp8kit.NVFP4BlockScaling(disable_rht=True).wgrad_operand(t)
    assert plain.shape == (8, 48) and torch.equal(plain[:, :40], t) and not plain[:, 40:].any()
    rotated = fp8kit.NVFP4BlockScaling().wgrad_operand(t)
    assert rotated.shape == (8, 48) and not torch.allclose(rotated, plain)
    # the transform is orthogonal per 16-token block: norms kept, and it cancels in a product over tokens
    assert torch.allclose(rotated.norm(dim=1), plain.norm(dim=1), rtol=1e-5)
    assert torch.allclose(rotated @ rotated.t(), plain @ plain.t(), rtol=1e-4, atol=1e-4)
    assert fp8kit.DelayedScaling().wgrad_operand(t) is t


def test_the_name_is_accepted_by_train_and_doctor_but_all_stays_fp8():
    from fp8kit.cli.doctor import recipe_name
    from fp8kit.cli.train import recipe_list
    from fp8kit.train.checks import parse_recipes

    assert recipe_list("nvfp4") == "nvfp4" and recipe_name("nvfp4") == "nvfp4"
    assert parse_recipes("nvfp4,delayed") == ["nvfp4", "delayed"]
    assert parse_recipes("all") == list(RECIPE_NAMES) and "nvfp4" not in RECIPE_NAMES
    with pytest.raises(argparse.ArgumentTypeError, match="nvfp4"):
        recipe_list("nvfp3")


def test_what_if_readings_of_nvfp4():
    """The inspector's what-if figures quantize as the recipe: Gaussian operands read about 20 dB (E2M1's
    SQNR), FP8 per-tensor scaling about 31 dB (E4M3) and 25 dB (E5M2 gradients)."""
    from fp8kit.debug.stats import operand_stats

    torch.manual_seed(0)
    x = torch.randn(64, 96)
    for role in ("input", "weight", "grad"):
        fp4 = operand_stats(x, role, recipe_from_name("nvfp4"))["sqnr_db"]
        fp8 = operand_stats(x, role, recipe_from_name("current"))["sqnr_db"]
        assert 17 < fp4 < 23 and fp8 > fp4 + 4, (role, fp4, fp8)
