"""Crash-safe checkpoints: safetensors only (no pickle), written to a temporary folder and renamed.

Layout of a run's checkpoint folder::

    ckpt/<run>/latest            text: name of the newest complete checkpoint
    ckpt/<run>/step-000200/      model.safetensors (weights + FP8 scaling state as plain tensors),
                                 optimizer.safetensors (tensors; param groups as JSON metadata)

A run on several processes (``fp8kit train --nproc N``) writes, instead of ``optimizer.safetensors``, a
``dcp/`` folder through ``torch.distributed.checkpoint`` (DCP): model, FP8 scaling state and optimizer,
each rank writing its shards. DCP checkpoints load on any number of ranks and any mesh shape (resharding:
saved on a 2x2 ``dp x tp`` mesh, loaded on 4x1 or 1x4), and in one process; ``model.safetensors`` (the
full model, written by rank 0) stays the single-file export. The exception is ``fp8kit.optim.AdamW``'s
sharded FP8 state (blocks of each rank's padded shard): it loads on the mesh shape that saved it only
(the checkpoint records it as ``optimizer_mesh``).

A checkpoint becomes visible only by ``os.replace`` of a complete folder, then of ``latest``; a process
killed at any point leaves the previous checkpoint intact and loadable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..numerics.state_dict import tied_aliases

FORMAT = "fp8kit-checkpoint-v1"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupted, or from another run or recipe."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_synced(path: Path, write) -> None:
    write(str(path))
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _optimizer_tensors(opt_state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for pid, state in opt_state["state"].items():
        for key, val in state.items():
            if isinstance(val, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = val.detach().contiguous().cpu()
            else:
                scalars[f"{pid}.{key}"] = val
    meta = {"param_groups": json.dumps(opt_state["param_groups"]), "scalars": json.dumps(scalars)}
    return tensors, meta


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, val in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = val
    for name, val in json.loads(meta["scalars"]).items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = val
    return {"state": state, "param_groups": json.loads(meta["param_groups"])}


def save_checkpoint(
    folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int, info: dict[str, Any]
) -> Path:
    """Write ``model`` (+ optimizer) at ``step`` atomically into ``folder``; returns the checkpoint path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = folder / f".tmp-{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    meta = _write_model_file(tmp / "model.safetensors", model.state_dict(), step, info)
    if optimizer is not None:
        tensors, ometa = _optimizer_tensors(optimizer.state_dict())
        _write_file_synced(tmp / "optimizer.safetensors", lambda p: save_file(tensors, p, metadata={**meta, **ometa}))
    _publish(folder, tmp, name)
    return folder / name


def _write_model_file(path: Path, state: dict[str, torch.Tensor], step: int, info: dict[str, Any]) -> dict[str, str]:
    """``model.safetensors``: the state dict (tied aliases stored once) with fp8kit's metadata."""
    tied = tied_aliases(state)
    weights = {k: v.detach().contiguous().cpu() for k, v in state.items() if k not in tied}
    meta = {"format": FORMAT, "step": str(step), "info": json.dumps(info, sort_keys=True), "tied": json.dumps(tied)}
    _write_file_synced(path, lambda p: save_file(weights, p, metadata=meta))
    return meta


def _publish(folder: Path, tmp: Path, name: str) -> None:
    """Make the complete folder ``tmp`` the checkpoint ``name`` and point ``latest`` at it (atomically)."""
    _fsync_dir(tmp)
    final = folder / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = folder / f".latest-{os.getpid()}"
    latest_tmp.write_text(name)
    with open(latest_tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(latest_tmp, folder / "latest")
    _fsync_dir(folder)
    for old in folder.glob("step-*"):  # keep only the newest complete checkpoint
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(folder: str | Path) -> Path | None:
    folder = Path(folder)
    pointer = folder / "latest"
    if not pointer.is_file():
        return None
    path = folder / pointer.read_text().strip()
    return path if path.is_dir() else None


def read_info(path: str | Path) -> dict[str, Any]:
    """The ``info`` of a checkpoint folder, validating its format (``CheckpointError`` if not fp8kit's)."""
    from safetensors import safe_open

    model_file = Path(path) / "model.safetensors"
    if not model_file.is_file():
        raise CheckpointError(f"no fp8kit checkpoint at {path} (model.safetensors missing)")
    try:
        with safe_open(str(model_file), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"corrupted checkpoint {model_file}: {err}") from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{model_file} is not an fp8kit checkpoint (format {meta.get('format')!r})")
    return json.loads(meta.get("info", "{}"))


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, expect: dict | None = None
) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint folder into ``model`` (and ``optimizer``); returns ``(step, info)``.

    ``expect`` lists info entries that must match (e.g. the run name and recipe); any mismatch, a
    missing or corrupted file raises ``CheckpointError`` naming the problem.
    """
    path = Path(path)
    info = read_info(path)
    model_file = path / "model.safetensors"
    try:
        weights = load_file(str(model_file))
        from safetensors import safe_open

        with safe_open(str(model_file), framework="pt") as f:
            meta = f.metadata() or {}
        step = int(meta["step"])
        for alias, key in json.loads(meta.get("tied", "{}")).items():
            weights[alias] = weights[key]
    except (SafetensorError, OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"corrupted checkpoint {model_file}: {err}") from err
    for key, want in (expect or {}).items():
        if info.get(key) != want:
            raise CheckpointError(f"checkpoint {path} is for {key}={info.get(key)!r}, not {want!r}")
    try:
        model.load_state_dict(weights)
    except (RuntimeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} does not fit this model: {str(err).splitlines()[0]}") from err
    if optimizer is not None:
        opt_file = path / "optimizer.safetensors"
        try:
            tensors = load_file(str(opt_file))
            from safetensors import safe_open

            with safe_open(str(opt_file), framework="pt") as f:
                ometa = f.metadata() or {}
            optimizer.load_state_dict(_optimizer_state(tensors, ometa))
        except (SafetensorError, OSError, ValueError, KeyError) as err:
            raise CheckpointError(f"corrupted optimizer state in {path}: {err}") from err
    return step, info


def is_distributed_checkpoint(path: str | Path) -> bool:
    """Whether a checkpoint folder holds DCP shards (written by a run on several processes)."""
    return (Path(path) / "dcp" / ".metadata").is_file()


def _dist_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_distributed_checkpoint(
    folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int, info: dict[str, Any]
) -> Path:
    """Collective: every rank calls it. Writes model + FP8 scaling state + optimizer through DCP into
    ``folder/step-NNNNNN/dcp`` (each rank its shards) and the full model as ``model.safetensors`` (rank 0),
    in a temporary folder that rank 0 renames once every rank is done. Works for DDP and FSDP2 models.

    The scaling state is synchronized first (``fp8kit.distributed.sync_scaling``), so the saved pending
    amaxes are the MAX over all ranks and a resumed run continues bit-exactly.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    from ..distributed.scaling import sync_scaling

    folder = Path(folder)
    rank, world = _dist_world()
    name = f"step-{step:06d}"
    tmp = folder / f".tmp-{name}"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    sync_scaling(model)
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=str(tmp / "dcp"))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    extra: dict[str, Any] = {"world_size": world, "dcp": True}
    mesh = _mesh_layout(model)
    if mesh is not None:
        extra["mesh"] = mesh
    shards = optimizer.state_shards() if hasattr(optimizer, "state_shards") else 1
    if shards > 1:  # fp8kit.optim.AdamW under FSDP2 / TP: per-rank FP8 blocks, no resharding
        extra["optimizer_shards"] = shards
        extra["optimizer_mesh"] = mesh
    if rank == 0:
        _write_model_file(tmp / "model.safetensors", full, step, {**info, **extra})
    _barrier()
    if rank == 0:
        _publish(folder, tmp, name)
    _barrier()
    return folder / name


def load_distributed_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, expect: dict | None = None
) -> tuple[int, dict[str, Any]]:
    """Load a DCP checkpoint folder into ``model`` (and ``optimizer``) on any number of ranks (resharding),
    or in a single process; returns ``(step, info)``. Collective when ``torch.distributed`` is initialized."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    path = Path(path)
    info = read_info(path)
    for key, want in (expect or {}).items():
        if info.get(key) != want:
            raise CheckpointError(f"checkpoint {path} is for {key}={info.get(key)!r}, not {want!r}")
    if not is_distributed_checkpoint(path):
        raise CheckpointError(f"checkpoint {path} has no DCP shards (dcp/.metadata missing)")
    if optimizer is not None:
        check_optimizer_shards(path, info, _dist_world()[1], _mesh_layout(model))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    except Exception as err:  # DCP raises CheckpointException (and others) with per-rank tracebacks
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"checkpoint {path} does not fit this model: {first}") from err
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        set_model_state_dict(model, state["model"])
    return _read_step(path), info


def _read_step(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return int((f.metadata() or {})["step"])


def save_run_checkpoint(
    folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, step: int, info: dict[str, Any]
) -> Path:
    """``save_distributed_checkpoint`` on several processes (collective), ``save_checkpoint`` in one."""
    if _dist_world()[1] > 1:
        return save_distributed_checkpoint(folder, model, optimizer, step, info)
    return save_checkpoint(folder, model, optimizer, step, info)


def load_run_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, expect: dict | None = None
) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint of ``fp8kit train`` written on any number of processes: DCP shards load on any
    world size (and in one process); a single-process checkpoint only in a single process."""
    if is_distributed_checkpoint(path):
        return load_distributed_checkpoint(path, model, optimizer, expect)
    check_world_size(path, read_info(path), _dist_world()[1])
    return load_checkpoint(path, model, optimizer, expect)


def _mesh_layout(model: torch.nn.Module) -> dict[str, list] | None:
    """The largest mesh ``model``'s parameters are laid out on, as ``mesh.mesh_layout`` (None: no DTensor)."""
    from ..distributed.mesh import mesh_layout, mesh_of

    mesh = mesh_of(model)
    return None if mesh is None else mesh_layout(mesh)


def _layout_text(layout: dict[str, list]) -> str:
    return "x".join(map(str, layout["shape"])) + f" ({' x '.join(layout['dim_names'])}) mesh"


def check_optimizer_shards(
    path: str | Path, info: dict[str, Any], world: int, mesh: dict[str, list] | None = None
) -> None:
    """Refuse to load the optimizer state of a checkpoint whose ``fp8kit.optim.AdamW`` state is sharded
    (FSDP2, TP, EP) over another number of ranks than ``world``, or another mesh layout than ``mesh``
    (``mesh.mesh_layout``, when known): its per-rank FP8 blocks are not resharded."""
    shards = info.get("optimizer_shards", 1)
    saved = info.get("optimizer_mesh")
    if shards > 1 and (world != shards or (mesh is not None and saved is not None and mesh != saved)):
        plain = saved is None or saved["dim_names"] == ["dp"]  # 1-D FSDP2: the plain --fsdp fix
        target = f"{world} ranks" + (f" ({_layout_text(mesh)})" if mesh else "")
        fix = f"--nproc {shards} --fsdp" if plain else f"--nproc {shards} on the same {_layout_text(saved)}"
        raise CheckpointError(
            f"--resume: checkpoint {path} holds fp8kit.optim.AdamW state sharded over {shards} ranks "
            f"({'FSDP2' if plain else _layout_text(saved)}), which cannot be resharded to {target}; resume it with "
            f"{fix}, or use --optimizer adamw, whose state reshards"
        )


def check_world_size(path: str | Path, info: dict[str, Any], world: int, mesh: dict[str, list] | None = None) -> None:
    """Refuse to resume a single-process checkpoint (no DCP shards) on ``world > 1`` processes, or
    sharded FP8 optimizer state on another number of ranks or mesh shape (``check_optimizer_shards``)."""
    check_optimizer_shards(path, info, world, mesh)
    if world > 1 and not is_distributed_checkpoint(path):
        written = info.get("world_size", 1)
        raise CheckpointError(
            f"--resume: checkpoint {path} was written by {written} process(es) without DCP shards and cannot be "
            f"resharded to {world}; resume it with --nproc {written}"
        )
