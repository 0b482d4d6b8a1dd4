"""Writing an FP32 update into BF16 parameters without FP32 master weights.

* ``stochastic``: round the new FP32 value to one of its two BF16 neighbours with probability
  proportional to closeness, so that updates far below BF16's spacing still move the weight on average.
* ``kahan``: round to nearest and keep the rounding error in a BF16 compensation buffer that is added
  to the next update (compensated summation, 2 extra bytes per parameter).
"""

from __future__ import annotations

import torch

__all__ = ["kahan_update_", "stochastic_round_bf16"]


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 stochastically (unbiased for finite values).

    Adds a uniform random integer in ``[0, 2**16)`` to the float32 bit pattern and truncates the low
    16 bits: the magnitude rounds up with probability equal to the dropped fraction of a BF16 step.
    """
    x = x.float().contiguous()
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -65536  # 0xFFFF0000 as an int32
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def kahan_update_(param: torch.Tensor, new_value: torch.Tensor, comp: torch.Tensor) -> None:
    """Set bf16 ``param`` to ``new_value`` (float32, same shape) with compensated rounding, in place.

    ``comp`` (bf16, same number of elements) carries the rounding error of earlier updates.
    """
    old = param.detach().float().reshape(-1)
    y = (new_value.reshape(-1) - old) + comp.float()
    rounded = (old + y).to(torch.bfloat16)
    comp.copy_((y - (rounded.float() - old)).to(torch.bfloat16))
    param.detach().copy_(rounded.reshape(param.shape))
