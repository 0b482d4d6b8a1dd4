"""Error metrics shared by the numerics tests."""

import torch


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``approx`` against ``ref``."""
    ref, approx = ref.detach().double(), approx.detach()
    err = (ref - approx.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-300)))
