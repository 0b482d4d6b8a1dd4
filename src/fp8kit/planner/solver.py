"""The cheapest choice of one option per layer whose summed loss stays under a budget (multiple-choice knapsack).

Solved exactly by dynamic programming over Pareto frontiers: after each layer, every reachable
``(summed loss, summed cost)`` pair that no other pair beats on both counts is kept (with the choice that made
it), pairs over the budget are dropped, and the last frontier's cheapest pair is traced back. Real-valued
losses and costs, no discretisation; ties go to the earlier option and the smaller loss (deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["Infeasible", "solve"]


class Infeasible(ValueError):
    """No choice of options keeps the summed loss within the budget."""


def _pareto(loss: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Indices of the pairs no other pair beats (loss <= and cost <, or equal loss and cost <=), by loss."""
    order = np.lexsort((cost, loss))  # by loss, then cost
    best = np.minimum.accumulate(cost[order])
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = cost[order][1:] < best[:-1]
    return order[keep]


def solve(losses: Sequence[Sequence[float]], costs: Sequence[Sequence[float]], budget: float) -> list[int]:
    """The option index per layer that minimises ``sum(costs[i][c_i])`` with ``sum(losses[i][c_i]) <= budget``.

    ``losses[i]`` and ``costs[i]`` hold layer ``i``'s options (same length, at least one). Raises
    ``Infeasible`` when even the smallest loss of every layer exceeds ``budget``."""
    if len(losses) != len(costs):
        raise ValueError(f"solve: {len(losses)} layers of losses and {len(costs)} of costs")
    tol = 1e-12 * max(1.0, abs(budget))
    front_loss, front_cost = np.zeros(1), np.zeros(1)
    trace: list[tuple[np.ndarray, np.ndarray]] = []  # per layer: (parent index, option) of each frontier pair
    for i, (layer_loss, layer_cost) in enumerate(zip(losses, costs, strict=True)):
        ll, lc = np.asarray(layer_loss, dtype=np.float64), np.asarray(layer_cost, dtype=np.float64)
        if ll.shape != lc.shape or ll.ndim != 1 or not len(ll):
            raise ValueError(f"solve: layer {i} needs as many losses as costs (at least one option)")
        if not (np.isfinite(ll).all() and np.isfinite(lc).all()):
            raise ValueError(f"solve: layer {i} has a non-finite loss or cost")
        cand_loss = (front_loss[:, None] + ll[None, :]).ravel()
        cand_cost = (front_cost[:, None] + lc[None, :]).ravel()
        parent = np.repeat(np.arange(len(front_loss)), len(ll))
        option = np.tile(np.arange(len(ll)), len(front_loss))
        ok = np.flatnonzero(cand_loss <= budget + tol)
        if not len(ok):
            raise Infeasible(f"no choice keeps the summed loss within the budget {budget:.4g} (layer {i} onwards)")
        keep = ok[_pareto(cand_loss[ok], cand_cost[ok])]
        front_loss, front_cost = cand_loss[keep], cand_cost[keep]
        trace.append((parent[keep], option[keep]))
    at = int(np.lexsort((front_loss, front_cost))[0])  # cheapest, then smallest loss
    choice = [0] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        parents, options = trace[i]
        choice[i] = int(options[at])
        at = int(parents[at])
    return choice
