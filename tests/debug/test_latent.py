"""The doctor's latent verdict and early warning, on a 4-layer ``transformers`` Llama (hidden 64).

An operand that stays crushed for most of the run, or a signal that grows toward saturation, is latent
even when the loss does not show it yet; a transient that recovers is a note; a healthy run stays quiet.
The plants (``plants.py``) sit in the model itself, so the BF16 copy carries them too and the loss barely
moves: the loss alone calls these runs healthy (``FP8 tracks BF16``).
"""

from __future__ import annotations

import pytest

import fp8kit
from fp8kit import debug

from . import plants

transformers = pytest.importorskip("transformers")

DELAYED = fp8kit.DelayedScaling(amax_history_len=16)
STEPS = 10
DOWN = "model.layers.2.mlp.down_proj"


def doctor(model, steps: int = STEPS, recipe=DELAYED, **kwargs) -> debug.DoctorReport:
    return debug.doctor(model, plants.batches(steps), recipe=recipe, steps=steps, **kwargs)


@pytest.fixture(scope="module")
def outlier() -> debug.DoctorReport:
    """One channel of layer 2's down_proj input 2^14 x the rest from the fifth forward on."""
    return doctor(plants.plant_outlier(plants.llama(4), start=4), apply=True)


def test_a_persistent_outlier_channel_is_latent(outlier):
    assert outlier.summary.startswith("FP8 tracks BF16"), outlier.summary  # the loss shows nothing
    assert outlier.kind == "latent" and not outlier.healthy, outlier.summary
    top = outlier.culprits[0]
    assert (top.layer, top.operand, top.step) == (DOWN, "input", 4), [(c.layer, c.operand) for c in outlier.culprits]
    assert top.steps >= 0.5 * top.span and top.span == STEPS - 4
    assert "one channel" in top.reason and "x the median channel's amax" in top.reason  # why
    # ranked fixes, each with its figures on the recorded operand: Smooth-SwiGLU keeps FP8 and clears it
    fixes = outlier.recommendations
    assert {r.fix["type"] for r in fixes} == {"smooth_swiglu", "layer_recipe", "bf16_layers"}
    assert all(r.sqnr is not None and "median-channel SQNR" in r.action for r in fixes)
    assert fixes[0].fix["type"] == "smooth_swiglu"
    readings = [r for r in outlier.stats if (r["layer"], r["operand"], r["recipe"]) == (DOWN, "input", "actual")]
    clean = readings[0]["channel_sqnr_db"]
    assert fixes[0].sqnr["channel_sqnr_db"] > clean - 3.0  # back to the level before the outlier
    assert fixes[-1].fix["type"] == "bf16_layers"  # an FP8 fix clears it: BF16 is the last resort
    # --apply runs it: the down_proj input is no longer a finding
    assert outlier.applied["fix"] == fixes[0].action
    assert all(c["layer"] != DOWN for c in outlier.applied["culprits_after"]), outlier.applied["summary_after"]


def test_the_report_names_the_latent_finding(outlier):
    from fp8kit.debug.report import report_markdown

    text = report_markdown(outlier.to_dict(), outlier.stats)
    assert text.startswith("# fp8kit doctor: latent")
    assert "## Latent findings" in text and f"`{DOWN}` | input" in text
    assert "## Recommendations (ranked)" in text and "smooth_swiglu=True" in text


def test_a_transient_outlier_stays_a_note():
    rep = doctor(plants.plant_outlier(plants.llama(4), start=4, stop=6))  # steps 4 and 5 only
    assert rep.healthy and rep.kind == "none", rep.summary
    assert rep.culprits == [] and rep.recommendations == []
    assert any(c.layer == DOWN and c.operand == "input" and c.step == 4 for c in rep.notes)


def test_a_healthy_run_stays_quiet():
    rep = doctor(plants.llama(4))
    assert rep.healthy and rep.kind == "none" and rep.culprits == [] and rep.recommendations == [], rep.summary
    assert not [t for t in rep.trends if t.projected_step is not None]


def test_gate_up_alignment_warns_before_the_sqnr_collapses():
    # the rows of one gate/up pair align and grow (x2 per step each) from step 2 on; current scaling, so
    # the only damage is the outlier channel crushing the others
    steps = 12
    rep = doctor(plants.plant_alignment(plants.llama(4), rate=2.0), steps, fp8kit.CurrentScaling(), lr=2e-4)
    assert rep.kind == "latent", rep.summary
    warn = next(t for t in rep.trends if (t.layer, t.signal) == ("model.layers.2.mlp", "gate_up_alignment"))
    assert warn.projected_step is not None and warn.growth_per_step > 2
    readings = [r for r in rep.stats if (r["layer"], r["operand"], r["recipe"]) == (DOWN, "input", "actual")]
    clean = readings[0]["channel_sqnr_db"]
    collapse = next(r["step"] for r in readings if r["channel_sqnr_db"] < clean - 10.0)
    assert warn.step < collapse, (warn.step, collapse)
    assert any(c.operand == "gate_up_alignment" for c in rep.culprits)
