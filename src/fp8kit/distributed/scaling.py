"""Synchronized FP8 scaling over a data-parallel group: every rank holds identical scaling state.

Per-tensor scales whose amax spans data the ranks see differently (the input and gradient amaxes) are
reduced with MAX over the group:

* **Delayed scaling**: every layer defers its history update (``layer.defer_scaling_update = True``) and
  keeps the step's amaxes in ``fp8_amax_pending``. ``sync_scaling`` concatenates the pending amaxes of
  *all* layers (MoE experts modules included: their input, gradient and per-expert weight amaxes) into
  one flat tensor, runs **one** ``all_reduce(MAX)`` for the whole model
  (Transformer Engine's design), writes the result back and folds it into the histories. A layer that
  did not run on a rank has pending ``-1`` there, so the max over ranks still folds the same value on
  every rank, and since every rank issues the same single collective whatever ran, there is no hang.
* **Current scaling** (per-tensor): ``layer.amax_reduce`` MAX-reduces the input and gradient amax before
  the scale is computed: one collective per operand per layer, inherent to just-in-time scaling.
* **Row-wise, 128x128 block and MX recipes need no reduction**: each scale covers one row or tile of an
  operand, and a rank holds its rows (tokens) and the whole weight entirely; no scale spans data that
  another rank holds. Per-tensor *weight* scales need none either: weights are identical on all ranks
  (DDP), or gathered whole before use (FSDP2).

When the sync runs: ``enable_fp8_distributed`` registers a forward pre-hook on the model, so at the start
of each training forward the pending amaxes of the previous step (its forward *and* backward) are
reduced and folded. The hook runs outside any ``torch.compile`` region (``torch.compiler.disable``), so
compiled models keep a single graph for the layers. Evaluation forwards (``model.eval()``) do not sync
and record nothing. With gradient accumulation the hook runs once per micro-batch forward. Call
``sync_scaling(model)`` yourself before saving a checkpoint (``fp8kit train`` does) so that the pending
amaxes of all ranks are in the saved state.

Delayed scaling's very first step (``fp8_seen == 0``) quantizes each operand with its own current amax:
under DDP that scale is per-rank for that one step; the amaxes it records are reduced as usual, so the
state is identical on all ranks from the first sync on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..numerics.recipes import DelayedScaling

__all__ = [
    "AmaxAllReduce",
    "collective_counts",
    "delayed_layers",
    "enable_fp8_distributed",
    "fp8_layers",
    "record_pending_amax",
    "reset_collective_counts",
    "scaling_state",
    "sync_scaling",
]

# Collectives issued by this module, by kind (eager calls; a compiled graph counts once, when traced).
_COUNTS: Counter[str] = Counter()


def collective_counts() -> dict[str, int]:
    """Collectives issued by fp8kit's scaling sync since the last reset: ``{"scaling_sync": n, "amax": m}``."""
    return dict(_COUNTS)


def reset_collective_counts() -> None:
    _COUNTS.clear()


def _compiler_disable(fn: Callable) -> Callable:
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def fp8_layers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that hold FP8 scaling state (``fp8kit.nn.Linear`` and subclasses), in order."""
    return [m for m in model.modules() if hasattr(m, "fold_amax_pending") and hasattr(m, "recipe")]


def delayed_layers(model: nn.Module) -> list[nn.Module]:
    """The FP8 layers whose own recipe is delayed scaling (they hold ``fp8_amax_pending``)."""
    return [
        m
        for m in fp8_layers(model)
        if isinstance(m.recipe, DelayedScaling) and isinstance(getattr(m, "fp8_amax_pending", None), torch.Tensor)
    ]


@torch.no_grad()
def record_pending_amax(layer: nn.Module, role: int, amax: torch.Tensor) -> None:
    """Fold ``amax`` (float32 scalar) into a delayed layer's pending amax of operand ``role`` (0 input, 1 weight,
    2 grad) by MAX; a non-finite amax is dropped, as the layer itself does. The next sync reduces it."""
    layer.fp8_state.record(role, amax, fold=False)


class AmaxAllReduce:
    """``amax -> MAX of amax over the group``: the ``amax_reduce`` of per-tensor current-scaling layers.

    Eager: ``torch.distributed.all_reduce`` on a copy. Under ``torch.compile``: the functional collective
    (traceable), so the reduction is part of the graph.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def __call__(self, amax: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            from torch.distributed import _functional_collectives as funcol

            group = self.group if self.group is not None else dist.group.WORLD
            return funcol.all_reduce(amax, "max", group)
        out = amax.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        _COUNTS["amax"] += 1
        return out

    def __deepcopy__(self, memo: dict) -> AmaxAllReduce:  # process groups cannot be copied; share the handle
        return self


@torch.no_grad()
def sync_scaling(model: nn.Module, group: Any = None) -> int:
    """Reduce the pending amaxes of all delayed-scaling layers with one MAX all-reduce and fold them.

    Every rank must call it at the same point (it is a collective). Returns the number of layers synced
    (0: no delayed layer, and no collective is issued, on every rank alike since the model is the same).
    The layers' cached FP8 weights are dropped (their weight scale may have moved), so every rank and
    every micro-batch quantizes the weight with the current scale.
    """
    layers = delayed_layers(model)
    if not layers:
        return 0
    # one flat float32 vector, -1 = nothing recorded: (3,) per Linear, (2, 2 + E) per experts module
    pending = torch.cat([m.fp8_amax_pending.flatten() for m in layers])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=group)
        _COUNTS["scaling_sync"] += 1
    rows = pending.split([m.fp8_amax_pending.numel() for m in layers])
    for m, row in zip(layers, rows, strict=True):
        m.fp8_amax_pending.copy_(row.view_as(m.fp8_amax_pending))
        m.fold_amax_pending()
        if hasattr(m, "release_fp8_weights"):  # the weight scale may have moved: no FP8 copy made with the old one
            m.release_fp8_weights()
    return len(layers)


def enable_fp8_distributed(model: nn.Module, group: Any = None, *, sync_on_forward: bool = True) -> nn.Module:
    """Make the FP8 layers of ``model`` keep identical scaling state on all ranks of ``group``.

    Call after ``torch.distributed.init_process_group`` and after ``fp8kit.convert``. Delayed-scaling
    layers defer their history update to ``sync_scaling`` (one all-reduce per step for the whole model);
    per-tensor current-scaling layers reduce their input and gradient amax as they quantize. With
    ``sync_on_forward`` (default) a forward pre-hook on ``model`` runs ``sync_scaling`` before every
    training-mode forward; without it, call ``sync_scaling(model)`` once per step yourself, on every rank.

    Under DDP, pass ``broadcast_buffers=False`` to ``DistributedDataParallel`` (the scaling buffers are
    kept equal by the sync; broadcasting rank 0's pending amaxes would drop the other ranks'), or call
    this on the DDP wrapper itself so the sync runs before DDP's buffer broadcast. Returns ``model``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fp8kit.distributed: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() (or launch with torchrun) first"
        )
    reducer = AmaxAllReduce(group)
    for m in fp8_layers(model):
        if isinstance(m.recipe, DelayedScaling):
            m.defer_scaling_update = True
        elif m.recipe.per_tensor:
            m.amax_reduce = reducer
    old = getattr(model, "_fp8kit_sync_hook", None)
    if old is not None:
        old.remove()
        model._fp8kit_sync_hook = None
    if sync_on_forward:

        @_compiler_disable
        def _sync_before_forward(module: nn.Module, args: Any) -> None:
            if module.training:
                sync_scaling(module, group)

        model._fp8kit_sync_hook = model.register_forward_pre_hook(_sync_before_forward)
    return model


def scaling_state(model: nn.Module) -> torch.Tensor:
    """All delayed-scaling state of ``model`` flattened into one float64 tensor (histories, scales, counts,
    pending): equal on all ranks after a sync; for tests and checks."""
    parts = []
    for m in delayed_layers(model):
        parts += [m.fp8_amax_history.flatten(), m.fp8_scale, m.fp8_seen, m.fp8_amax_pending]
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([p.detach().double().cpu().flatten() for p in parts])
