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
    process group of the sharded mesh dimension, or a tuple of them when several mesh dims split the
    parameter (for decisions all shards must share).
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


def _sharded_dim(pl: Any) -> int | None:
    """The tensor dim a placement shards (``Shard`` or FSDP2-over-TP's ``_StridedShard``), else None."""
    if pl.is_replicate():
        return None
    dim = getattr(pl, "dim", None)
    if isinstance(dim, int) and (pl.is_shard() or type(pl).__name__ == "_StridedShard"):
        return dim
    return -1  # Partial and others: not a parameter layout


def shard_info(p: torch.Tensor, name: str = "parameter") -> ShardInfo:
    """Layout of ``p``'s state; ``TypeError`` for DTensor placements other than ``Shard``/``Replicate``.

    FSDP2's ``Shard(0)`` (and HSDP's ``(Replicate(), Shard(0))``), tensor parallelism's ``Shard(d)`` and FSDP2
    x TP's 2-D layouts: the state of a parameter split over several mesh dims covers this rank's block,
    padded to ``prod(ceil(size_d / ranks splitting d))`` elements, and is laid out ``Shard(0)`` on each of
    those mesh dims (``shards``: their product; ``coord``: this rank's index among them, row-major)."""
    cls = dtensor_class()
    if cls is None or not isinstance(p, cls):
        return ShardInfo(numel=p.numel(), padded=p.numel())
    placements = tuple(p.placements)
    dims = [_sharded_dim(pl) for pl in placements]
    if any(d is not None and (d < 0 or d >= max(p.dim(), 1)) for d in dims):
        raise TypeError(
            f"fp8kit.optim.AdamW: {name} is a DTensor placed {placements}; only Shard and Replicate placements "
            "(FSDP2, tensor parallelism, or both) are supported; use torch.optim.AdamW"
        )
    local = p.to_local()
    mesh = p.device_mesh
    split = [i for i, d in enumerate(dims) if d is not None]
    if not split:
        return ShardInfo(numel=local.numel(), padded=local.numel())
    ranks_per_dim = [1] * max(p.dim(), 1)
    shards, coord = 1, 0
    for i in split:
        ranks_per_dim[dims[i]] *= mesh.size(i)
        shards *= mesh.size(i)
        coord = coord * mesh.size(i) + mesh.get_local_rank(i)
    padded = math.prod(math.ceil(size / r) for size, r in zip(p.shape, ranks_per_dim, strict=True)) if p.dim() else 1
    from torch.distributed.tensor import Shard

    state_placements = tuple(Shard(0) if d is not None else pl for d, pl in zip(dims, placements, strict=True))
    groups = tuple(mesh.get_group(i) for i in split)
    return ShardInfo(
        numel=local.numel(),
        padded=padded,
        shards=shards,
        coord=coord,
        mesh=mesh,
        placements=state_placements,
        group=groups[0] if len(groups) == 1 else groups,
    )


def wrap_like(local: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """A state tensor: ``local`` itself, or (sharded) a DTensor over ``info.mesh`` with the parameter's
    placements, whose dim 0 stacks the (equal-sized) local parts of all shards."""
    if not info.sharded:
        return local
    return dtensor_class().from_local(local, info.mesh, info.placements, run_check=False)
