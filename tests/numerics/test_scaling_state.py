"""``fp8kit.numerics.scaling_state.DelayedScalingState`` (record, fold, first-step rule, host reads) and the recipe
properties the modules read instead of kind checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fp8kit.numerics import recipes
from fp8kit.numerics.formats import E4M3, E5M2
from fp8kit.numerics.scaling_state import DelayedScalingState, operand_scale


def make_state(recipe: recipes.DelayedScaling, lead: tuple[int, ...] = ()) -> tuple[nn.Module, DelayedScalingState]:
    owner = nn.Linear(4, 4)
    return owner, DelayedScalingState(owner, recipe, ("input", "weight", "grad"), lead)


def test_first_step_uses_the_own_amax_then_the_history():
    owner, state = make_state(recipes.DelayedScaling(amax_history_len=3))
    amax = torch.tensor(2.0)
    assert state.scale_for(0, "input", amax).item() == E4M3.max / 2.0  # never seen: its own amax
    state.record(0, amax)
    assert owner.fp8_seen.tolist() == [1, 0, 0] and owner.fp8_amax_pending[0].item() == -1.0
    assert state.scale_for(0, "input", torch.tensor(100.0)).item() == E4M3.max / 2.0  # the history's scale now
    assert state.scale_for(2, "grad", torch.tensor(4.0)).item() == E5M2.max / 4.0  # grad slot: E5M2, first step


def test_fold_rolls_the_window_and_scales_the_grad_slot_in_its_format():
    owner, state = make_state(recipes.DelayedScaling(amax_history_len=2, margin=1))
    for a in (8.0, 2.0, 1.0):
        state.record(..., torch.tensor([a, a, a]))
    assert owner.fp8_amax_history[:, 0].tolist() == [1.0, 1.0, 1.0]  # newest first, window of 2: 8 rolled out
    assert owner.fp8_scale.tolist() == [E4M3.max / 2.0 / 2, E4M3.max / 2.0 / 2, E5M2.max / 2.0 / 2]
    assert owner.fp8_seen.tolist() == [3, 3, 3]


def test_a_non_finite_amax_is_dropped_and_a_deferred_one_waits_for_the_fold():
    owner, state = make_state(recipes.DelayedScaling())
    state.record(1, torch.tensor(float("nan")))
    assert owner.fp8_seen[1].item() == 0 and owner.fp8_scale[1].item() == 1.0
    state.record(1, torch.tensor(3.0), fold=False)
    state.record(1, torch.tensor(5.0), fold=False)
    assert owner.fp8_amax_pending[1].item() == 5.0 and owner.fp8_seen[1].item() == 0
    state.fold()
    assert owner.fp8_scale[1].item() == pytest.approx(E4M3.max / 5.0) and owner.fp8_seen.tolist() == [0, 1, 0]


def test_slices_of_a_leading_dim_fold_alone():
    owner = nn.Linear(4, 4)
    state = DelayedScalingState(owner, recipes.DelayedScaling(), ("input", "grad", "weight", "weight"), lead=(2,))
    state.record((1, slice(2, None)), torch.tensor([4.0, 8.0]))
    assert owner.fp8_seen.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1]]
    assert owner.fp8_scale[1, 2:].tolist() == [E4M3.max / 4.0, E4M3.max / 8.0]
    assert state.has_history((1, slice(2, None))) and not state.has_history((0, slice(2, None)))


def test_synced_reads_are_remembered_until_the_state_is_loaded():
    owner, state = make_state(recipes.DelayedScaling())
    assert not state.has_history(0, synced=True)
    state.record(0, torch.tensor(1.0))
    assert state.has_history(0, synced=True)
    owner.fp8_seen.zero_()
    assert state.has_history(0, synced=True)  # remembered: no device read per call
    assert not state.has_history(0)  # the plain read looks again (CPU)
    state.forget_reads()
    assert not state.has_history(0, synced=True)


def test_buffers_follow_the_module_and_state_dict_keys_are_the_module_buffers():
    owner, state = make_state(recipes.DelayedScaling(amax_history_len=5))
    owner.double()
    assert state.scale.dtype == torch.float64  # re-read from the module, not a stale copy
    keys = set(owner.state_dict())
    assert {"fp8_amax_history", "fp8_scale", "fp8_seen", "fp8_amax_pending"} <= keys


def test_operand_scale_without_state_is_the_recipes_rule():
    amax = torch.tensor(3.0)
    current = recipes.CurrentScaling(power_of_two=True, margin=1)
    got = operand_scale(None, current, 0, "grad", amax)
    assert got.item() == 2.0 ** torch.floor(torch.log2(torch.tensor(E5M2.max / 3.0 / 2))).item()


@pytest.mark.parametrize("recipe", recipes.all_recipes() + [recipes.BlockScaling(block_size=32)], ids=str)
def test_recipe_properties_agree_with_the_granularities(recipe):
    w, x = recipe.granularity_for("weight"), recipe.granularity_for("input")
    square = isinstance(w, tuple) and w[0] == w[1]
    assert recipe.weight_transposes_codes == (w == "tensor" or square)
    assert recipe.scales_whole_rows == (x == "row")
    if isinstance(x, tuple):
        assert recipe.tile_width == x[1]
    else:
        assert recipe.tile_width == (32 if x == "mx" else None)
    assert recipe.fast_accumulation == (x in ("tensor", "row"))
    knobs = recipe.quantize_kwargs
    assert all(getattr(recipe, k if k != "mx_rounding" else "rounding") == v for k, v in knobs.items())
