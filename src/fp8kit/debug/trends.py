"""Early warning: the statistics that precede an FP8 divergence, per layer and step, and their trends.

Long FP8 runs fail late and slowly: SwiGLU's gate and up rows align, the ``down_proj`` input grows an
outlier channel quadratically, and only when that channel's range outgrows the format does the loss
move (Fishman et al., "Scaling FP8 training to trillion-token LLMs"); activation kurtosis rises before an
FP8 divergence (FOG, arXiv 2505.20524); expert-load imbalance and the spread of the residual norms across
layers grow before MoE divergences. The inspector records the readings; this module reads their trends.

Signals (``series``), each a ``(layer, signal)`` series of per-step values:

* ``outlier_ratio`` and ``kurtosis`` of the input of every MLP output projection (``down_proj``, ``fc2``,
  ``w2``): the inspector's channel figures (``stats.channel_stats``);
* ``gate_up_alignment`` of every SwiGLU MLP: ``max_j |cos(g_j, u_j)| |g_j| |u_j| / median_j |g_j| |u_j|`` over
  the rows ``g_j`` of ``gate_proj`` and ``u_j`` of ``up_proj`` (``gate_up_alignment``): the largest aligned
  gain, which scales channel ``j`` of the SwiGLU output as ``(u_j . x)^2``;
* ``expert_maxvio`` of every MoE experts module: ``max_e load_e / mean_e load_e - 1`` over the tokens
  routed to each expert in a forward (MaxVio);
* ``residual_spread``: the largest over the smallest RMS of the decoder blocks' outputs in a forward.

A series is **growing** at a step when its last ``WINDOW`` readings fit a geometric growth (least squares
on the log, ``R^2 >= MIN_R2``) that multiplies it by at least ``GROWTH`` over those readings, and, where
the signal has a saturation level, when the fit reaches that level within ``HORIZON`` times the steps read
so far. A ``Trend`` is reported when its series is growing at its last reading; it warns from the first
step of the unbroken run of growing readings that ends there, with the step the fit projects the
saturation at (``projected_step``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MLP_OUTPUT_NAMES",
    "Trend",
    "find_trends",
    "gate_up_alignment",
    "growth_fit",
    "series",
]

MLP_OUTPUT_NAMES = ("down_proj", "fc2", "w2")  # an MLP's output projection: its input is the activation output
WINDOW = 6  # readings a growth fit spans (at most)
MIN_POINTS = 4  # readings before a fit counts
MIN_R2 = 0.8  # goodness of the log-linear fit
GROWTH = 2.0  # growth factor over the fitted readings, at least
HORIZON = 2.0  # a saturation projected further than this many times the steps read so far is no warning
SIGNALS = ("outlier_ratio", "kurtosis", "gate_up_alignment", "expert_maxvio", "residual_spread")


@dataclass
class Trend:
    """A growing signal: where, since when, how fast, and when it is projected to saturate."""

    layer: str
    signal: str
    step: int  # first step of the warning (the unbroken run of growing readings up to the last)
    first_value: float  # at the first reading of the series
    last_value: float
    growth_per_step: float  # fitted factor per step
    projected_step: int | None  # when the fit reaches the saturation level (None: the signal has none)
    saturation: float | None  # that level
    reason: str
    steps_warned: int = 1  # readings from ``step`` to the last, all growing


@torch.no_grad()
def gate_up_alignment(gate: torch.Tensor, up: torch.Tensor) -> dict[str, float]:
    """``{"value", "max_cos", "channel"}`` of a SwiGLU MLP's ``gate_proj`` and ``up_proj`` weights ``(I, H)``:
    the largest aligned gain over the median gain (module docstring), the largest ``|cos|`` of a row pair, and
    the channel of the largest aligned gain."""
    gate, up = (w.full_tensor() if hasattr(w, "full_tensor") else w for w in (gate, up))  # sharded (FSDP2): whole
    g, u = gate.detach().float(), up.detach().float()
    gn, un = g.norm(dim=1), u.norm(dim=1)
    gain = gn * un
    cos = (g * u).sum(dim=1).abs() / gain.clamp_min(torch.finfo(torch.float32).tiny)
    aligned = cos * gain
    median = float(gain.median())
    j = int(aligned.argmax())
    return {"value": float(aligned[j]) / median if median > 0 else 0.0, "max_cos": float(cos.max()), "channel": j}


def series(stats: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """The signals' per-step values, ``{(layer, signal): [(step, value), ...]}`` in step order, from the
    inspector's records: its ``"actual"`` input readings, its ``"trend"`` records (``gate_up_alignment``,
    ``residual_rms`` per block) and its per-expert ``tokens_routed``."""
    out: dict[tuple[str, str], dict[int, float]] = {}
    rms: dict[int, list[float]] = {}
    loads: dict[tuple[str, int], dict[int, float]] = {}
    for r in stats:
        step = r["step"]
        if r["recipe"] == "trend":
            if r["operand"] == "residual_rms":
                rms.setdefault(step, []).append(r["value"])
            else:
                out.setdefault((r["layer"], r["operand"]), {})[step] = r["value"]
        elif r["recipe"] == "actual" and r["operand"] == "input":
            layer = r["layer"]
            if "tokens_routed" in r and "[" in layer:  # one expert's routed rows: its load
                module, rest = layer.split("[", 1)
                expert, param = rest.split("]", 1)
                if param.lstrip(".") in ("gate_up_proj", "up_proj"):  # the first projection sees every routed row
                    loads.setdefault((module, step), {})[int(expert)] = r["tokens_routed"]
            elif layer.rsplit(".", 1)[-1] in MLP_OUTPUT_NAMES:
                for signal in ("outlier_ratio", "kurtosis"):
                    if signal in r:
                        out.setdefault((layer, signal), {})[step] = r[signal]
    for step, values in rms.items():
        if len(values) >= 2 and min(values) > 0:
            out.setdefault(("decoder blocks", "residual_spread"), {})[step] = max(values) / min(values)
    for (module, step), per_expert in loads.items():
        mean = sum(per_expert.values()) / len(per_expert)
        if mean > 0:
            out.setdefault((module, "expert_maxvio"), {})[step] = max(per_expert.values()) / mean - 1
    return {k: sorted(v.items()) for k, v in out.items()}


def growth_fit(points: list[tuple[int, float]]) -> tuple[float, float, float] | None:
    """``(slope, intercept, R^2)`` of the least-squares line through ``(step, log value)``; None if a value is
    not positive and finite or the steps do not vary."""
    if any(not (v > 0 and math.isfinite(v)) for _, v in points):
        return None
    xs = [float(s) for s, _ in points]
    ys = [math.log(v) for _, v in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    syy = sum((y - my) ** 2 for y in ys)
    r2 = 1.0 - sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys, strict=True)) / syy if syy > 0 else 0.0
    return slope, intercept, r2


def _growing(
    points: list[tuple[int, float]], saturation: float | None, steps_read: int
) -> tuple[float, int | None] | None:
    """``(growth per step, projected step or None)`` when the readings ``points`` are growing (module
    docstring), else None."""
    window = points[-WINDOW:]
    if len(window) < MIN_POINTS:
        return None
    fit = growth_fit(window)
    if fit is None:
        return None
    slope, intercept, r2 = fit
    span = window[-1][0] - window[0][0]
    if slope <= 0 or r2 < MIN_R2 or math.exp(slope * span) < GROWTH:
        return None
    last = window[-1][0]
    if saturation is None:
        return math.exp(slope), None
    at = (math.log(saturation) - intercept) / slope  # where the fitted line reaches the level
    projected = max(last, math.ceil(at))
    if projected - last > HORIZON * steps_read:
        return None
    return math.exp(slope), projected


def find_trends(stats: Iterable[Mapping[str, Any]], saturation: Mapping[str, float] | None = None) -> list[Trend]:
    """The growing signals of a run (module docstring), most urgent first (earliest projected saturation,
    then fastest growth).

    ``saturation``: per signal, the level where it saturates (e.g. ``{"outlier_ratio": fmt.max /
    fmt.min_normal}``: above it the median channel falls below the format's normal range under a per-tensor
    scale). ``gate_up_alignment`` is projected through its MLP's ``down_proj`` outlier ratio (the aligned
    gain scales that channel): its saturation is reached when the last outlier ratio times the alignment's
    growth reaches ``saturation["outlier_ratio"]``.
    """
    saturation = dict(saturation or {})
    data = series(stats)
    found: list[Trend] = []
    for (layer, signal), points in data.items():
        level = saturation.get(signal)
        if signal == "gate_up_alignment":
            down = data.get((f"{layer}.down_proj", "outlier_ratio"))
            level = None
            if down and "outlier_ratio" in saturation and down[-1][1] > 0:
                level = points[-1][1] * saturation["outlier_ratio"] / down[-1][1]
        if signal == "kurtosis" and "kurtosis" not in saturation:
            level = None
        verdicts = [_growing(points[: i + 1], level, i + 1) for i in range(len(points))]
        if verdicts[-1] is None:
            continue
        first = len(verdicts) - 1
        while first > 0 and verdicts[first - 1] is not None:
            first -= 1
        rate, projected = verdicts[-1]
        found.append(
            Trend(
                layer=layer,
                signal=signal,
                step=points[first][0],
                first_value=points[0][1],
                last_value=points[-1][1],
                growth_per_step=rate,
                projected_step=projected,
                saturation=level,
                reason=_reason(signal, points, rate, projected, level),
                steps_warned=len(points) - first,
            )
        )
    found.sort(key=lambda t: (t.projected_step if t.projected_step is not None else math.inf, -t.growth_per_step))
    return found


_WHAT = {
    "outlier_ratio": "largest channel amax over the median channel's",
    "kurtosis": "kurtosis of the values",
    "gate_up_alignment": "aligned gain of a gate/up row pair over the median (SwiGLU outlier mechanism)",
    "expert_maxvio": "expert-load imbalance (MaxVio)",
    "residual_spread": "spread of the residual RMS across the decoder blocks",
}


def _reason(
    signal: str, points: list[tuple[int, float]], rate: float, projected: int | None, level: float | None
) -> str:
    (s0, v0), (s1, v1) = points[0], points[-1]
    text = f"{_WHAT[signal]} grew {v0:.3g} -> {v1:.3g} (steps {s0}-{s1}), x{rate:.2f} per step"
    if projected is None:
        return text + "; no saturation level for this signal"
    if level is not None and v1 >= level:
        return text + f"; past its saturation level {level:.3g}"
    return text + f"; projected to reach {level:.3g} (saturation) at step {projected}"
