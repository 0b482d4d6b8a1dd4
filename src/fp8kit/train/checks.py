"""Every check of a ``TrainConfig`` that needs neither model nor data, so that a bad setting ends the run
before anything is built, launched or written: a one-line ``ValueError`` (``CheckpointError`` for
``--resume``) that names the fix. ``run_comparison`` calls ``check_config`` first; ``fp8kit train`` before it
launches ``--nproc`` processes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..distributed.runtime import check_parallel_settings, planned_world_size
from ..models import ARCHS
from ..numerics.recipes import RECIPE_NAMES, TRAINING_RECIPE_NAMES, recipe_from_name
from .checkpoint import CheckpointError, latest_checkpoint

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = [
    "AUTO",
    "MASTER_WEIGHTS",
    "OPTIMIZERS",
    "check_config",
    "check_device",
    "check_model_parallel",
    "check_resumable",
    "fixed_recipes",
    "parse_recipes",
    "run_names",
]

AUTO = "auto"  # ``--recipe auto``: a recipe per layer, planned by ``fp8kit.autotune`` (``train/auto_plan.py``)
OPTIMIZERS = ("adamw", "fp8-adamw")
MASTER_WEIGHTS = ("fp32", "bf16")


def parse_recipes(spec: str) -> list[str]:
    """``"all"`` or comma-separated recipe names (or ``auto``) -> validated list (bf16 is always the baseline)."""
    names = list(RECIPE_NAMES) if spec.strip().lower() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"no recipe given; accepted: {', '.join(TRAINING_RECIPE_NAMES)}, {AUTO} or all")
    return [AUTO if n.lower() == AUTO else recipe_from_name(n).kind for n in names]


def fixed_recipes(recipes: list[str]) -> list[str]:
    """The recipes of a run list that name one recipe for the whole model (all but ``auto``)."""
    return [r for r in recipes if r != AUTO]


def run_names(cfg: TrainConfig) -> list[str]:
    """The runs of a comparison: ``bf16`` (the baseline), then ``fp8-<recipe>`` for each recipe."""
    return ["bf16"] + [f"fp8-{r}" for r in parse_recipes(",".join(cfg.recipes))]


def check_config(cfg: TrainConfig) -> None:
    """Every check of ``cfg`` that needs neither model nor data, so that a bad setting ends the run before
    anything is built, launched or written: a one-line ``ValueError`` (``CheckpointError`` for ``--resume``)
    that names the fix. ``run_comparison`` calls it first; ``fp8kit train`` before it launches ``--nproc``."""
    run_names(cfg)  # the recipes
    check_device(cfg)
    for key in ("steps", "batch_size", "seq_len", "grad_accum", "eval_batches", "eval_interval", "ckpt_interval"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be >= 1, got {getattr(cfg, key)}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if cfg.arch not in ARCHS:
        raise ValueError(f"--arch must be one of {', '.join(ARCHS)}, got {cfg.arch!r}")
    if cfg.arch != "dense" and cfg.model != "demo":
        raise ValueError(f"--arch {cfg.arch} builds the demo model: leave out --model {cfg.model}")
    if cfg.optimizer not in OPTIMIZERS or cfg.master_weights not in MASTER_WEIGHTS:
        raise ValueError(
            f"--optimizer must be one of {', '.join(OPTIMIZERS)} and --master-weights one of "
            f"{', '.join(MASTER_WEIGHTS)}; got {cfg.optimizer!r}, {cfg.master_weights!r}"
        )
    if cfg.master_weights == "bf16" and cfg.optimizer != "fp8-adamw":
        raise ValueError("--master-weights bf16 needs --optimizer fp8-adamw (torch AdamW rounds BF16 updates away)")
    if AUTO in cfg.recipes:
        check_auto(cfg)
    check_parallel_settings(cfg.batch_size, planned_world_size(cfg.nproc), cfg.fsdp, cfg.optimizer, cfg.tp, cfg.ep)
    check_model_parallel(cfg)
    if cfg.resume:
        check_resumable(Path(cfg.out), run_names(cfg), cfg)


def check_auto(cfg: TrainConfig) -> None:
    """``--recipe auto``: one process, a budget >= 0 and a known ``--target``."""
    from ..planner.roofline import TARGETS

    if planned_world_size(cfg.nproc) > 1:
        raise ValueError("--recipe auto plans and trains on one process: drop --nproc (or give fixed recipes)")
    if not cfg.loss_budget >= 0:
        raise ValueError(f"--loss-budget is a relative loss increase >= 0 (0.01 = 1%), got {cfg.loss_budget}")
    if cfg.target not in TARGETS:
        raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {cfg.target!r}")


def check_device(cfg: TrainConfig) -> None:
    """``--device`` against this machine and the recipes (``fp8kit.runtime.device.resolve_device``); ``--nproc N``
    on CUDA needs N GPUs (one process per GPU)."""
    import torch

    from ..runtime.device import DeviceError, resolve_device

    device = resolve_device(cfg.device, recipe=fixed_recipes(cfg.recipes), emulate=cfg.emulate)
    world = planned_world_size(cfg.nproc)
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise DeviceError(
            f"--nproc {world} on CUDA runs one process per GPU and this machine has {torch.cuda.device_count()}: "
            f"give --nproc {torch.cuda.device_count()} or less, or --device cpu"
        )


def check_model_parallel(cfg: TrainConfig) -> None:
    """``--tp`` / ``--ep`` / ``--sp`` against the model, without building it: the demo sizes split evenly over
    ``--tp`` (heads, MLP width, every recipe's scaling tiles), ``--ep`` needs the MoE demo with experts that
    split evenly, and fp8kit's expert parallelism; ``--sp`` needs ``--tp``, a dense model and a ``--seq-len``
    that splits over the ``--tp`` ranks. A pretrained model's sizes are checked when it is laid out."""
    if cfg.arch == "gpt_oss" and (cfg.tp > 1 or cfg.ep > 1):
        raise ValueError("--arch gpt_oss runs on one process or data-parallel ranks: drop --tp / --ep")
    if cfg.sp:
        if cfg.tp < 2:
            raise ValueError("--sp splits each sequence over the tensor-parallel ranks: add --tp T (T >= 2)")
        if cfg.seq_len % cfg.tp:
            fit = (cfg.seq_len // cfg.tp + 1) * cfg.tp
            raise ValueError(
                f"--sp: --seq-len {cfg.seq_len} does not split over --tp {cfg.tp} ranks: give a multiple of "
                f"{cfg.tp} (e.g. --seq-len {fit})"
            )
        if cfg.arch != "dense":
            raise ValueError(
                f"--sp with --arch {cfg.arch} (MoE blocks on sequence shards) is not supported yet: drop --sp"
            )
    if cfg.tp > 1 and cfg.model == "demo":
        from ..distributed.mesh import check_tp_model
        from ..models.llama import MODEL_SIZES

        hidden, _, heads, inter = MODEL_SIZES[cfg.model_size]
        check_tp_model(
            cfg.tp, heads, heads, hidden, inter if cfg.arch == "dense" else hidden, fixed_recipes(cfg.recipes)
        )
    if cfg.ep > 1:
        import importlib.util

        from ..models.llama import MOE_EXPERTS

        if cfg.arch != "moe":
            raise ValueError(f"--ep {cfg.ep} places MoE experts across ranks: add --arch moe")
        if MOE_EXPERTS % cfg.ep:
            raise ValueError(f"--ep {cfg.ep} does not divide the {MOE_EXPERTS} experts: choose a --ep that divides it")
        if importlib.util.find_spec("fp8kit.distributed.expert_parallel") is None:
            raise ValueError(
                "--ep: expert parallelism (fp8kit.distributed.expert_parallel) is not in this build of fp8kit; "
                "run without --ep"
            )


def check_resumable(out: Path, names: list[str], cfg: TrainConfig) -> None:
    """Validate every checkpoint of the runs ``names`` in the run folder ``out`` against ``cfg`` before
    anything is written (one-line ``CheckpointError``, no damage)."""
    from .checkpoint import check_world_size, read_info

    if not (out / "config.json").is_file():
        raise CheckpointError(f"--resume: {out} holds no fp8kit training run (config.json missing)")
    from ..distributed.mesh import MeshShape

    world = planned_world_size(cfg.nproc)
    planned = MeshShape(world, cfg.tp, cfg.ep, cfg.fsdp)
    mesh = planned.layout() if cfg.tp * cfg.ep > 1 or cfg.fsdp else None  # the parameters' mesh (DDP: none)
    for run in names:
        path = latest_checkpoint(out / "ckpt" / run)
        if path is None:
            continue
        info = read_info(path)
        check_world_size(path, info, world, mesh)
        want = {"run": run, "model_size": cfg.model_size, "model": cfg.model, "arch": cfg.arch, "seed": cfg.seed}
        for key, val in want.items():
            if info.get(key, {"model": "demo", "arch": "dense"}.get(key)) != val:
                raise CheckpointError(f"--resume: checkpoint {path} is for {key}={info.get(key)!r}, not {val!r}")
