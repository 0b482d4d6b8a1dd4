"""FP8 training on ``torch.distributed``: synchronized scaling (DDP, FSDP2), FP8 weight all-gather for
FSDP2, and the ``torchrun`` helpers of ``fp8kit train --nproc``. See ``docs/distributed.md``."""

from .scaling import (
    AmaxAllReduce,
    collective_counts,
    delayed_layers,
    enable_fp8_distributed,
    fp8_layers,
    reset_collective_counts,
    scaling_state,
    sync_scaling,
)

__all__ = [
    "AmaxAllReduce",
    "collective_counts",
    "delayed_layers",
    "enable_fp8_distributed",
    "fp8_layers",
    "reset_collective_counts",
    "scaling_state",
    "sync_scaling",
]
