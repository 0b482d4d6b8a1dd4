"""State-dict helpers shared by checkpoints and exports: tied aliases, FP4 codes packed two per byte."""

from __future__ import annotations

import torch

__all__ = ["pack_fp4", "tied_aliases", "unpack_fp4"]


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


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element, ``fp8kit.cast(x, "e2m1")``) packed two per byte along the last
    dim: element ``2i`` in the low nibble, ``2i + 1`` in the high one, the layout of compressed-tensors'
    ``nvfp4-pack-quantized``, torch's ``float4_e2m1fn_x2``, torchao and ModelOpt. Shape ``(..., n // 2)``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp4 packs uint8 E2M1 codes, got {codes.dtype}; make them with fp8kit.cast(x, 'e2m1')")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got shape {tuple(codes.shape)}; pad it with zero codes")
    if bool((codes > 0xF).any()):
        raise ValueError("codes above 15 are not E2M1 codes; make them with fp8kit.cast(x, 'e2m1')")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``pack_fp4``'s inverse: uint8 bytes ``(..., m)`` to E2M1 codes ``(..., 2 m)``, low nibble first."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 reads uint8 bytes, got {packed.dtype} (view float4_e2m1fn_x2 as torch.uint8)")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
