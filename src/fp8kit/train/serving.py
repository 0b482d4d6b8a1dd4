"""``fp8kit train --export-format FMT``: the serving checkpoint of each FP8 run, written after training
from the run's latest checkpoint (its trained scales, no calibration pass) to ``OUT/serving/<run>``."""

from __future__ import annotations

from pathlib import Path

from ..export import save_pretrained
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, read_info
from .loop import TrainConfig, build_base, make_model

__all__ = ["export_runs"]


def export_runs(out: str | Path, fmt: str, runs: list[str]) -> list[Path]:
    """Write ``OUT/serving/<run>`` in ``fmt`` for each FP8 run in ``runs`` (``fp8-<recipe>``); returns the folders."""
    written = []
    base = tokenizer = None
    for run in runs:
        found = latest_checkpoint(Path(out) / "ckpt" / run)
        if found is None:
            raise CheckpointError(f"no checkpoint of {run} in {out}/ckpt: nothing to export")
        info = read_info(found)
        if base is None:
            base, tokenizer = build_base(TrainConfig(model=info["model"], seed=info["seed"]))
        model = make_model(base, TrainConfig(model=info["model"], plan=info.get("plan")), run)
        load_checkpoint(found, model)
        written.append(save_pretrained(model, Path(out) / "serving" / run, tokenizer, format=fmt))
    return written
