"""Quantization-aware training and distillation for the PTQ schemes: ``prepare`` (the scheme's quantizers
in the forward pass, straight-through gradients), ``distill`` (KL to a high-precision teacher) and
``convert`` (PTQ's inference modules, for every export); LoRA adapters (peft) on a quantized base
(``lora_config``, ``merge_lora``)."""

from .distill import QAD_BATCH_SIZE, QAD_LR, QAD_SEQ_LEN, QAD_START, DistillResult, distill, distill_loss, kl_to_teacher
from .linear import QATLinear
from .lora import lora_config, merge_lora
from .prepare import convert, from_ptq, prepare, qat_layers

__all__ = [
    "QAD_BATCH_SIZE",
    "QAD_LR",
    "QAD_SEQ_LEN",
    "QAD_START",
    "DistillResult",
    "QATLinear",
    "convert",
    "distill",
    "distill_loss",
    "from_ptq",
    "kl_to_teacher",
    "lora_config",
    "merge_lora",
    "prepare",
    "qat_layers",
]
