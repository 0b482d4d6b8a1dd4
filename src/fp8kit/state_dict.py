"""State-dict helpers shared by checkpoints and exports."""

from __future__ import annotations

import torch

__all__ = ["tied_aliases"]


def tied_aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{alias_key: first_key}`` for entries that share memory with an earlier entry (tied embeddings).

    safetensors refuses shared memory, so writers drop the aliases and readers restore them.
    """
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for key, val in state.items():
        ident = (val.untyped_storage().data_ptr(), val.storage_offset(), tuple(val.shape), tuple(val.stride()))
        if val.numel() > 0 and ident in seen:
            aliases[key] = seen[ident]
        else:
            seen[ident] = key
    return aliases
