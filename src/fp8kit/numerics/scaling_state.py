"""Delayed-scaling state of one FP8 module, and the rules that read and update it.

``DelayedScalingState`` owns, for every operand slot of its module, the amax history, the scale for the
next quantization, the count of recorded amaxes ("seen") and the amax recorded but not yet folded
("pending"). The tensors are buffers of the module it serves (``fp8_amax_history`` ``(*slots, history_len)``,
``fp8_scale``, ``fp8_seen``, ``fp8_amax_pending`` ``(*slots)``), so ``state_dict``, ``.to()`` and FSDP2 see
them as usual; only this class writes them. The dense ``Linear`` has the slots ``(input, weight, grad)``;
an experts module ``(projection, input | grad | weight of expert e)``.

Rules, each written once:

* scale from an amax: ``Recipe.scale_from_amax`` (pure, ``fmt.max / amax / 2**margin``);
* first step (``scale_for``): a slot never seen is quantized with the scale of its own current amax, a seen
  one with its delayed scale; a ``torch.where``, so no Python flag and no device sync;
* record: a finite amax joins the pending amax by MAX (a non-finite one is dropped);
* fold: pending amaxes roll into the histories, and the scales are recomputed from the max of the window
  (or the newest entry), keeping the previous scale where the reference amax is zero or non-finite.

Checkpoints: the buffers are the module's persistent state; its extra state is the recipe as JSON bytes
(``recipe_extra_state``), checked on load (``check_recipe_extra_state``); a high-precision checkpoint,
without FP8 state, loads into a converted model and keeps its fresh state (``forgive_missing_fp8_state``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from .recipes import DelayedScaling, Recipe

__all__ = [
    "FP8_STATE_BUFFERS",
    "FP8_STATE_KEYS",
    "DelayedScalingState",
    "check_recipe_extra_state",
    "forgive_missing_fp8_state",
    "operand_scale",
    "recipe_extra_state",
]

FP8_STATE_BUFFERS = ("fp8_amax_history", "fp8_scale", "fp8_seen", "fp8_amax_pending")
# state_dict keys (last component) of an FP8 module's scaling state: the buffers and the recipe (extra state)
FP8_STATE_KEYS = (*FP8_STATE_BUFFERS, "_extra_state")


class DelayedScalingState:
    """The delayed-scaling buffers of ``owner`` for the slots ``(*lead, len(roles))`` (see the module doc).

    ``roles`` names the operand of each slot along the last dim (``"input"``, ``"weight"`` or ``"grad"``);
    an index into the state (``int``, ``slice`` or a tuple of them) selects slots as it would the buffers.
    """

    def __init__(self, owner: nn.Module, recipe: DelayedScaling, roles: Sequence[str], lead: tuple[int, ...] = ()):
        self.owner = owner
        self.recipe = recipe
        self.roles = tuple(roles)
        self._grad_slot = self.roles.index("grad")
        # slots whose history was read as recorded, on every rank alike (``has_history(synced=True)``)
        self._synced_seen: set[Any] = set()
        # where the owner lives: its first parameter or buffer (a module holding neither: the CPU)
        dev = next(itertools.chain(owner.parameters(), owner.buffers()), torch.empty(0)).device
        shape = (*lead, len(self.roles))
        for key in FP8_STATE_BUFFERS:
            owner._buffers.pop(key, None)
        owner.register_buffer("fp8_amax_history", torch.zeros(*shape, recipe.amax_history_len, device=dev))
        owner.register_buffer("fp8_scale", torch.ones(shape, device=dev))
        owner.register_buffer("fp8_seen", torch.zeros(shape, dtype=torch.int64, device=dev))
        owner.register_buffer("fp8_amax_pending", torch.full(shape, -1.0, device=dev))

    @staticmethod
    def drop(owner: nn.Module) -> None:
        """Remove delayed-scaling buffers from ``owner`` (a module converted to another recipe)."""
        for key in FP8_STATE_BUFFERS:
            owner._buffers.pop(key, None)

    # the owner's buffers (re-read on every use: ``.to()`` and FSDP2 replace them)
    @property
    def history(self) -> torch.Tensor:
        return self.owner.fp8_amax_history

    @property
    def scale(self) -> torch.Tensor:
        return self.owner.fp8_scale

    @property
    def seen(self) -> torch.Tensor:
        return self.owner.fp8_seen

    @property
    def pending(self) -> torch.Tensor:
        return self.owner.fp8_amax_pending

    # ---- reading -----------------------------------------------------------------------------------
    def has_history(self, index: Any, *, synced: bool = False) -> bool:
        """Whether every slot of ``index`` has a recorded amax, read on the host.

        ``synced=False``: read only where that costs no device sync (CPU tensors, eager mode), else False
        (callers then take the graph-friendly ``scale_for``). ``synced=True``: the state is identical on
        every rank (``fp8kit.distributed``), so a read decides for all ranks alike; a slot read as seen is
        remembered until the state is loaded again (``forget_reads``), one device read per slot."""
        if synced:
            if index not in self._synced_seen and bool((self.seen[index] > 0).all()):
                self._synced_seen.add(index)
            return index in self._synced_seen
        seen = self.seen[index]
        return seen.device.type == "cpu" and not torch.compiler.is_compiling() and bool((seen > 0).all())

    def forget_reads(self) -> None:
        """Drop the host's memory of seen slots (the buffers were loaded from a checkpoint)."""
        self._synced_seen = set()

    def scale_for(self, index: Any, role: str, amax: torch.Tensor) -> torch.Tensor:
        """The scale of slots ``index`` (a ``role`` operand) whose current amax is ``amax``: the delayed scale
        where the slot has a history, else (first step) the scale of ``amax`` itself."""
        fresh = self.recipe.scale_from_amax(amax, role, previous=1.0)
        return torch.where(self.seen[index] > 0, self.scale[index], fresh)

    # ---- updating ----------------------------------------------------------------------------------
    @torch.no_grad()
    def record(self, index: Any, amax: torch.Tensor, *, fold: bool = True) -> None:
        """MAX ``amax`` (shape of the slots, or one element) into the pending amax of slots ``index`` (a
        non-finite amax is dropped); with ``fold``, fold those slots at once (one process), else the next
        scaling sync reduces and folds them (``fp8kit.distributed``)."""
        pending = self.pending[index]
        amax = amax.float().reshape(pending.shape)
        pending.copy_(torch.where(torch.isfinite(amax), torch.maximum(pending, amax), pending))
        if fold:
            self.fold(index)

    @torch.no_grad()
    def fold(self, index: Any = ...) -> None:
        """Move the pending amaxes of slots ``index`` (default all) into their histories and recompute their
        scales, in place, without a sync. Slots with nothing pending (-1) keep history and scale."""
        pending, hist, scale, seen = self.pending[index], self.history[index], self.scale[index], self.seen[index]
        has = pending >= 0
        rolled = torch.roll(hist, 1, dims=-1)
        rolled[..., 0] = pending.clamp_min(0)
        hist.copy_(torch.where(has[..., None], rolled, hist))
        seen.add_(has.to(torch.int64))
        # unfilled history entries are 0 and never win the max
        ref = hist.amax(dim=-1) if self.recipe.amax_compute_algo == "max" else hist[..., 0]
        forward = self.recipe.scale_from_amax(ref, "input", previous=scale)
        backward = self.recipe.scale_from_amax(ref, "grad", previous=scale)
        slots = torch.arange(len(self.roles), device=scale.device).expand(self.scale.shape)[index]
        new = torch.where(slots == self._grad_slot, backward, forward)
        scale.copy_(torch.where(has, new, scale))
        pending.copy_(torch.where(has, torch.full_like(pending, -1.0), pending))

    @torch.no_grad()
    def set_static(self, index: Any, scale: torch.Tensor) -> None:
        """Fix the scale of slots ``index`` to ``scale`` (a calibrated, static scale, as a serving engine applies
        it) and count them as seen, so evaluation reads it; the histories stay as they are."""
        self.scale[index] = scale.to(self.scale.dtype).reshape(self.scale[index].shape)
        self.seen[index] = self.seen[index].clamp_min(1)

    def calibrated(self) -> list[bool]:
        """Per slot (flattened), whether a delayed scale exists (eager-only convenience: reads the device)."""
        return [bool(v > 0) for v in self.seen.flatten().tolist()]


def operand_scale(
    state: DelayedScalingState | None, recipe: Recipe, index: Any, role: str, amax: torch.Tensor
) -> torch.Tensor:
    """The per-tensor scale of a ``role`` operand whose amax is ``amax``: delayed scaling's (``state`` given,
    slots ``index``; the first-step rule included), else the recipe's scale of that amax."""
    if state is None:
        return recipe.scale_from_amax(amax, role)
    return state.scale_for(index, role, amax)


def recipe_extra_state(recipe: Recipe) -> torch.Tensor:
    """``recipe`` as a UTF-8 JSON byte tensor: an FP8 module's checkpoint extra state (plain tensor, no pickle)."""
    return torch.frombuffer(bytearray(recipe.to_json().encode()), dtype=torch.uint8).clone()


def check_recipe_extra_state(state: Any, recipe: Recipe, name: str) -> None:
    """Refuse (``ValueError`` naming the fix) a checkpoint extra state of module ``name`` that is not fp8kit's or
    that was written with another recipe than ``recipe``."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise ValueError(f"{name}: FP8 state in the checkpoint is not fp8kit's (expected a uint8 tensor)")
    saved = bytes(state.cpu().tolist()).decode()
    try:
        other = Recipe.from_json(saved)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{name}: unreadable FP8 recipe in checkpoint: {saved!r}") from err
    if other != recipe:
        raise ValueError(
            f"{name}: checkpoint was written with recipe {other} but this model uses {recipe}; "
            "convert the model with the checkpoint's recipe, or load the weights only via "
            "fp8kit.nn.strip_fp8_state(state_dict) with strict=False"
        )


def forgive_missing_fp8_state(prefix: str, missing_keys: list[str]) -> None:
    """Drop a module's FP8 state keys (under ``prefix``) from ``missing_keys``, in place: a high-precision
    checkpoint has none, and the module keeps its fresh state."""
    fresh = {prefix + k for k in FP8_STATE_KEYS}
    missing_keys[:] = [k for k in missing_keys if k not in fresh]
