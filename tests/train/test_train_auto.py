"""``fp8kit train --recipe auto``: the plan is made on the first batches, printed, written to the run folder and
trained with; the checkpoint rebuilds the planned model."""

import json

from fp8kit.cli import main
from fp8kit.jobs.loading import load_train_checkpoint
from fp8kit.nn.linear import Linear as FP8Linear
from fp8kit.planner import Plan, roofline
from fp8kit.train.checkpoint import latest_checkpoint, read_info

TINY = ["--model-size", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--no-progress"]


def test_recipe_auto_plans_trains_and_records_the_plan(tmp_path, capsys, monkeypatch):
    # a compute-bound "h100": FP8 halves every GEMM here, so the plan converts the layers the budget allows
    monkeypatch.setitem(roofline.GPUS, "h100", roofline.GPU("h100", 1e12, 2e12, 1e13, (9, 0)))
    out = tmp_path / "run"
    assert main(["train", *TINY, "--recipe", "auto", "--loss-budget", "0.05", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.from_json(out / "plan.json")
    assert "fp8kit.autotune plan on h100" in printed and all(name in printed for name in plan.per_layer)
    assert plan.loss_budget == 0.05 and plan.total_loss_increase <= plan.allowed_increase
    fp8_layers = {n for n, c in plan.per_layer.items() if c != "bf16"}
    assert fp8_layers, plan.per_layer
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"bf16", "fp8-auto"}
    ckpt = latest_checkpoint(out / "ckpt" / "fp8-auto")
    assert read_info(ckpt)["plan"] == plan.per_layer
    model, _ = load_train_checkpoint(ckpt)
    for name, choice in plan.per_layer.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, FP8Linear) == (choice != "bf16"), name
        if choice != "bf16":
            assert layer.recipe.kind == choice


def test_recipe_auto_bad_settings(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", *TINY, "--recipe", "auto", "--loss-budget", "-1", "--out", out]) != 0
    assert "--loss-budget" in capsys.readouterr().err
    assert main(["train", *TINY, "--recipe", "auto", "--nproc", "2", "--out", out]) != 0
    assert "--recipe auto" in capsys.readouterr().err
    assert main(["train", *TINY, "--recipe", "auto", "--target", "a100", "--out", out]) != 0
