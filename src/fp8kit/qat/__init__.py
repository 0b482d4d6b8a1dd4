"""Quantization-aware training and distillation for the PTQ schemes: ``prepare`` (the scheme's quantizers
in the forward pass, straight-through gradients), ``distill`` (KL to a high-precision teacher) and
``convert`` (PTQ's inference modules, for every export)."""

from .distill import DistillResult, distill, distill_loss, kl_to_teacher
from .linear import QATLinear
from .prepare import convert, prepare, qat_layers

__all__ = ["DistillResult", "QATLinear", "convert", "distill", "distill_loss", "kl_to_teacher", "prepare", "qat_layers"]
