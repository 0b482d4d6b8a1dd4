"""Quantization-aware distillation of a pretrained causal LM: what ``fp8kit quantize --qad-steps`` runs.

The teacher is the loaded model itself (a frozen copy, without gradients); the student is a copy quantized
by the scheme's default PTQ pipeline (``ptq_settings``: GPTQ, AWQ for weight-only, static scales calibrated
on the calibration split) and turned back into trainable layers by ``from_ptq`` (FP4: master weights
towards the teacher's, inside their codes' rounding intervals), or with ``start="rtn"`` a copy ``prepare``d
at round to nearest; it is distilled on windows of the calibration split (the shipped KJV or ``--text``),
then ``convert``ed. Perplexity is measured before (the student at step 0) and after, on windows of the dev
split, which neither calibration nor distillation reads. ``qad_cost`` is the estimate the command prints
first.
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
from ..ptq.quantize import quantize
from ..ptq.schemes import get_scheme
from ..qat.distill import QAD_BATCH_SIZE, QAD_LR, QAD_SEQ_LEN, QAD_START, DistillResult, distill
from ..qat.prepare import convert, from_ptq, prepare
from .cost import JobCost, ModelShape, activation_bytes, device_flops
from .estimate import Rates, held_activation_bytes
from .quantize import ptq_settings, quantizable_layers, settings_text

__all__ = ["QADRun", "qad_cost", "qad_pretrained"]

# FP32 master weight, gradient, two AdamW moments, the fake-quantized weight kept for backward
BYTES_PER_STUDENT_PARAM = 20
# the distillation loss's tensors of vocabulary width beyond the student's logits: the teacher's logits and
# both log-probabilities
KL_VOCAB_TENSORS = 3


def qad_cost(
    shape: ModelShape,
    device: torch.device,
    steps: int,
    tokens_per_step: int,
    eval_tokens: int,
    flops: float | None = None,
    rates: Rates | None = None,
    before: dict[str, float] | None = None,
) -> JobCost:
    """QAD's estimate: on ``device`` the teacher in the load dtype (BF16 on CUDA, FP32 on the CPU), the
    student at ``BYTES_PER_STUDENT_PARAM`` bytes per parameter, one micro-batch's activations (on the CPU with
    ``rates``, what the process holds for them: ``estimate.held_activation_bytes``) and the distillation
    loss's FP32 tensors of vocabulary width (``KL_VOCAB_TENSORS``); per step 6 FLOPs per parameter and token
    for the student and 2 for the teacher; three evaluations. ``before``: the phases ahead of distillation
    (imports, the text's encoding, the load, the PTQ start); without it, the load alone."""
    n = shape.params
    width = 2 if device.type == "cuda" else 4
    if rates is not None and device.type == "cpu":
        activations = held_activation_bytes(shape, tokens_per_step, width, rates)
    else:
        activations = activation_bytes(shape, tokens_per_step, width)
    kl = KL_VOCAB_TENSORS * tokens_per_step * shape.vocab * 4
    peak = width * n + BYTES_PER_STUDENT_PARAM * n + activations + kl
    flops = flops or device_flops(device)
    phases = dict(before) if before is not None else {"load": shape.checkpoint_bytes / 1e9}
    phases |= {
        "distill": steps * 8 * n * tokens_per_step / flops,
        "evaluate": 3 * 2 * n * eval_tokens / flops,
    }
    what = f"quantize --qad-steps {steps} (teacher + student with FP32 master weights and AdamW)"
    return JobCost(what, n, str(device), peak, phases=phases)


@dataclass
class QADRun:
    """What ``qad_pretrained`` measured: dev perplexity of the teacher, before QAD (the student at step 0,
    ``start`` says what it was) and after, the windows scored, and the distillation's record."""

    teacher_ppl: float
    before_ppl: float
    after_ppl: float
    windows: int
    seq_len: int
    result: DistillResult
    start: str = "round-to-nearest PTQ"

    def line(self) -> str:
        def rel(p: float) -> str:
            return f"{100 * (p / self.teacher_ppl - 1):+.1f}%"

        return (
            f"held-out perplexity ({self.windows} dev windows of {self.seq_len} tokens): teacher "
            f"{self.teacher_ppl:.3f}; before QAD ({self.start}) {self.before_ppl:.3f} ({rel(self.before_ppl)}); "
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
    start: str = QAD_START,
    calibration: str = "max",
    batch_size: int = QAD_BATCH_SIZE,
    seq_len: int = QAD_SEQ_LEN,
    eval_windows: int = 8,
    eval_seq_len: int = 512,
    progress: bool | None = None,
) -> tuple[nn.Module, QADRun]:
    """Distil ``model`` into ``scheme`` for ``steps`` steps (module doc); returns the converted student
    (PTQ's modules, ready for ``fp8kit.export.save_pretrained``) and what was measured. ``model`` is
    left as it was (it is the teacher). ``start``: ``"ptq"`` or ``"rtn"`` (module doc)."""
    if start not in ("ptq", "rtn"):
        raise ValueError(f"start is 'ptq' (the scheme's PTQ pipeline) or 'rtn' (round to nearest), got {start!r}")
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
    if start == "ptq":
        kw = ptq_settings(scheme, calibration, n_layers=quantizable_layers(student))
        quantize(student, scheme, forward_loop, progress=False, **kw)
        from_ptq(student, reference=teacher if get_scheme(scheme).is_fp4 else None)
        began = f"PTQ: {settings_text(kw)}"
    else:
        prepare(student, scheme, forward_loop, calibration=calibration)
        began = "round-to-nearest PTQ"
    teacher_ppl, before = _ppl(teacher, held_out), _ppl(student, held_out)
    result = distill(student, teacher, batches, steps, lr, progress=progress)
    for p in student.parameters():
        p.requires_grad_(False)
    convert(student)
    after = _ppl(student, held_out)
    return student, QADRun(teacher_ppl, before, after, n_eval, eval_seq_len, result, began)
