"""What the commands report matches what they did: ``compare`` names no calibration method for schemes that
calibrate nothing, and ``eval`` of a checkpoint uses the held-out batches of the training summary."""

from __future__ import annotations

import json

from fp8kit.cli import main
from fp8kit.compare import calibration_methods


def test_compare_reports_no_calibration_for_schemes_without_static_scales():
    assert calibration_methods(["fp8-dynamic", "int8-weight-only"], None).startswith("none")
    assert calibration_methods(["fp8-dynamic"], "mse").startswith("none")  # nothing used the method
    mixed = calibration_methods(["fp8", "fp8-dynamic", "fp8-dynamic+kv"], None)
    assert mixed == "mse (fp8), none (fp8-dynamic), mse (fp8-dynamic+kv)"


def test_eval_of_a_checkpoint_prints_the_training_summarys_perplexity(tmp_path, capsys):
    out = tmp_path / "run"
    tiny = ["--model-size", "tiny", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--no-progress"]
    assert main(["train", *tiny, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out)]) == 0
    printed = capsys.readouterr().out
    for run, res in summary["runs"].items():
        assert f"{run} (step 2) on the held-out split of King James Bible: loss {res['val_loss']:.4f}" in printed
