"""From the doctor's readings to a diagnosis: the kind of problem, the culprits ranked, the fixes.

Pure functions over plain data (the inspector's per-step records and the two loss curves); the doctor
(``fp8kit.debug.doctor``) runs the two copies and calls them.

Culprits. Each (layer, operand) series is read step by step against three thresholds: SQNR more than
``drop_db`` below the operand's own clean baseline (the median of its last readings that were not
themselves departures, so a sustained fault stays measured against the level before it), SQNR under
``floor_db``, and a surge of saturation (> 5% of values) or underflow (> 20% of non-zero values).
A reading past a threshold counts by *how far* past it is, in dB (for the percentages, the ratio to
the threshold in dB). An operand's departure is scored by severity times persistence: the dB past the
threshold summed over the steps it stays past. Culprits are ranked by that score, so a sustained fault
outranks a reading at the edge of a threshold whatever their steps. Departures of a similar score that
start at the same step are one fault seen in several places (an outlier channel shows in the input of
the layer after it and in the gradient of the layer before it): they are listed in execution order,
origin first. A departure whose score stays under ``marginal_db`` is a note, not a culprit.

A GEMM input is read per channel too: its median-channel SQNR more than ``drop_db`` below its own clean
baseline is a departure, and so, under a per-tensor recipe, is an outlier ratio (largest channel amax over
the median channel's) that leaves the median channel less than ``HEADROOM_BINADES`` of the format's normal
range: one channel's amax setting a scale that crushes the others, which the total SQNR, weighted by
energy, does not show.

Latent findings. When the loss shows no problem, a departure that persists, past a threshold in at least
``LATENT_FRACTION`` of the steps from its first to the end of the run and in ``LATENT_MIN_STEPS`` or more,
is **latent**: not yet a loss effect, not healthy either (it is how long FP8 runs begin to fail). So is a
growing early-warning signal with a projected saturation step (``fp8kit.debug.trends``). A departure that
recovers, and a growing signal without a saturation level, stay notes.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..numerics.recipes import DelayedScaling, Recipe
from .detectors import SpikeDetector
from .trends import Trend, find_trends

__all__ = [
    "Culprit",
    "Diagnosis",
    "NOISE_FACTOR",
    "Recommendation",
    "classify",
    "diagnose",
    "final_gap",
    "find_departures",
    "module_of",
    "persists",
    "rank",
    "recommend",
    "trend_culprit",
]

BASELINE_STEPS = 10  # clean readings an operand's SQNR baseline is the median of
MIN_BASELINE = 3  # clean readings needed before a drop below the baseline counts
SATURATION_PCT = 5.0  # % of values saturating that counts as a saturation surge (and 10x the baseline)
UNDERFLOW_PCT = 20.0  # % of non-zero values underflowing that counts as an underflow surge (and 5x)
EVENT_RATIO = 4.0  # departures starting at one step within this factor of the lead's score: one event
NONFINITE_DB = 100.0  # what one step of non-finite values weighs, in dB past a threshold
HEADROOM_BINADES = 3.0  # an outlier ratio within this many binades of its saturation level is a departure
LATENT_FRACTION = 0.5  # a departure past a threshold in at least this share of its steps to the end persists
LATENT_MIN_STEPS = 3  # ... and in at least this many steps


@dataclass
class Culprit:
    """One operand's departure: where it starts, how far past a threshold it goes and for how long."""

    layer: str
    operand: str
    step: int  # first step past a threshold
    reason: str
    severity: float  # dB past the threshold at the worst step, larger is worse
    steps: int = 1  # persistence: steps past a threshold, from ``step`` to the end of the run
    score: float = 0.0  # ranking weight: the dB past the threshold summed over those steps
    span: int = 1  # steps from ``step`` to the end of the run
    projected_step: int | None = None  # a growing signal (``operand`` names it): its projected saturation step


@dataclass
class Recommendation:
    action: str
    fix: dict[str, Any]  # {"type": "bf16_layers", "layers": [...]} | {"type": "recipe", "recipe": "..."} | ...
    why: str
    # a latent finding's fix: the figures it gives on the recorded operand ({"sqnr_db", "channel_sqnr_db"})
    sqnr: dict[str, float] | None = None


def _db_past(value: float, threshold: float) -> float:
    """How far ``value`` lies above ``threshold`` (both positive percentages), in dB."""
    return 10 * math.log10(value / threshold)


def _reading(
    r: dict[str, Any], clean: list[dict[str, Any]], drop_db: float, floor_db: float, outlier_level: float | None = None
) -> tuple[float, str] | None:
    """``(dB past the threshold, what happened)`` if this record departs from its clean history, else None."""
    if r.get("nonfinite", 0):
        return NONFINITE_DB, "non-finite values"
    found: list[tuple[float, str]] = []
    sq = r["sqnr_db"]
    base_sq = [p["sqnr_db"] for p in clean[-BASELINE_STEPS:] if math.isfinite(p["sqnr_db"])]
    if len(base_sq) >= MIN_BASELINE and math.isfinite(sq):
        base = statistics.median(base_sq)
        if base - sq > drop_db:
            found.append((base - sq - drop_db, f"SQNR fell {base - sq:.1f} dB to {sq:.1f} dB"))
    if sq < floor_db:  # NaN (an all-zero tensor) compares False
        found.append((floor_db - sq, f"SQNR {sq:.2f} dB is {floor_db - sq:.2f} dB below {floor_db:g} dB"))
    ch = r.get("channel_sqnr_db", math.nan)
    base_ch = [
        p["channel_sqnr_db"] for p in clean[-BASELINE_STEPS:] if math.isfinite(p.get("channel_sqnr_db", math.nan))
    ]
    if len(base_ch) >= MIN_BASELINE and math.isfinite(ch):
        base = statistics.median(base_ch)
        if base - ch > drop_db:
            ratio = r.get("outlier_ratio", math.nan)
            found.append(
                (
                    base - ch - drop_db,
                    f"median-channel SQNR fell {base - ch:.1f} dB to {ch:.1f} dB (one channel {ratio:.3g}x the median "
                    "channel's amax sets the scale of all)",
                )
            )
    ratio = r.get("outlier_ratio", math.nan)
    if outlier_level is not None and ratio >= outlier_level / 2**HEADROOM_BINADES:
        left = math.log2(outlier_level / ratio)
        found.append(
            (
                _db_past(ratio, outlier_level / 2**HEADROOM_BINADES),
                f"one channel {ratio:.3g}x the median channel's amax: under a per-tensor scale the median channel "
                f"keeps {max(left, 0.0):.1f} binades of the format's normal range",
            )
        )
    recent = clean[-BASELINE_STEPS:]
    sat, uf = r["saturation_pct"], r["underflow_pct"]
    prev_sat = statistics.median([p["saturation_pct"] for p in recent]) if recent else 0.0
    prev_uf = statistics.median([p["underflow_pct"] for p in recent]) if recent else 0.0
    if sat > SATURATION_PCT and sat > 10 * prev_sat:
        found.append((_db_past(sat, SATURATION_PCT), f"{sat:.2f}% of values saturate"))
    if uf > UNDERFLOW_PCT and uf > 5 * max(prev_uf, 1.0):
        found.append((_db_past(uf, UNDERFLOW_PCT), f"{uf:.1f}% of non-zero values underflow to zero"))
    return max(found, key=lambda f: f[0]) if found else None


def find_departures(
    stats: list[dict[str, Any]], drop_db: float, floor_db: float, outlier_level: float | None = None
) -> list[Culprit]:
    """Every operand that departs, scored (unranked): one ``Culprit`` per (layer, operand).

    ``stats`` are the inspector's records; those of recipe ``"actual"`` are read. ``outlier_level``: the
    outlier ratio that puts the median channel below the format's normal range under a per-tensor scale
    (``trends``' saturation level; None for tile recipes): a ratio within ``HEADROOM_BINADES`` of it departs.
    """
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in stats:
        if r["recipe"] == "actual":
            series.setdefault((r["layer"], r["operand"]), []).append(r)
    found: list[Culprit] = []
    for (layer, operand), recs in series.items():
        recs.sort(key=lambda r: r["step"])
        clean: list[dict[str, Any]] = []
        past: list[tuple[dict[str, Any], float, str]] = []
        for r in recs:
            reading = _reading(r, clean, drop_db, floor_db, outlier_level)
            if reading is None:
                clean.append(r)  # a departure never enters the baseline it is measured against
            else:
                past.append((r, *reading))
        if not past:
            continue
        worst, severity, what = max(past, key=lambda p: p[1])
        first = past[0][0]["step"]
        span = recs[-1]["step"] - first + 1
        details = [f"saturation {worst['saturation_pct']:.2f}%", f"underflow {worst['underflow_pct']:.1f}%"]
        if "staleness" in worst:
            details.append(f"amax/scale-amax {worst['staleness']:.3g}")
        when = f"at step {worst['step']}" if len(past) == 1 else f"worst at step {worst['step']}"
        reason = f"{what} ({', '.join(details)}); {when}, past a threshold in {len(past)} of {span} steps"
        kinds = Counter(_kind(p[2]) for p in past)
        common, n_common = kinds.most_common(1)[0]
        if common != _kind(what):  # what most of the steps show, when the worst step shows something else
            reason += f"; in {n_common} of them: {next(p[2] for p in reversed(past) if _kind(p[2]) == common)}"
        score = float(sum(p[1] for p in past))
        found.append(Culprit(layer, operand, first, reason, float(severity), len(past), score, span))
    return found


def _kind(what: str) -> str:
    """The kind of a reading's description: its words before the first figure."""
    return re.match(r"[^\d]*", what).group()


def persists(c: Culprit) -> bool:
    """Whether a departure persists (module docstring: a latent finding when the loss shows nothing)."""
    return c.steps >= LATENT_MIN_STEPS and c.steps >= LATENT_FRACTION * c.span


def trend_culprit(t: Trend) -> Culprit:
    """A growing early-warning signal as a finding: ``operand`` is the signal, ``step`` the first warning,
    ``severity`` the fitted growth per step in dB, ``score`` that over the steps it has warned for."""
    rate_db = 10 * math.log10(t.growth_per_step)
    steps = t.steps_warned
    return Culprit(t.layer, t.signal, t.step, t.reason, rate_db, steps, rate_db * steps, steps, t.projected_step)


def rank(departures: list[Culprit], order: list[str], marginal_db: float) -> tuple[list[Culprit], list[Culprit]]:
    """``(culprits, notes)``: departures scoring at least ``marginal_db``, most suspect first, and the rest.

    Non-finite values come first. Then the highest score (severity times persistence) leads an event:
    the departures that start at the same step with a score within ``EVENT_RATIO`` of it are one fault
    seen in several places, listed in execution order (forward operands as the layers of ``order`` run,
    then gradients in backward order), so its origin comes first. The next event follows.
    """
    pos = {n: i for i, n in enumerate(order)}

    def runs_at(c: Culprit) -> tuple:
        at = pos.get(module_of(c.layer), len(pos))
        return (c.step, c.operand == "grad", -at if c.operand == "grad" else at)

    def nonfinite(c: Culprit) -> bool:
        return c.reason.startswith("non-finite")

    left = sorted(departures, key=lambda c: (not nonfinite(c), -c.score, *runs_at(c)))
    ranked: list[Culprit] = []
    while left:
        lead = left[0]
        event = [
            c
            for c in left
            if c.step == lead.step and nonfinite(c) == nonfinite(lead) and c.score * EVENT_RATIO >= lead.score
        ]
        ranked += sorted(event, key=runs_at)
        left = [c for c in left if c not in event]
    return [c for c in ranked if c.score >= marginal_db], [c for c in ranked if c.score < marginal_db]


def module_of(layer: str) -> str:
    """The module a reported layer name belongs to: ``"mlp.experts[3].gate_up_proj"`` (one expert's weight,
    as the inspector names it) -> ``"mlp.experts"``; any other name is a module's own."""
    return layer.split("[", 1)[0]


NOISE_FACTOR = 2.0  # a final gap up to this many times the one-ulp BF16 copy's is the run-to-run spread


def final_gap(losses: dict[str, list[float]]) -> float:
    """FP8 over BF16 loss, relative, on the mean of the last fifth of the steps."""
    lf, lr = losses["fp8"], losses["bf16"]
    tail = max(1, len(lr) // 5)
    mean_f, mean_r = sum(lf[-tail:]) / tail, sum(lr[-tail:]) / tail
    return (mean_f - mean_r) / abs(mean_r) if mean_r else math.inf


def classify(
    losses: dict[str, list[float]],
    stopped: int | None,
    gap_tol: float,
    divergence_tol: float,
    spike_z: float,
    noise_gap: float | None = None,
) -> tuple[str, str, dict[str, list[int]]]:
    """``(kind, summary, spikes)`` of the two loss curves: ``spike``, ``divergence``, ``gap`` or ``none``.

    ``stopped`` is the step the FP8 run stopped at (its loss non-finite), else None. ``noise_gap``: the final
    gap of a BF16 copy with one layer's weights one ulp off (the run-to-run spread); a gap past ``gap_tol`` but within
    ``NOISE_FACTOR`` times it is not FP8's.
    """
    lf, lr = losses["fp8"], losses["bf16"]
    n = len(lr)
    spikes: dict[str, list[int]] = {}
    for key, series in (("fp8", lf), ("bf16", lr)):
        det = SpikeDetector(window=20, threshold=spike_z, min_history=min(5, max(3, n // 4)))
        spikes[key] = [s.step - 1 for s in (det.update(v) for v in series) if s is not None]
    gap = final_gap(losses)
    bad_ref = next((i for i, v in enumerate(lr) if not math.isfinite(v)), None)
    if bad_ref is not None:
        return "divergence", f"BF16 too becomes non-finite at step {bad_ref}: not FP8's fault", spikes
    if stopped is not None or not math.isfinite(gap) or gap > divergence_tol:
        step = (
            stopped
            if stopped is not None
            else next((i for i in range(n) if (lf[i] - lr[i]) / abs(lr[i]) > divergence_tol), n - 1)
        )
        when = "early" if step < max(3, n // 10) else "late"
        hint = "points at a software bug (a wrong scale or format)" if when == "early" else "points at numerics"
        return "divergence", f"FP8 diverges from BF16 at step {step} ({when}: {hint})", spikes
    fp8_only = [s for s in spikes["fp8"] if not any(abs(s - b) <= 1 for b in spikes["bf16"])]
    if spikes["fp8"]:
        if fp8_only:
            return "spike", f"FP8 loss spikes at steps {fp8_only} that BF16 does not have", spikes
        return "spike", f"loss spikes at steps {spikes['fp8']} in BF16 too: not FP8's fault (data or LR)", spikes
    spread = "" if noise_gap is None else f"; BF16 with one layer one ulp off ends {100 * noise_gap:+.2f}% away"
    if gap > gap_tol and (noise_gap is None or gap > NOISE_FACTOR * abs(noise_gap)):
        return "gap", f"FP8 ends {100 * gap:.2f}% above BF16 (tolerance {100 * gap_tol:.1f}%){spread}", spikes
    if gap > gap_tol:
        return "none", f"FP8 ends {100 * gap:.2f}% above BF16, within the run-to-run spread{spread}", spikes
    return "none", f"FP8 tracks BF16 (final gap {100 * gap:+.2f}%){spread}", spikes


@dataclass
class Diagnosis:
    kind: str  # "spike" | "divergence" | "gap" | "latent" | "none"
    summary: str
    spikes: dict[str, list[int]]  # loss spikes of "fp8" and "bf16" (steps)
    culprits: list[Culprit]  # most suspect first (latent: the latent findings); empty when healthy
    notes: list[Culprit]  # departures without a loss effect that recover, or marginal ones
    trends: list[Trend] = field(default_factory=list)  # every growing early-warning signal


def diagnose(
    run: Mapping[str, Any],
    *,
    gap_tol: float,
    divergence_tol: float,
    spike_z: float,
    drop_db: float,
    floor_db: float,
    marginal_db: float,
    saturation: Mapping[str, float] | None = None,
) -> Diagnosis:
    """The diagnosis of one doctor run: ``run`` holds ``losses`` (``"bf16"``, ``"fp8"`` and, with a noise
    floor, ``"bf16_nudged"``), ``stopped``, ``stats`` (the inspector's records), ``order`` (layers in execution
    order) and ``first_nonfinite`` (the NaN detector's finding). ``saturation``: the signals' saturation
    levels (``trends.find_trends``).
    """
    losses = run["losses"]
    noise = final_gap({"fp8": losses["bf16_nudged"], "bf16": losses["bf16"]}) if "bf16_nudged" in losses else None
    kind, summary, spikes = classify(run["losses"], run["stopped"], gap_tol, divergence_tol, spike_z, noise)
    level = (saturation or {}).get("outlier_ratio")
    culprits, notes = rank(find_departures(run["stats"], drop_db, floor_db, level), run["order"], marginal_db)
    f = run["first_nonfinite"]
    if f is not None and not (culprits and culprits[0].layer == f["layer"]):
        # the NaN detector names where the first non-finite value appears, inside or outside FP8 layers
        culprits.insert(0, Culprit(f["layer"], f["operand"], f["step"], "first non-finite value", NONFINITE_DB))
    trends = find_trends(run["stats"], saturation)
    if kind == "none":  # the loss shows no problem: what persists or grows is latent, the rest is noted
        latent = [c for c in culprits if persists(c)]
        latent += [trend_culprit(t) for t in trends if t.projected_step is not None]
        notes = sorted([c for c in culprits + notes if c not in latent], key=lambda c: -c.score)
        notes += [trend_culprit(t) for t in trends if t.projected_step is None]
        culprits = latent
        if latent:
            kind, top = "latent", latent[0]
            summary += (
                f"; latent: {top.layer} {top.operand} {_latent_what(top)}, no loss effect yet"
                f" ({len(latent)} latent finding{'s' * (len(latent) > 1)}, {len(notes)} notes)"
            )
        else:
            summary += (
                f"; {len(notes)} numerics departures noted, none with a loss effect"
                if notes
                else "; no layer shows a numerics anomaly"
            )
    return Diagnosis(kind, summary, spikes, culprits, notes, trends)


def _outside(
    culprits: list[Culprit], fp8_layers: list[str], fp8_attention: list[str] | tuple[str, ...]
) -> list[Culprit]:
    """The culprits in neither an FP8 layer nor an FP8 attention block."""
    return [c for c in culprits if module_of(c.layer) not in fp8_layers and c.layer not in fp8_attention]


def _latent_what(c: Culprit) -> str:
    if c.projected_step is not None:
        return f"grows from step {c.step}, projected to saturate at step {c.projected_step}"
    return f"past a threshold in {c.steps} of the {c.span} steps since step {c.step}"


ATTENTION_OPERANDS = ("attn_q", "attn_k", "attn_v", "attn_p", "attn_do", "attn_ds")  # as the inspector names them


def recommend(
    culprits: list[Culprit], recipe: Recipe, fp8_layers: list[str], fp8_attention: list[str] | tuple[str, ...] = ()
) -> list[Recommendation]:
    """Ranked fixes for the top culprits (a culprit outside ``fp8_layers`` and the FP8 attention blocks
    ``fp8_attention`` gets a manual look first). When the top FP8 culprit is an attention operand, the first fix
    runs the attention of the blocks named in the top culprits in high precision (BF16)."""
    recs: list[Recommendation] = []
    in_attention = [c for c in culprits if c.operand in ATTENTION_OPERANDS and c.layer in fp8_attention]
    attention_fix = []
    if in_attention:
        top = in_attention[0]
        blocks = list(dict.fromkeys(c.layer for c in in_attention[:3]))
        attention_fix.append(
            Recommendation(
                f"run the attention of {', '.join(blocks)} in BF16: fp8kit.convert(model, recipe, attention=..., "
                f"attention_filter=lambda n, m: n not in {blocks!r})",
                {"type": "bf16_attention", "blocks": blocks},
                f"{top.layer} {top.operand.removeprefix('attn_').upper()}: {top.reason}",
            )
        )
    inside = [c for c in culprits if c not in _outside(culprits, fp8_layers, fp8_attention)]
    if attention_fix and inside[0] is in_attention[0]:  # FP8 attention is where it starts
        recs, attention_fix = attention_fix, []
    culprits = [c for c in culprits if c not in in_attention]
    outside = _outside(culprits, fp8_layers, fp8_attention)
    if outside:
        c = outside[0]
        recs.append(
            Recommendation(
                f"look at {c.layer!r} ({c.operand}, step {c.step}): it is not an FP8 layer, so its {c.reason} "
                "comes from the model or the data, not from FP8",
                {"type": "manual"},
                "the first anomaly appears outside the converted layers",
            )
        )
    culprits = [c for c in culprits if module_of(c.layer) in fp8_layers]
    if not culprits:
        return recs + attention_fix
    top = culprits[0]
    layers = list(dict.fromkeys(module_of(c.layer) for c in culprits[:3]))  # an expert: its experts module
    recs.append(
        Recommendation(
            f"keep {', '.join(layers)} in BF16: fp8kit.convert(model, recipe, module_filter=lambda n, m: n not in "
            f"{layers!r})",
            {"type": "bf16_layers", "layers": layers},
            f"{top.layer} {top.operand}: {top.reason}",
        )
    )
    stale = "amax/scale-amax" in top.reason and ("saturate" in top.reason or "fell" in top.reason)
    if isinstance(recipe, DelayedScaling):
        recs.append(
            Recommendation(
                "switch to current scaling (fp8kit.CurrentScaling()): the scale follows this step's amax",
                {"type": "recipe", "recipe": "current"},
                "delayed scaling reuses an amax history that a sudden change outgrows"
                if stale
                else "a per-step scale removes stale-scale saturation",
            )
        )
    if "underflow" in top.reason or "fell" in top.reason:
        recs.append(
            Recommendation(
                "use block scaling (fp8kit.BlockScaling(): 1x128 activation tiles) so an outlier channel "
                "sets the scale of its own tiles only",
                {"type": "recipe", "recipe": "block"},
                "one large channel stretches a per-tensor range and pushes the rest toward underflow",
            )
        )
    if top.operand == "input" and top.layer.endswith(("down_proj", "fc2", "w2")):
        recs.append(
            Recommendation(
                "smooth the outlier channel before quantizing (Smooth-SwiGLU: per-channel scale on the "
                "SwiGLU output folded into the down projection)",
                {"type": "manual"},
                "SwiGLU outputs grow outlier channels late in training (Fishman et al., 2024)",
            )
        )
    if isinstance(recipe, DelayedScaling):
        history, margin = min(16, recipe.amax_history_len), recipe.margin + 1
        shorter = f"shorten the amax history (amax_history_len={history} instead of {recipe.amax_history_len}) and "
        recs.append(
            Recommendation(
                f"{shorter if history < recipe.amax_history_len else ''}add margin={margin}",
                {"type": "recipe", "recipe": "delayed", "amax_history_len": history, "margin": margin},
                "a shorter window adapts faster; a margin leaves headroom above the amax",
            )
        )
    return recs + attention_fix
