"""``distill``: quantization-aware distillation of a ``prepare``d student towards a high-precision teacher.

The loss per token is the KL divergence from the teacher's next-token distribution to the student's (at
``temperature``, scaled by its square as in Hinton et al.), plus ``hard_label_weight`` times the
student's cross-entropy on the next token of the batch itself. AdamW updates every parameter of the
student that requires a gradient (master weights, norms, embeddings) at ``lr`` and the learned clipping
values of ``QATLinear`` layers at ``scale_lr`` (no weight decay), with a cosine decay to zero over the run
after ``warmup`` linear steps; after each step the clipping values are projected back into their range
(``QATLinear.project_scales_``). A non-finite loss stops the run with an error before any update.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .prepare import qat_layers

__all__ = [
    "QAD_BATCH_SIZE",
    "QAD_LR",
    "QAD_SEQ_LEN",
    "QAD_START",
    "DistillResult",
    "distill",
    "distill_loss",
    "kl_to_teacher",
]

# The defaults of ``distill`` and ``fp8kit quantize --qad-steps``, chosen on the dev split for runs of tens
# to a few hundred steps on a CPU (docs/qat.md, "Defaults"): AdamW's peak learning rate, and the token-id
# windows of one step.
QAD_LR = 1e-4
QAD_BATCH_SIZE, QAD_SEQ_LEN = 4, 128
# Where ``fp8kit quantize --qad-steps`` starts the student: "ptq" (the scheme's default PTQ pipeline, then
# ``from_ptq``) or "rtn" (``prepare``: round to nearest).
QAD_START = "ptq"


@dataclass
class DistillResult:
    """What ``distill`` did: the steps, the settings, and the loss at each step (KL in nats per token)."""

    steps: int
    lr: float
    kl: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    parameters: int = 0


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over tokens of ``KL(teacher || student)`` of the next-token distributions at ``temperature``
    (times ``temperature ** 2``), in FP32."""
    v = student_logits.shape[-1]
    s = F.log_softmax(student_logits.float().reshape(-1, v) / temperature, -1)
    t = F.log_softmax(teacher_logits.float().reshape(-1, v) / temperature, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, kl)``: ``kl_to_teacher`` plus ``hard_label_weight`` times the next-token cross-entropy on
    ``input_ids`` (targets shifted by one)."""
    kl = kl_to_teacher(student_logits, teacher_logits, temperature)
    if not hard_label_weight:
        return kl, kl
    v = student_logits.shape[-1]
    ce = F.cross_entropy(student_logits[:, :-1].float().reshape(-1, v), input_ids[:, 1:].reshape(-1))
    return kl + hard_label_weight * ce, kl


def _check(steps: int, lr: float, scale_lr: float, temperature: float, hard_label_weight: float, warmup: int) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a whole number >= 0, got {steps!r}")
    for name, value in (("lr", lr), ("scale_lr", scale_lr), ("temperature", temperature)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not (math.isfinite(hard_label_weight) and hard_label_weight >= 0):
        raise ValueError(f"hard_label_weight must be a finite number >= 0, got {hard_label_weight!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a whole number of steps >= 0, got {warmup!r}")


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor):
        raise TypeError("distill() needs a causal LM: model(input_ids=...) must return logits (or .logits)")
    return logits


def distill(
    student: nn.Module,
    teacher: nn.Module,
    batches: Sequence[torch.Tensor],
    steps: int,
    lr: float = QAD_LR,
    *,
    scale_lr: float | None = None,
    weight_decay: float = 0.0,
    temperature: float = 1.0,
    hard_label_weight: float = 0.0,
    warmup: int = 0,
    progress: bool | None = None,
    on_step: Callable[[int, float], object] | None = None,
) -> DistillResult:
    """Train ``student`` (made by ``fp8kit.qat.prepare``) for ``steps`` AdamW steps towards ``teacher``.

    Args:
        student: the model being trained, in place.
        teacher: the high-precision model (never changed; run without gradients).
        batches: ``(batch, seq)`` token-id tensors; step ``i`` takes ``batches[i % len(batches)]``.
        steps: optimizer steps (0: nothing changes).
        lr: AdamW's peak learning rate for the weights (``QAD_LR``).
        scale_lr: the learned clipping values' learning rate (default ``lr``).
        weight_decay: AdamW's decoupled weight decay on the weights.
        temperature: the distillation temperature.
        hard_label_weight: weight of the next-token cross-entropy on the batch (0: KL only).
        warmup: steps of linear warm-up before the cosine decay.
        progress: a tqdm bar on stderr (``None``: when stderr is a terminal).
        on_step: ``on_step(step, kl)`` after each step (e.g. a held-out evaluation every few steps).
    """
    scale_lr = lr if scale_lr is None else scale_lr
    _check(steps, lr, scale_lr, temperature, hard_label_weight, warmup)
    batches = list(batches)
    if steps and not batches:
        raise ValueError("distill() needs at least one batch of token ids")
    layers = qat_layers(student)
    if not layers:
        raise ValueError("distill() trains a model made by fp8kit.qat.prepare (it holds no QATLinear layer)")
    scales = [p for m in layers.values() for p in m.scale_parameters()]
    scale_ids = {id(p) for p in scales}
    weights = [p for p in student.parameters() if p.requires_grad and id(p) not in scale_ids]
    groups = [{"params": weights, "lr": lr, "weight_decay": weight_decay}]
    if scales:
        groups.append({"params": scales, "lr": scale_lr, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=lr)

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(steps - warmup, 1)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    result = DistillResult(steps, lr, parameters=sum(p.numel() for p in weights + scales))
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show and steps:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="QAD", unit="step", file=sys.stderr)
    was_training, teacher_training = student.training, teacher.training
    student.train()
    teacher.eval()
    try:
        for i in range(steps):
            ids = batches[i % len(batches)]
            with torch.no_grad():
                target = _logits(teacher, ids)
            loss, kl = distill_loss(_logits(student, ids), target, ids, temperature, hard_label_weight)
            if not torch.isfinite(loss):
                raise ValueError(
                    f"distill: the loss at step {i} is {float(loss.detach())}: the batch or the model's outputs hold NaN or "
                    "inf (check the data; lower lr); the student holds the weights of the step before"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            for m in layers.values():
                m.project_scales_()
            result.kl.append(float(kl.detach()))
            result.loss.append(float(loss.detach()))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(kl=f"{result.kl[-1]:.4f}")
            if on_step is not None:
                on_step(i + 1, result.kl[-1])
    finally:
        if bar is not None:
            bar.close()
        student.train(was_training)
        teacher.train(teacher_training)
    return result
