"""``fp8kit train``: FP8 vs BF16 language-model training side by side."""

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .loop import TrainConfig, check_config, run_comparison

__all__ = [
    "CheckpointError",
    "TrainConfig",
    "check_config",
    "load_checkpoint",
    "run_comparison",
    "save_checkpoint",
]
