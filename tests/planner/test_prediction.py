"""The plan's loss prediction (first-order plus Fisher term) on models whose loss change is known exactly:
linear layers under a weighted squared error whose targets make the squared output gradient equal the
curvature, so the two Taylor terms are the whole loss change."""

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import fp8kit
from fp8kit.planner.roofline import GPU
from fp8kit.planner.sensitivity import measured_increase, predicted_increase, quantized_copy

FEATURES = 32
FAST_MEMORY = GPU("fast-memory", 1e12, 2e12, 1e13, (9, 0))  # compute-bound: per-tensor FP8 is the cheapest


class Quadratic(nn.Module):
    """Layer ``i`` maps the input ``x`` to ``y_i``; the loss is ``sum_i sum(0.5 * w_i * (y_i - t_i)**2) /
    positions``. With targets ``t_i = y_i - s_i / sqrt(w_i)`` (``s_i`` = +-1 per element) the gradient of the
    summed loss with respect to ``y_i`` is ``g = s_i * sqrt(w_i)`` and ``g**2 = w_i`` is the curvature: the loss
    change of an output change ``dy`` is exactly ``sum(g * dy) + 0.5 * sum(g**2 * dy**2)`` (over positions)."""

    def __init__(self, layers: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.ModuleList(nn.Linear(FEATURES, FEATURES, bias=False, dtype=dtype) for _ in range(layers))

    def forward(self, x, targets, weights):
        ys = [p(x) for p in self.proj]
        loss = sum((0.5 * w * (y - t) ** 2).sum() for y, t, w in zip(ys, targets, weights, strict=True))
        return SimpleNamespace(loss=loss / x.shape[:-1].numel(), logits=torch.cat(ys, dim=-1))


def quadratic_batch(model: Quadratic, signs: list[torch.Tensor], seed: int = 1) -> dict:
    """A batch whose targets give layer ``i`` the output gradient ``signs[i] * sqrt(w_i)`` (``w_i`` in [0.25, 4])."""
    g = torch.Generator().manual_seed(seed)
    dtype = model.proj[0].weight.dtype
    x = torch.randn(2, 8, FEATURES, generator=g, dtype=dtype)
    weights = [0.25 * 16 ** torch.rand(s.shape, generator=g, dtype=dtype) for s in signs]
    with torch.no_grad():
        targets = [p(x) - s / w.sqrt() for p, s, w in zip(model.proj, signs, weights, strict=True)]
    return {"x": x, "targets": targets, "weights": weights}


def random_signs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (2, 8, FEATURES), generator=g).double() * 2 - 1


def perturbed(layer: nn.Linear, delta: torch.Tensor) -> nn.Linear:
    out = copy.deepcopy(layer)
    with torch.no_grad():
        out.weight += delta
    return out


@pytest.mark.parametrize("scale", [1e-3, 0.3])
def test_taylor_terms_are_the_exact_loss_change_and_flip_with_the_perturbation(scale):
    model = Quadratic(1, torch.float64)
    signs = random_signs(2)
    batch = quadratic_batch(model, [signs])
    layer = model.proj[0]
    delta = scale * torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    variants = {"up": perturbed(layer, delta), "down": perturbed(layer, -delta)}
    terms = predicted_increase(model, {"proj.0": variants}, [batch])
    positions = 16
    g = signs * batch["weights"][0].sqrt()
    for key, sign in (("up", 1), ("down", -1)):
        dy = batch["x"] @ (sign * delta).T
        first, fisher = float((g * dy).sum()) / positions, 0.5 * float((g**2 * dy**2).sum()) / positions
        assert terms.first_order["proj.0"][key] == pytest.approx(first, rel=1e-9)
        assert terms.fisher["proj.0"][key] == pytest.approx(fisher, rel=1e-9)
        measured = measured_increase(model, {"proj.0": variants[key]}, [batch])["proj.0"]
        assert measured == pytest.approx(first + fisher, rel=1e-7)
        assert terms.increase["proj.0"][key] == max(terms.first_order["proj.0"][key] + terms.fisher["proj.0"][key], 0)
    first_up, first_down = terms.first_order["proj.0"]["up"], terms.first_order["proj.0"]["down"]
    assert first_up == pytest.approx(-first_down, rel=1e-12)
    assert terms.fisher["proj.0"]["up"] == pytest.approx(terms.fisher["proj.0"]["down"], rel=1e-12)
    up = measured_increase(model, {"proj.0": variants["up"]}, [batch])["proj.0"]
    down = measured_increase(model, {"proj.0": variants["down"]}, [batch])["proj.0"]
    if scale < 0.01:  # small: the first-order term decides the sign, which flips with the perturbation
        assert abs(first_up) > 10 * terms.fisher["proj.0"]["up"] and (up > 0) != (down > 0)
    else:  # large: the Fisher term outweighs it and both directions raise the loss
        assert terms.fisher["proj.0"]["up"] > abs(first_up) and up > 0 and down > 0


def test_plan_clamps_a_loss_lowering_layer_at_zero_and_gains_no_budget_from_it():
    model = Quadratic(2)
    with torch.no_grad():
        model.proj[0].weight *= 2  # twice layer 1's quantization error: their first-order terms do not cancel
    current = fp8kit.recipe_from_name("current")
    probe = quadratic_batch(model, [random_signs(4), random_signs(5)])
    with torch.no_grad():  # the quantization error of each layer on the batch's input
        dys = [quantized_copy(p, current)(probe["x"]) - p(probe["x"]) for p in model.proj]
    # layer 0's gradient points against its quantization error (quantizing it lowers the loss), layer 1's along
    signs = [-torch.where(dys[0] >= 0, 1.0, -1.0), torch.where(dys[1] >= 0, 1.0, -1.0)]
    batch = quadratic_batch(model, signs)
    assert torch.equal(batch["x"], probe["x"])
    expected = []
    for dy, s, w in zip(dys, signs, batch["weights"], strict=True):
        g = s * w.sqrt()
        expected.append((float((g * dy).sum()) / 16, 0.5 * float((g**2 * dy**2).sum()) / 16))
    (first0, fisher0), (first1, fisher1) = expected
    assert first0 + fisher0 < 0 < first1 + fisher1
    assert first0 + fisher0 + first1 + fisher1 < 0  # unclamped, both layers would fit a zero budget
    plan = fp8kit.autotune(
        model, [batch], loss_budget=0.0, target=FAST_MEMORY, candidates=["bf16", "current"], measure_layers=2
    )
    assert plan.first_order["proj.0"]["current"] == pytest.approx(first0, rel=1e-4)
    assert plan.fisher["proj.0"]["current"] == pytest.approx(fisher0, rel=1e-4)
    assert plan.first_order["proj.1"]["current"] == pytest.approx(first1, rel=1e-4)
    assert plan.fisher["proj.1"]["current"] == pytest.approx(fisher1, rel=1e-4)
    assert plan.predicted["proj.0"]["current"] == 0.0
    assert plan.predicted["proj.1"]["current"] == pytest.approx(first1 + fisher1, rel=1e-4)
    assert plan.per_layer == {"proj.0": "current", "proj.1": "bf16"}  # proj.0 is free; proj.1 does not fit
    for name, (first, fisher) in zip(("proj.0", "proj.1"), expected, strict=True):
        assert plan.measured_loss[name] == pytest.approx(first + fisher, rel=1e-3)  # the exact loss change
    assert plan.measured_loss["proj.0"] < 0 < plan.measured_loss["proj.1"]
    assert plan.spearman_loss is None and plan.spearman_fisher_loss is None  # two layers: no rank correlation
    assert "first-order + Fisher n/a" in str(plan)
