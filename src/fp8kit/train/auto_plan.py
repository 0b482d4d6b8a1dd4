"""``fp8kit train --recipe auto``: the per-layer plan of the ``fp8-auto`` run (``fp8kit.autotune``), made on
the run's first training batches and kept as ``plan.json`` in the run folder (read back on ``--resume``)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..data import Corpus
from ..numerics.recipes import RECIPE_NAMES
from ..planner import Plan, autotune
from ..planner.tune import BF16, DEFAULT_CANDIDATES
from ..runtime.device import native_on
from .config import TrainConfig

__all__ = ["PLAN_BATCHES", "PLAN_FILE", "auto_candidates", "plan_for_run"]

PLAN_FILE = "plan.json"
PLAN_BATCHES = 2  # training batches the plan is made on (the run's first ones)


def auto_candidates(device: torch.device, emulate: bool) -> list[str]:
    """BF16 and every recipe on the CPU (or with ``--emulate``); on a GPU, BF16 and the recipes it runs natively."""
    if device.type != "cuda" or emulate:
        return list(DEFAULT_CANDIDATES)
    capability = torch.cuda.get_device_capability(device)
    return [BF16, *(r for r in RECIPE_NAMES if native_on(r, capability))]


def plan_for_run(
    cfg: TrainConfig, base: torch.nn.Module, corpus: Corpus, out: Path, device: torch.device, write: bool
) -> Plan:
    """The plan of the ``fp8-auto`` run: ``OUT/plan.json`` when resuming, else ``fp8kit.autotune`` of ``base``
    (a copy on ``device``) on the first ``PLAN_BATCHES`` training batches, written there when ``write``."""
    path = out / PLAN_FILE
    if cfg.resume and path.is_file():
        return Plan.from_json(path)
    model = copy.deepcopy(base).to(device)
    batches = []
    for index in range(PLAN_BATCHES):
        x, _ = corpus.batch("train", index, cfg.batch_size, cfg.seq_len, cfg.seed)
        batches.append({"input_ids": x.to(device), "labels": x.to(device)})
    plan = autotune(
        model,
        batches,
        loss_budget=cfg.loss_budget,
        target=cfg.target,
        candidates=auto_candidates(device, cfg.emulate),
    )
    if write:
        plan.to_json(path)
    return plan
