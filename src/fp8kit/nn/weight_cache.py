"""The FP8 weight caches of the modules, released after every optimizer step that changes their weights.

An FP8 module (``Linear``, the MoE experts) caches its quantized weights for the micro-batches of one
optimizer step; ``track_weight_cache`` registers it, and one optimizer step post-hook (installed with the
first cache) drops the caches of the modules whose weights that optimizer updated, so no FP8 weight copy
lives between steps.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

__all__ = ["track_weight_cache"]

# Modules that hold an FP8 weight cache; emptied after optimizer steps (weights changed).
_CACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_HOOK: list[Any] = []


def _release_stale_caches(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any ``optimizer.step()``: drop the FP8 weight caches of the modules whose weight that
    optimizer updates (the next forward rebuilds them). Keyed on the optimizer's parameters, not on the
    weight's version counter: fused optimizers (``torch.optim.AdamW(fused=True)``, Trainer's default)
    update weights without bumping it."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for layer in list(_CACHED):
        weights = layer.fp8_cached_weights() if hasattr(layer, "fp8_cached_weights") else (layer.weight,)
        if not layer._weight_cache or any(id(w) in params for w in weights):
            layer.release_fp8_weights()
            _CACHED.discard(layer)


def track_weight_cache(layer: nn.Module) -> None:
    """Register ``layer`` (it holds ``_weight_cache`` and ``release_fp8_weights``) for release after the
    optimizer steps that update its weights."""
    if not _CACHED and not _HOOK:  # first cache in this process: hook into every optimizer's step
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_release_stale_caches))
    _CACHED.add(layer)
