"""In-place class swaps: a module gains a mixin in front of its class, keeping its object identity.

fp8kit turns a ``transformers`` experts module into its FP8 (``nn.experts.FP8Experts``), BF16
(``nn.bf16.BF16Experts``), expert-parallel (``distributed.expert_parallel.ExpertParallel``) or quantized
(``ptq.experts.QuantExperts``) form by giving it the class ``<Prefix><Class>(Mixin, Class)``: parameters,
buffers, hooks and every attribute a user set on the module stay as they are.
"""

from __future__ import annotations

import functools

import torch.nn as nn

__all__ = ["mixin_class", "swap_class"]


@functools.cache
def mixin_class(mixin: type, cls: type, prefix: str) -> type:
    """The class ``f"{prefix}{cls.__name__}"`` deriving from ``(mixin, cls)`` (one per triple)."""
    name = f"{prefix}{cls.__name__}"
    return type(name, (mixin, cls), {"__module__": mixin.__module__, "__qualname__": name})


def swap_class(module: nn.Module, mixin: type, prefix: str, base: type | None = None) -> type:
    """Put ``mixin`` in front of ``module``'s class (or of ``base``) in place; returns the class it had."""
    old = type(module)
    module.__class__ = mixin_class(mixin, base or old, prefix)
    return old
