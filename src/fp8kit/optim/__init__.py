"""Memory-lean optimizers: AdamW with FP8 moments and BF16 master weights."""

from .adamw import AdamW
from .master import kahan_update_, stochastic_round_bf16

__all__ = ["AdamW", "kahan_update_", "stochastic_round_bf16"]
