"""FP8 debugging: inspector statistics, NaN and spike detectors, and the doctor on planted faults."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

import fp8kit
from fp8kit import debug
from fp8kit.cli import main
from fp8kit.debug.stats import operand_stats
from tests.helpers.planted import Planted, mlp, mse


@pytest.fixture(scope="module")
def batches():
    torch.manual_seed(1)
    w = torch.randn(64, 16)
    return [(x, torch.tanh(x @ w)) for x in [torch.randn(32, 64) for _ in range(6)]]


# ---- statistics ------------------------------------------------------------------------------------


def test_operand_stats_figures():
    x = torch.tensor([[1.0, -2.0, 0.0, 1e-9], [500.0, 3.0, 4.0, 0.5]])
    # delayed scale set for amax 448 / 4 = 112: values above 112 saturate
    s = operand_stats(x, "input", fp8kit.DelayedScaling(), delayed_scale=torch.tensor(4.0))
    assert s["amax"] == 500.0 and s["scale"] == 4.0 and s["scale_inv"] == 0.25
    assert s["saturation_pct"] == pytest.approx(100 / 8)  # 500 * 4 > 448
    assert s["underflow_pct"] == pytest.approx(100 / 7)  # 1e-9 of the 7 non-zero values
    assert s["staleness"] == pytest.approx(500 / 112)
    assert s["dynamic_range_binades"] == pytest.approx(math.log2(500 / 1e-9))
    # current scaling: no saturation, SQNR of E4M3 rounding (~3 mantissa bits)
    c = operand_stats(torch.randn(64, 64), "input", fp8kit.CurrentScaling())
    assert c["saturation_pct"] == 0 and 28 < c["sqnr_db"] < 36
    g = operand_stats(torch.randn(64, 64), "grad", fp8kit.CurrentScaling())  # E5M2: 2 mantissa bits
    assert 22 < g["sqnr_db"] < 30


def test_inspector_records_every_operand_and_what_if(tmp_path):
    model = fp8kit.convert(mlp(), fp8kit.DelayedScaling())
    x = torch.randn(16, 64)
    with debug.inspect(model, log_dir=tmp_path, every=2, what_if=["block"]) as insp:
        for _ in range(4):
            model(x).pow(2).mean().backward()
            insp.step()
    rows = debug.read_stats(tmp_path)
    assert {r["step"] for r in rows} == {0, 2}
    layers = {r["layer"] for r in rows}
    assert layers == {"0", "2", "5", "7"}
    combos = {(r["layer"], r["operand"], r["recipe"]) for r in rows}
    assert len(combos) == 4 * 3 * 2  # layers x operands x (actual, what-if)
    actual = [r for r in rows if r["recipe"] == "actual" and r["step"] == 2]
    assert all("staleness" in r for r in actual)  # delayed scaling reports how stale the scale is
    assert (tmp_path / "tensorboard").is_dir() and any((tmp_path / "tensorboard").iterdir())
    # outside the block the hooks are gone: no records, identical outputs
    n = len(insp.records)
    model(x)
    assert len(insp.records) == n and not model[0]._forward_pre_hooks


def test_inspector_sees_a_planted_outlier(batches):
    model = fp8kit.convert(mlp(Planted(start=3)), fp8kit.DelayedScaling())
    with debug.inspect(model, what_if=["current"]) as insp:
        for i in range(6):
            mse(model, batches[i]).backward()
            insp.step()

    def series(layer, key, recipe="actual"):
        return {
            r["step"]: r[key]
            for r in insp.records
            if r["layer"] == layer and r["operand"] == "input" and r["recipe"] == recipe
        }

    sq, sat = series("5", "sqnr_db"), series("5", "saturation_pct")
    # step 3: the x1e4 channel meets a scale set for the old range: it saturates, SQNR collapses
    assert sq[2] > 25 and sq[3] < 5 and sat[3] > 0.5 and sat[2] < 0.5
    # what-if current scaling on the same tensor: no saturation, but the rest of the range underflows
    uf = series("5", "underflow_pct", "current")
    assert series("5", "saturation_pct", "current")[3] == 0 and uf[3] > uf[2] + 5
    assert series("5", "dynamic_range_binades")[3] > series("5", "dynamic_range_binades")[2] + 10
    other = series("2", "sqnr_db")
    assert abs(other[3] - other[2]) < 3  # the layer before it is unaffected


# ---- detectors -------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:fp8kit. non-finite amax:RuntimeWarning")
def test_nan_detector_names_the_layer(batches):
    model = fp8kit.convert(mlp(Planted(start=0, nan=True)), fp8kit.DelayedScaling())
    with debug.NaNDetector(model) as det:
        model(batches[0][0])
    assert det.first == {"layer": "4", "operand": "output", "step": 0}
    with pytest.raises(debug.NonFiniteError, match="output of layer '4'"), debug.NaNDetector(model, raise_on_nan=True):
        model(batches[0][0])
    clean = mlp()
    with debug.NaNDetector(clean) as det:
        mse(clean, batches[0]).backward()
    assert det.first is None


def test_nan_detector_catches_gradients():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    model[1].register_full_backward_pre_hook(lambda m, g: (g[0] * float("nan"),))
    with debug.NaNDetector(model) as det:
        model(torch.randn(4, 8)).sum().backward()
    assert det.first["operand"] == "grad_output"


def test_spike_detector():
    det = debug.SpikeDetector(window=20, threshold=6)
    torch.manual_seed(0)
    losses = (2.0 - 0.01 * torch.arange(40) + 0.01 * torch.randn(40)).tolist()
    losses[25] = 4.0
    spikes = [s for i, v in enumerate(losses) if (s := det.update(v, i))]
    assert [s.step for s in spikes] == [25]
    assert det.update(float("nan"), 41).zscore == math.inf
    with pytest.raises(ValueError):
        debug.SpikeDetector(window=2)


# ---- doctor on planted faults -------------------------------------------------------------------------


def test_doctor_healthy_run_raises_no_alarm(batches, tmp_path):
    rep = debug.doctor(mlp(), batches, steps=16, loss_fn=mse)
    assert rep.healthy and rep.kind == "none" and not rep.culprits and not rep.recommendations
    path = rep.save(tmp_path / "report")
    assert path.read_text().startswith("# fp8kit doctor: healthy")
    for name in ("loss.png", "heatmaps.png"):
        assert (tmp_path / "report" / name).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "report" / "report.json").read_text())["healthy"] is True


def test_doctor_localises_an_outlier_channel(batches):
    model = mlp(Planted(start=8))
    rep = debug.doctor(model, batches, steps=14, loss_fn=mse, apply=True)
    assert model[4].calls == 0  # the user's model is never run or modified
    # the channel appears at step 8 and the losses part from step 10: a late divergence (numerics)
    assert not rep.healthy and rep.kind == "divergence" and "late" in rep.summary, rep.summary
    top = rep.culprits[0]
    assert (top.layer, top.operand, top.step) == ("5", "input", 8)
    assert rep.recommendations[0].fix == {"type": "bf16_layers", "layers": ["5", "2", "7"]} or "5" in (
        rep.recommendations[0].fix.get("layers", [])
    )
    assert rep.applied is not None and rep.applied["gap_after"] < rep.applied["gap_before"]


def test_doctor_localises_a_corrupted_scale(batches):
    def corrupt(fp8_model):
        layer, calls = fp8_model.get_submodule("5"), {"n": 0}

        def pre(mod, args):
            calls["n"] += 1
            if calls["n"] > 6 and int(mod.fp8_seen[0]) > 0 and float(mod.fp8_scale[0]) < 1e3:
                mod.fp8_scale[0] *= 2**10  # the bug: a scale off by 2^10 from step 6 on

        layer.register_forward_pre_hook(pre)

    rep = debug.doctor(mlp(), batches, steps=14, loss_fn=mse, prepare_fp8=corrupt)
    assert not rep.healthy
    top = rep.culprits[0]
    assert (top.layer, top.operand, top.step) == ("5", "input", 6)
    assert "saturation" in top.reason


@pytest.mark.filterwarnings("ignore:fp8kit. non-finite amax:RuntimeWarning")
def test_doctor_names_the_nan_layer(batches):
    rep = debug.doctor(mlp(Planted(start=4, nan=True)), batches, steps=10, loss_fn=mse)
    assert rep.kind == "divergence" and rep.first_nonfinite == {"layer": "4", "operand": "output", "step": 4}
    assert rep.culprits[0].layer == "4"


def test_a_gap_within_the_run_to_run_spread_is_not_fp8s():
    losses = {"bf16": [1.0] * 10, "fp8": [1.03] * 10}  # a 3% gap, past the 2% tolerance
    assert debug.diagnosis.classify(losses, None, 0.02, 0.25, 8.0)[0] == "gap"
    assert debug.diagnosis.classify(losses, None, 0.02, 0.25, 8.0, noise_gap=0.01)[0] == "gap"
    kind, summary, _ = debug.diagnosis.classify(losses, None, 0.02, 0.25, 8.0, noise_gap=-0.02)
    assert kind == "none" and "run-to-run spread" in summary and "-2.00%" in summary, summary


def test_doctor_noise_floor_trains_bf16_one_layer_one_ulp_off(batches, tmp_path):
    rep = debug.doctor(mlp(), batches, steps=6, loss_fn=mse, noise_floor=True)
    ref, nudged = rep.losses["bf16"], rep.losses["bf16_nudged"]
    assert len(nudged) == len(ref) == 6
    assert nudged != ref and all(abs(a / b - 1) < 1e-2 for a, b in zip(nudged, ref, strict=True))
    assert "one ulp off" in rep.summary, rep.summary
    plain = debug.doctor(mlp(), batches, steps=6, loss_fn=mse)
    assert plain.losses["bf16"] == ref and "bf16_nudged" not in plain.losses  # the pair trains as without it
    assert (rep.save(tmp_path / "r") / "..").resolve().joinpath("loss.png").is_file()


def test_doctor_bad_input(batches, tmp_path):
    with pytest.raises(ValueError, match="no layer was converted"):
        debug.doctor(nn.Sequential(nn.ReLU()), [torch.randn(2, 2)], steps=2)
    with pytest.raises(ValueError, match="module_filter matched nothing"):
        debug.doctor(mlp(), batches, steps=2, loss_fn=mse, module_filter=lambda n, m: False)
    with pytest.raises(ValueError, match="no FP8 layers to inspect"):
        debug.inspect(mlp())
    with pytest.raises(ValueError, match="no batches"):
        debug.doctor(mlp(), [], steps=2)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        debug.read_stats(empty)
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(PermissionError, match="cannot write"):
        with debug.inspect(fp8kit.convert(mlp(), fp8kit.CurrentScaling()), log_dir=blocked / "sub"):
            pass


def test_doctor_cli(tmp_path, capsys):
    out = tmp_path / "doc"
    args = ["doctor", "--model-size", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "32"]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fp8kit doctor (delayed vs bf16, 4 steps)" in printed
    assert (out / "report.md").is_file() and (out / "fp8_stats.jsonl").is_file()
    blocked = tmp_path / "file"
    blocked.write_text("x")
    assert main([*args, "--out", str(blocked / "sub")]) == 2
    assert "error" in capsys.readouterr().err


def test_doctor_cli_on_the_moe_demo_reads_every_expert(tmp_path, capsys):
    """``fp8kit doctor --arch moe``: the report's per-expert readings cover both projections' weights, inputs
    and output gradients; ``--arch moe`` with another model is refused."""
    out = tmp_path / "doc"
    args = ["doctor", "--arch", "moe", "--model-size", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "16"]
    assert main([*args, "--out", str(out)]) == 0
    assert "fp8kit doctor (delayed vs bf16, 3 steps)" in capsys.readouterr().out
    recs = [json.loads(line) for line in (out / "fp8_stats.jsonl").read_text().splitlines()]
    expert = {(r["layer"].rsplit(".", 1)[1], r["operand"]) for r in recs if ".experts[" in r["layer"]}
    assert expert == {(p, o) for p in ("gate_up_proj", "down_proj") for o in ("input", "weight", "grad")}
    assert main([*args, "--model", "smollm2", "--out", str(tmp_path / "x")]) == 2
    assert "--arch moe builds the demo model" in capsys.readouterr().err
