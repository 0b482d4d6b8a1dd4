"""The plan's solver: the cheapest choice per layer within a loss budget, checked against brute force."""

import itertools

import numpy as np
import pytest

from fp8kit.planner.solver import Infeasible, solve


def brute_force(losses, costs, budget):
    best = None
    for choice in itertools.product(*(range(len(row)) for row in losses)):
        loss = sum(losses[i][c] for i, c in enumerate(choice))
        cost = sum(costs[i][c] for i, c in enumerate(choice))
        if loss <= budget and (best is None or cost < best):
            best = cost
    return best


@pytest.mark.parametrize("seed", range(6))
def test_solver_matches_brute_force_on_random_instances(seed):
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(40):
        layers, options = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        losses, costs = rng.random((layers, options)), rng.random((layers, options))
        if seed % 2:  # shared costs per option, as layers of one shape have: many ties
            costs = np.tile(rng.random(options), (layers, 1))
        budget = float(rng.random() * layers * 0.6)
        best = brute_force(losses, costs, budget)
        if best is None:
            with pytest.raises(Infeasible):
                solve(losses, costs, budget)
            continue
        choice = solve(losses, costs, budget)
        assert sum(losses[i][c] for i, c in enumerate(choice)) <= budget
        assert sum(costs[i][c] for i, c in enumerate(choice)) == pytest.approx(best, rel=1e-12, abs=1e-12)
        checked += 1
    assert checked > 10


def test_solver_is_deterministic_and_checks_its_input():
    losses = [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
    costs = [[3.0, 1.0, 1.0], [3.0, 1.0, 1.0]]
    assert solve(losses, costs, 1.0) == solve(losses, costs, 1.0)
    assert sorted(solve(losses, costs, 1.0)) == [0, 1]  # one layer may leave option 0; the earlier tie wins
    assert solve(losses, costs, 2.0) == [1, 1]
    with pytest.raises(ValueError, match="as many losses as costs"):
        solve([[0.0, 1.0]], [[1.0]], 1.0)
    with pytest.raises(ValueError, match="non-finite"):
        solve([[float("nan")]], [[1.0]], 1.0)
