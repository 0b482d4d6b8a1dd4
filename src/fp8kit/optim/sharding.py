"""Where a parameter's optimizer state lives: the whole tensor, or this rank's FSDP2 shard.

A parameter sharded by FSDP2 (``fully_shard``) is a ``DTensor`` placed ``Shard(0)`` over a 1-D mesh (or
``(Replicate(), Shard(0))`` over a 2-D HSDP mesh). ``fp8kit.optim.AdamW`` keeps the state of such a
parameter for the local shard only, as ``DTensor``\\ s with the parameter's placements, so that
``torch.distributed.checkpoint`` saves every rank's part:

* Every rank's state covers the *padded* shard, ``ceil(dim0 / shards)`` rows, as FSDP2 pads it: all
  ranks hold the same number of blocks (an even ``Shard(0)`` state tensor), a block never straddles two
  ranks, and the tail blocks of a short (or empty) last shard stay zero and are never updated.
* The state's global shape therefore depends on the number of shards: sharded state resumes on the
  same number of ranks only (``AdamW.state_shards``).

Plain tensors (one process, DDP) and fully replicated ``DTensor``\\ s keep the whole-tensor state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

__all__ = ["ShardInfo", "dtensor_class", "local_tensor", "shard_info", "wrap_like"]


@cache
def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` (``torch.distributed._tensor`` before torch 2.5), or None."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.5
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def _unwrap(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside fp8kit's FSDP2 FP8-gather wrapper (``distributed.fsdp.FP8GatherWeight``)."""
    inner = getattr(t, "_data", None)
    return inner if type(t) is not torch.Tensor and isinstance(inner, torch.Tensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` as a plain tensor sharing its storage (``t`` itself if not a DTensor)."""
    cls = dtensor_class()
    if cls is not None and isinstance(t, cls):
        t = t.to_local()
    return _unwrap(t)


@dataclass(frozen=True)
class ShardInfo:
    """Layout of one parameter's optimizer state on this rank.

    ``numel``: elements of the local part; ``padded``: elements the state covers (equal on all ranks);
    ``shards``: ranks the parameter is split over (1: not sharded); ``coord``: this rank's shard index;
    ``mesh``/``placements``: the DTensor layout the state takes (None when not sharded); ``group``: the
    process group of the sharded mesh dimension (for decisions all shards must share).
    """

    numel: int
    padded: int
    shards: int = 1
    coord: int = 0
    mesh: Any = None
    placements: tuple = ()
    group: Any = None

    @property
    def sharded(self) -> bool:
        return self.shards > 1


def shard_info(p: torch.Tensor, name: str = "parameter") -> ShardInfo:
    """Layout of ``p``'s state; ``TypeError`` for DTensor placements other than FSDP2's (``Shard(0)``/``Replicate``)."""
    cls = dtensor_class()
    if cls is None or not isinstance(p, cls):
        return ShardInfo(numel=p.numel(), padded=p.numel())
    placements = tuple(p.placements)
    shard_dims = [i for i, pl in enumerate(placements) if pl.is_shard()]
    ok = all(pl.is_replicate() or pl.is_shard(0) for pl in placements) and len(shard_dims) <= 1
    if not ok:
        raise TypeError(
            f"fp8kit.optim.AdamW: {name} is a DTensor placed {placements}; only FSDP2's Shard(0) (optionally "
            "with Replicate mesh dims) or fully replicated parameters are supported; use torch.optim.AdamW"
        )
    local = p.to_local()
    if not shard_dims:
        return ShardInfo(numel=local.numel(), padded=local.numel())
    dim = shard_dims[0]
    mesh = p.device_mesh
    shards = mesh.size(dim)
    inner = math.prod(p.shape[1:])
    padded = math.ceil(p.shape[0] / shards) * inner if p.dim() > 0 else local.numel()
    return ShardInfo(
        numel=local.numel(),
        padded=padded,
        shards=shards,
        coord=mesh.get_local_rank(dim),
        mesh=mesh,
        placements=placements,
        group=mesh.get_group(dim),
    )


def wrap_like(local: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """A state tensor: ``local`` itself, or (sharded) a DTensor over ``info.mesh`` with the parameter's
    placements, whose dim 0 stacks the (equal-sized) local parts of all shards."""
    if not info.sharded:
        return local
    return dtensor_class().from_local(local, info.mesh, info.placements, run_check=False)
