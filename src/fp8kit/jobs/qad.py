"""Quantization-aware distillation of a pretrained causal LM: what ``fp8kit quantize --qad-steps`` runs.

The teacher is the loaded model itself (a frozen copy, without gradients); the student is a copy prepared
with ``prepare`` (static scales calibrated on the calibration split, as PTQ's), distilled on windows of
the calibration split (the shipped KJV or ``--text``), then ``convert``ed. Perplexity is measured before
(the round-to-nearest PTQ model: the student at step 0) and after, on windows of the dev split, which
neither calibration nor distillation reads. ``qad_cost`` is the estimate the command prints first.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..data import PTQSplits, windows
from ..data.evaluation import window_losses
from ..data.splits import available_windows
from ..qat.distill import QAD_BATCH_SIZE, QAD_LR, QAD_SEQ_LEN, DistillResult, distill
from ..qat.prepare import convert, prepare
from .cost import JobCost, ModelShape, activation_bytes, device_flops

__all__ = ["QADRun", "qad_cost", "qad_pretrained"]

# FP32 master weight, gradient, two AdamW moments, the fake-quantized weight kept for backward
BYTES_PER_STUDENT_PARAM = 20


def qad_cost(
    shape: ModelShape,
    device: torch.device,
    steps: int,
    tokens_per_step: int,
    eval_tokens: int,
    flops: float | None = None,
) -> JobCost:
    """QAD's estimate: on ``device`` the teacher in the load dtype (BF16 on CUDA, FP32 on the CPU), the
    student at ``BYTES_PER_STUDENT_PARAM`` bytes per parameter and one micro-batch's activations; per
    step 6 FLOPs per parameter and token for the student and 2 for the teacher; three evaluations."""
    n = shape.params
    width = 2 if device.type == "cuda" else 4
    peak = width * n + BYTES_PER_STUDENT_PARAM * n + activation_bytes(shape, tokens_per_step, width)
    flops = flops or device_flops(device)
    phases = {
        "load": shape.checkpoint_bytes / 1e9,
        "distill": steps * 8 * n * tokens_per_step / flops,
        "evaluate": 3 * 2 * n * eval_tokens / flops,
    }
    what = f"quantize --qad-steps {steps} (teacher + student with FP32 master weights and AdamW)"
    return JobCost(what, n, str(device), peak, phases=phases)


@dataclass
class QADRun:
    """What ``qad_pretrained`` measured: dev perplexity of the teacher, before QAD (round-to-nearest PTQ) and
    after, the windows scored, and the distillation's record."""

    teacher_ppl: float
    before_ppl: float
    after_ppl: float
    windows: int
    seq_len: int
    result: DistillResult

    def line(self) -> str:
        def rel(p: float) -> str:
            return f"{100 * (p / self.teacher_ppl - 1):+.1f}%"

        return (
            f"held-out perplexity ({self.windows} dev windows of {self.seq_len} tokens): teacher "
            f"{self.teacher_ppl:.3f}; before QAD (round-to-nearest PTQ) {self.before_ppl:.3f} ({rel(self.before_ppl)}); "
            f"after {self.result.steps} QAD steps {self.after_ppl:.3f} ({rel(self.after_ppl)})"
        )


def _ppl(model: nn.Module, w: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(float(window_losses(model, w, batch_size=4).mean()))


def qad_pretrained(
    model: nn.Module,
    scheme: str,
    splits: PTQSplits,
    steps: int,
    forward_loop: Any = None,
    *,
    lr: float = QAD_LR,
    calibration: str = "max",
    batch_size: int = QAD_BATCH_SIZE,
    seq_len: int = QAD_SEQ_LEN,
    eval_windows: int = 8,
    eval_seq_len: int = 512,
    progress: bool | None = None,
) -> tuple[nn.Module, QADRun]:
    """Distil ``model`` into ``scheme`` for ``steps`` steps (module doc); returns the converted student
    (PTQ's modules, ready for ``fp8kit.export.save_pretrained``) and what was measured. ``model`` is
    left as it was (it is the teacher)."""
    n_train = available_windows(splits.calib, seq_len, splits.block)
    if n_train < 1:
        raise ValueError(f"{splits.name} is too short to distil on windows of {seq_len + 1} tokens")
    train = windows(splits.calib, min(n_train, max(steps, 1) * batch_size), seq_len, splits.block)[:, :-1]
    batches = list(train.split(batch_size))
    n_eval = min(eval_windows, available_windows(splits.dev, eval_seq_len, splits.block))
    if n_eval < 1:
        eval_seq_len = max(8, min(eval_seq_len, splits.block - 1))
        n_eval = min(eval_windows, available_windows(splits.dev, eval_seq_len, splits.block))
    held_out = windows(splits.dev, n_eval, eval_seq_len, splits.block)
    teacher = model.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = copy.deepcopy(teacher)
    for p in student.parameters():
        p.requires_grad_(True)
    prepare(student, scheme, forward_loop, calibration=calibration)
    teacher_ppl, before = _ppl(teacher, held_out), _ppl(student, held_out)
    result = distill(student, teacher, batches, steps, lr, progress=progress)
    for p in student.parameters():
        p.requires_grad_(False)
    convert(student)
    after = _ppl(student, held_out)
    return student, QADRun(teacher_ppl, before, after, n_eval, eval_seq_len, result)
