"""The random Hadamard transform (RHT) of NVFP4 training: an orthogonal 16x16 rotation applied blockwise.

``random_hadamard(size)`` is ``H @ diag(signs) / sqrt(size)`` for the Sylvester Hadamard matrix ``H`` and
random signs drawn once from a fixed seed, so every process and step uses the same matrix. It is
orthogonal (``R @ R.T == I``), so transforming both operands of a GEMM along its reduction dim leaves the
product unchanged: ``(A R)(B R)^T = A B^T``. Before quantization it spreads a block's outliers over its
16 elements (the weight-gradient GEMM's inputs, as Transformer Engine's NVFP4 recipe).
"""

from __future__ import annotations

import torch

__all__ = ["RHT_SEED", "apply_rht", "random_hadamard"]

RHT_SEED = 0x5EED  # the fixed seed of the random signs


_MATRICES: dict[int, torch.Tensor] = {}  # size -> the CPU matrix (built outside compiled graphs: see recipes)


def random_hadamard(size: int = 16, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``(size, size)`` float32 orthogonal matrix ``H diag(signs) / sqrt(size)`` (fixed random signs)."""
    m = _MATRICES.get(size)
    if m is None:
        if size < 2 or size & (size - 1):
            raise ValueError(f"the Hadamard transform size must be a power of two >= 2, got {size}")
        h = torch.ones(1, 1)
        while h.shape[0] < size:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        gen = torch.Generator().manual_seed(RHT_SEED)
        signs = torch.randint(0, 2, (size,), generator=gen).float() * 2 - 1
        m = _MATRICES[size] = (h * signs) / size**0.5
    return m.to(device)


def apply_rht(x: torch.Tensor, size: int = 16) -> torch.Tensor:
    """``x`` (2-D, last dim a multiple of ``size``) times the block-diagonal RHT along its last dim, float32."""
    rows, cols = x.shape
    if cols % size:
        raise ValueError(f"the Hadamard transform needs the last dim ({cols}) to be a multiple of {size}")
    r = random_hadamard(size, x.device)
    return (x.float().reshape(rows, cols // size, size) @ r).reshape(rows, cols)
