"""What the commands report matches what they did: ``compare`` names no calibration method for schemes that
calibrate nothing (``eval`` of a checkpoint printing the training summary's loss: tests/cli/test_progress.py)."""

from __future__ import annotations

from fp8kit.jobs.compare import calibration_methods


def test_compare_reports_no_calibration_for_schemes_without_static_scales():
    assert calibration_methods(["fp8-dynamic", "int8-weight-only"], None).startswith("none")
    assert calibration_methods(["fp8-dynamic"], "mse").startswith("none")  # nothing used the method
    mixed = calibration_methods(["fp8", "fp8-dynamic", "fp8-dynamic+kv"], None)
    assert mixed == "mse (fp8), none (fp8-dynamic), mse (fp8-dynamic+kv)"
