"""The early-warning trends (``fp8kit.debug.trends``) on readings written by hand."""

from __future__ import annotations

import math

import pytest
import torch

from fp8kit.debug.trends import find_trends, gate_up_alignment, growth_fit, series

LEVEL = {"outlier_ratio": 448 / 2**-6}


def reading(layer: str, step: int, ratio: float) -> dict:
    return {
        "step": step,
        "layer": layer,
        "operand": "input",
        "recipe": "actual",
        "outlier_ratio": ratio,
        "kurtosis": 3.0,
    }


def test_a_geometric_growth_warns_with_its_projected_saturation_step():
    stats = [reading("m.down_proj", s, 3.0 if s < 4 else 3.0 * 4.0 ** (s - 3)) for s in range(9)]
    (t,) = find_trends(stats, LEVEL)
    assert (t.layer, t.signal) == ("m.down_proj", "outlier_ratio")
    assert t.growth_per_step == pytest.approx(4.0)
    # 3 * 4^(s-3) reaches 28672 at s = 3 + log4(28672 / 3) = 9.6
    assert t.projected_step == 10 and t.step <= 7
    assert "projected to reach" in t.reason


def test_a_flat_or_noisy_series_and_a_far_saturation_do_not_warn():
    flat = [reading("a.down_proj", s, 3.0 + 0.1 * (s % 2)) for s in range(10)]
    slow = [reading("b.down_proj", s, 3.0 * 1.2**s) for s in range(10)]  # saturates ~ step 50: beyond the horizon
    assert find_trends(flat + slow, LEVEL) == []
    # without a saturation level the slow growth (x2.9 over the window) is a growing signal with no projection
    (t,) = find_trends(slow, {})
    assert t.projected_step is None and "no saturation level" in t.reason


def test_series_reads_alignment_residual_spread_and_expert_load():
    stats = [{"step": 0, "layer": "m.mlp", "operand": "gate_up_alignment", "recipe": "trend", "value": 0.4}]
    stats += [
        {"step": 0, "layer": f"blocks.{i}", "operand": "residual_rms", "recipe": "trend", "value": v}
        for i, v in enumerate([1.0, 2.0, 8.0])
    ]
    stats += [
        {"step": 0, "layer": f"m.experts[{e}].gate_up_proj", "operand": "input", "recipe": "actual", "tokens_routed": n}
        for e, n in enumerate([10, 30, 0, 0])
    ]
    got = series(stats)
    assert got[("m.mlp", "gate_up_alignment")] == [(0, 0.4)]
    assert got[("decoder blocks", "residual_spread")] == [(0, 8.0)]
    assert got[("m.experts", "expert_maxvio")] == [(0, 30 / 10 - 1)]


def test_gate_up_alignment_finds_the_aligned_row_pair():
    torch.manual_seed(0)
    gate, up = torch.randn(32, 16), torch.randn(32, 16)
    base = gate_up_alignment(gate, up)
    gate[5] = 10 * up[5]
    up[5] *= 3
    grown = gate_up_alignment(gate, up)
    assert grown["channel"] == 5 and grown["max_cos"] == pytest.approx(1.0)
    assert grown["value"] > 20 * base["value"]


def test_growth_fit_is_the_log_linear_least_squares_line():
    slope, intercept, r2 = growth_fit([(s, 2.0 * 3.0**s) for s in range(5)])
    assert slope == pytest.approx(math.log(3.0)) and intercept == pytest.approx(math.log(2.0)) and r2 == 1.0
    assert growth_fit([(0, 1.0), (1, 0.0)]) is None
