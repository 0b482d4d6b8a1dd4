"""The ``fp8kit train`` job: the cost line of the runs, the runs trained side by side, the summary, the
serving exports; and on Ctrl-C what was saved and the exact command that continues.

Steps (``fp8kit.cli.train`` checks the run folder and options, then): ``announce_cost`` -> ``run`` ->
``print_summary`` -> ``export``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .announce import announce, shape_of

if TYPE_CHECKING:
    from ..train import TrainConfig

__all__ = ["announce_cost", "export", "interrupt_hint", "print_summary", "run"]


def announce_cost(cfg: TrainConfig, force: bool) -> None:
    """Parameters, peak memory per process and time per run, before anything is loaded."""
    from ..runtime.device import resolve_device
    from ..train.checks import fixed_recipes
    from ..train.loop import run_names
    from .cost import estimate_training
    from .estimate import process_floor

    device = resolve_device(cfg.device, recipe=fixed_recipes(cfg.recipes), emulate=cfg.emulate)
    shape = shape_of(cfg.model, cfg.arch, cfg.model_size, cfg.seq_len)
    micro = cfg.batch_size * cfg.seq_len // max(cfg.nproc, 1)
    runs = run_names(cfg)
    interval = max(cfg.eval_interval, 1)
    evals = 1 + cfg.steps // interval + (1 if cfg.steps % interval else 0)  # step 0, each interval, the end
    cost = estimate_training(
        "train", shape, device, runs, cfg.steps, micro * cfg.grad_accum, micro, cfg.optimizer == "fp8-adamw",
        recipes={run: run.removeprefix("fp8-") for run in runs}, eval_tokens=evals * cfg.eval_batches * cfg.batch_size * cfg.seq_len,
        rates=(rates := _rates(device, runs)),
    )  # fmt: skip
    cost.phases["report"] = rates.figure_s  # loss.png
    announce(cost, device, force, process_floor(rates, compiles=any(run != "bf16" for run in runs)))


def _rates(device: Any, runs: list[str]) -> Any:
    """The device's measured rates (``estimate.current_rates``), with the per-call cost of each recipe run."""
    from ..numerics.recipes import recipe_from_name
    from .estimate import current_rates

    recipes = []
    for run in runs:
        try:
            recipe_from_name(run.removeprefix("fp8-"))
            recipes.append(run.removeprefix("fp8-"))
        except (ValueError, KeyError):
            pass
    return current_rates(device, recipes)


def run(cfg: TrainConfig, argv: list[str] | None = None) -> dict | None:
    """Train every run of ``cfg`` side by side (``train.run_comparison``) and return the summary; ``None`` when
    interrupted, after saying what was saved and the command that goes on (``argv``: the command's arguments)."""
    from ..train import run_comparison

    try:
        return run_comparison(cfg)
    except KeyboardInterrupt:
        print("\n" + interrupt_hint(cfg, argv), file=sys.stderr)
        return None


def interrupt_hint(cfg: TrainConfig, argv: list[str] | None) -> str:
    """What an interrupted ``fp8kit train`` left in ``cfg.out`` and the exact command that continues it."""
    import shlex

    from ..train.checkpoint import latest_checkpoint

    out = Path(cfg.out)
    resume = f"fp8kit train --out {shlex.quote(str(out))} --resume"
    ckpt = out / "ckpt"
    saved = sorted(p.name for p in ckpt.iterdir() if latest_checkpoint(p) is not None) if ckpt.is_dir() else []
    if saved:
        return f"interrupted: checkpoints of {', '.join(saved)} are in {ckpt}; continue with: {resume}"
    if (out / "config.json").is_file():
        return f"interrupted before the first checkpoint: nothing was saved yet; start again with: {resume}"
    again = "fp8kit " + shlex.join(argv) if argv else "the same command"
    return f"interrupted before the run started: nothing was saved; start again with: {again}"


def print_summary(cfg: TrainConfig, summary: dict) -> None:
    """The summary table (and the fp8-auto run's plan) and what was written."""
    from ..train.report import summary_markdown

    plan_file = Path(cfg.out) / "plan.json"
    if "auto" in cfg.recipes and plan_file.is_file():
        from ..planner import Plan

        print()
        print(Plan.from_json(plan_file))
        print(f"wrote the fp8-auto run's plan to {plan_file}")
    print()
    print(summary_markdown(summary))
    print(f"wrote {cfg.out}/summary.json, summary.md, loss.png, metrics.jsonl and checkpoints in {cfg.out}/ckpt")


def export(cfg: TrainConfig, export_format: str) -> None:
    """A serving checkpoint in ``export_format`` of each FP8 run."""
    from ..train.serving import export_runs

    for path in export_runs(cfg.out, export_format, [f"fp8-{r}" for r in cfg.recipes]):
        print(f"wrote the {export_format} serving checkpoint {path}")
