"""The process-group side of ``fp8kit train`` on several processes: who am I, my shard of the batch, the
model wrapped for data parallelism (DDP or FSDP2), and rank-0-only logging."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .fsdp import shard_model
from .scaling import enable_fp8_distributed

__all__ = [
    "DistContext",
    "MemoryLog",
    "check_parallel_settings",
    "context_from_env",
    "current_context",
    "in_torchrun",
    "planned_world_size",
    "shard_model",
]


def in_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (``torch.distributed.run``) with a world size > 1."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


@dataclass
class DistContext:
    """Rank, world size and parallelism of this process (``world == 1``: a plain single-process run)."""

    rank: int = 0
    world: int = 1
    fsdp: bool = False
    tp: int = 1  # tensor-parallel ranks per group (``mesh.py``: the innermost mesh dim)
    ep: int = 1  # expert-parallel ranks
    mesh: Any = None  # the DeviceMesh when tp or ep > 1 (``mesh.build_mesh``)
    sp: bool = False  # sequence parallelism over the tp ranks (``mesh.llama_tp_plan``)
    device: torch.device = torch.device("cpu")  # where this rank computes (NCCL collectives need its GPU)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensor shards (FSDP2, tensor or expert parallelism): memory is counted per rank."""
        return self.fsdp or self.tp > 1 or self.ep > 1

    def describe_mesh(self) -> dict[str, Any]:
        """The run's mesh for its summary: ``{"shape": [...], "dim_names": [...], "fsdp": bool,
        "sequence_parallel": bool}``."""
        from .mesh import MeshShape

        return MeshShape(self.world, self.tp, self.ep, self.fsdp, self.sp).describe()

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of a global batch (the batch size is a multiple of the data-parallel ranks; the
        ``tp`` ranks of a tensor-parallel group, consecutive ranks, read the same rows)."""
        if not self.active:
            return x, y
        data_world, data_rank = self.world // self.tp, self.rank // self.tp
        per = x.shape[0] // data_world
        return x[data_rank * per : (data_rank + 1) * per], y[data_rank * per : (data_rank + 1) * per]

    @torch.no_grad()
    def reduce_expert_parallel_grads(self, model: nn.Module) -> None:
        """With ``ep`` > 1 and no FSDP2 (whose reduce-scatters do it), after the step's last backward, the
        gradients of the global batch's mean loss. The ``dp x ep`` ranks read different tokens, so every parameter they all
        hold (embeddings, attention, router, norms; TP shards included) gets the mean of their gradients
        (one flat all-reduce over the ``dp x ep`` ranks of this rank's TP coordinate: the EP group with one
        ``dp`` row, the world without TP). An expert parameter (a ``DTensor`` on ``mesh["ep"]``,
        ``expert_parallel``), whose gradient already sums the tokens of every EP rank of its ``dp`` row, is
        summed over its ``dp`` group (the ranks holding the same experts) and divided by ``dp x ep``."""
        if self.mesh is None or self.ep == 1 or self.fsdp:  # FSDP2 x EP: its reduce-scatters (fsdp.shard_model)
            return
        from .fsdp import _shard

        dp = self.world // (self.ep * self.tp)
        if dp > 1 and self.tp > 1:
            raise ValueError(f"--ep {self.ep} --tp {self.tp} runs on one dp row: use --nproc {self.ep * self.tp}")
        shared_group = self.mesh["ep"].get_group() if dp == 1 else None  # dp > 1: tp == 1, the world
        shared, experts = [], []
        for p in model.parameters():
            if p.grad is None:
                continue
            mesh = getattr(p, "device_mesh", None)
            (experts if mesh is not None and "ep" in (mesh.mesh_dim_names or ()) else shared).append(_shard(p.grad))
        _mean_flat(experts, self.mesh["dp"].get_group() if dp > 1 else None, dp * self.ep, dp > 1)
        _mean_flat(shared, shared_group, dp * self.ep, True)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_``, or for parameters on a 2-D mesh ``mesh.clip_grad_norm_``."""
        if self.mesh is not None:
            from .mesh import clip_grad_norm_

            return clip_grad_norm_(model.parameters(), max_norm)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def mean(self, value: float) -> float:
        """Mean of a float over the ranks (the global mean loss when shards are equal in size)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    def wrap(self, model: nn.Module) -> nn.Module:
        """Synchronize FP8 scaling and wrap for data parallelism. Returns the module to call in training
        steps (the DDP wrapper, or ``model`` itself, sharded in place by FSDP2)."""
        if not self.active:
            return model
        if self.mesh is not None:  # tensor / expert parallelism (and FSDP2 over "dp"): mesh.py
            from .mesh import parallelize_model

            return parallelize_model(model, self.mesh, fsdp=self.fsdp, sequence_parallel=self.sp)
        enable_fp8_distributed(model)
        if self.fsdp:
            return shard_model(model, fp8_all_gather=True)
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the scaling buffers are kept equal by the sync: broadcasting rank 0's would drop the other ranks'
        # pending amaxes (torch >= 2.13 names the option forward_sync_buffers)
        params = inspect.signature(DDP).parameters
        kw = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        return DDP(model, **kw)

    @contextlib.contextmanager
    def grad_sync(self, model: nn.Module, sync: bool) -> Iterator[None]:
        """Context of one micro-batch's forward and backward under gradient accumulation: ``sync=False``
        (every micro-batch but the last) skips the gradient reduction, so a step reduces gradients once,
        not once per micro-batch. DDP: ``model.no_sync()``; FSDP2: ``set_requires_gradient_sync(sync)``
        (the unsharded gradients accumulate locally until the last micro-batch reduce-scatters them).
        FP8 scaling is unaffected: its amax sync is a separate collective (``sync_scaling``)."""
        if not self.active:
            yield
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)
            model.set_requires_gradient_sync(sync)
            try:
                yield
            finally:
                if not sync:
                    model.set_requires_gradient_sync(True)
        elif not sync and hasattr(model, "no_sync"):  # DDP
            with model.no_sync():
                yield
        else:
            yield

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def _mean_flat(grads: list[torch.Tensor], group: Any, count: int, reduce: bool) -> None:
    """``grads`` summed over ``group`` (one flat float32 all-reduce; none without ``reduce``), divided by
    ``count``, in place."""
    if not grads:
        return
    if not reduce:
        for g in grads:
            g.div_(count)
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(count)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


_CURRENT: list[DistContext] = []


def context_from_env(
    fsdp: bool = False, tp: int = 1, ep: int = 1, sp: bool = False, device: torch.device | str = "cpu"
) -> DistContext:
    """The context of this process; under ``torchrun`` joins the process group (gloo on the CPU, NCCL when
    ``device`` is this rank's GPU) and, with ``tp`` or ``ep`` > 1, builds the run's ``DeviceMesh``
    (``mesh.py``); ``sp``: sequence parallelism over the ``tp`` ranks. The context becomes
    ``current_context()``."""
    device = torch.device(device)
    if not in_torchrun():
        ctx = DistContext(device=device)
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        ctx = DistContext(dist.get_rank(), dist.get_world_size(), fsdp, tp, ep, sp=sp and tp > 1, device=device)
        if tp * ep > 1:
            from .mesh import build_mesh, check_mesh

            ctx.mesh = build_mesh(check_mesh(ctx.world, tp, ep, fsdp), device.type)
    _CURRENT[:] = [ctx]
    return ctx


def current_context() -> DistContext:
    """The context set by the last ``context_from_env`` (a single-process one if none was)."""
    return _CURRENT[0] if _CURRENT else DistContext()


def planned_world_size(nproc: int) -> int:
    """Processes the run will have: torchrun's ``WORLD_SIZE`` inside a worker, else ``nproc``."""
    return int(os.environ["WORLD_SIZE"]) if in_torchrun() else nproc


def check_parallel_settings(
    batch_size: int, world: int, fsdp: bool, optimizer: str = "adamw", tp: int = 1, ep: int = 1
) -> None:
    """One-line ``ValueError`` for settings a run on ``world`` processes cannot take (every ``optimizer``
    works with DDP and FSDP2: ``fp8kit.optim.AdamW`` keeps sharded state for FSDP2's DTensor parameters);
    with ``tp`` or ``ep`` > 1 the mesh's factorisation (``mesh.check_mesh``)."""
    if tp * ep > 1:
        from .mesh import check_mesh

        check_mesh(world, tp, ep, fsdp, batch_size)
        return
    if fsdp and world < 2:
        raise ValueError("--fsdp shards the model over several processes: add --nproc N with N >= 2")
    if world > batch_size:
        raise ValueError(
            f"--nproc {world} is larger than the global --batch-size {batch_size}: every process needs at least "
            f"one sequence; use --nproc <= {batch_size} or a larger --batch-size"
        )
    if batch_size % world:
        raise ValueError(
            f"--batch-size {batch_size} (the global batch) does not split evenly over --nproc {world}: "
            f"give a multiple of {world}"
        )


class MemoryLog:
    """The metrics log of a rank other than 0: same interface as ``MetricsLog``, kept in memory (only rank 0
    writes files), starting from rank 0's file so that every rank takes the same decisions from it."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if resume and path.exists():  # a fresh run: rank 0 deletes the old file, read nothing from it
            self.records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]

    def keep_until(self, run: str, step: int) -> None:
        self.records = [r for r in self.records if r.get("run") != run or r.get("step", 0) <= step]

    def write(self, rec: dict[str, Any]) -> None:
        self.records.append(json.loads(json.dumps(rec)))

    def read(self) -> list[dict[str, Any]]:
        return list(self.records)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly ``DTensor``, possibly FP8-gather-wrapped) tensor, as a plain tensor."""
    from .fsdp import _shard

    return _shard(t)


def sharded_memory_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> dict[str, int]:
    """``train.loop.memory_bytes`` for an FSDP2 model, per rank: the categories count this rank's shards
    (``nn.memory.persistent_bytes`` reads parameter storages, which a sharded ``DTensor`` does not expose)."""
    from ..nn import saved_activation_bytes
    from ..nn.memory import PERSISTENT_KEYS

    params = [_local(p) for p in model.parameters()]
    mem = dict.fromkeys(PERSISTENT_KEYS, 0)
    mem["weights"] = sum(p.numel() * p.element_size() for p in params)
    mem["grads"] = mem["weights"]
    for state in optimizer.state.values():
        for val in state.values():
            if isinstance(val, torch.Tensor):
                v = _local(val)
                mem["optimizer_state"] += v.numel() * v.element_size()
    logits = model(input_ids=x).logits
    mem["activations"] = saved_activation_bytes(logits, exclude=params)
    mem["total"] = sum(mem.values())
    return mem
