"""Norm tweaking: after quantization, tune the model's normalization weights so that the quantized model
matches the high-precision one on calibration data (Li et al., "Norm Tweaking: High-performance Low-bit
Quantization of Large Language Models", AAAI 2024).

Only the elementwise weights (and biases) of the norms change (``RMSNorm``/``LayerNorm``: 35k numbers in
SmolLM2-135M); the quantized weights, their scales and the static activation scales stay as calibrated,
so the result exports and loads like any other checkpoint of the scheme. The objective is end to end:
the KL divergence from the high-precision model's next-token distribution (nats per token), or, for
models without ``logits`` (encoders), the output's squared error relative to its power. Gradients pass
the activation and KV-cache quantizers straight through (``QuantLinear``'s straight-through path).

The teacher is the same model with its high-precision layers, norm weights and (with an FP8 KV cache)
high-precision keys and values swapped back in, so no second copy of the model is held. If the tuned weights do not lower the calibration loss they are
reverted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layer_error import _output_tensor, swap_submodule
from .linear import holding_dequantized_weights

__all__ = ["TEACHER_CACHE_BYTES", "NormTweakResult", "norm_parameters", "tweak_norms"]

TEACHER_CACHE_BYTES = 2 << 30  # the teacher's outputs kept for replay (bytes); beyond it, recomputed


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class NormTweakResult:
    """What ``tweak_norms`` did. Losses are means over the recorded calibration batches: KL in nats per
    token for causal LMs, else the relative squared output error (``metric`` says which)."""

    steps: int
    lr: float
    parameters: int
    loss_before: float
    loss_after: float
    metric: str
    reverted: bool


def norm_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The elementwise weights and biases of ``model``'s normalization layers (``nn.LayerNorm``,
    ``nn.RMSNorm`` and any module whose class name ends in ``Norm``/``RMSNorm``, as in ``transformers``)."""
    out: dict[str, nn.Parameter] = {}
    for name, m in model.named_modules():
        cls = type(m).__name__
        if isinstance(m, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))) or cls.endswith(("Norm", "RMSNorm")):
            for pname, p in m.named_parameters(recurse=False):
                if p.is_floating_point():
                    out[f"{name}.{pname}" if name else pname] = p
    return out


def record_calls(model: nn.Module, forward_loop: Callable[[nn.Module], object]) -> list[tuple[tuple, dict]]:
    """The ``(args, kwargs)`` of every call ``forward_loop`` makes to ``model`` (run once, no gradients)."""
    calls: list[tuple[tuple, dict]] = []

    def hook(_m, args, kwargs):
        calls.append((args, dict(kwargs)))

    h = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            forward_loop(model)
    finally:
        h.remove()
    if not calls:
        raise ValueError("norm tweaking: the forward_loop never called the model")
    return calls


def _distance(student: Any, teacher: Any) -> tuple[torch.Tensor, str]:
    """KL(teacher || student) per token over next-token distributions, else relative squared error."""
    s_logits, t_logits = getattr(student, "logits", None), getattr(teacher, "logits", None)
    if isinstance(s_logits, torch.Tensor) and isinstance(t_logits, torch.Tensor):
        s = F.log_softmax(s_logits.float().reshape(-1, s_logits.shape[-1]), -1)
        t = F.log_softmax(t_logits.float().reshape(-1, t_logits.shape[-1]), -1)
        return F.kl_div(s, t, log_target=True, reduction="batchmean"), "KL divergence (nats/token)"
    s, t = _output_tensor(student).float(), _output_tensor(teacher).float()
    return (s - t).pow(2).sum() / t.pow(2).sum().clamp_min(1e-30), "relative squared output error"


def tweak_norms(
    model: nn.Module,
    originals: dict[str, nn.Module],
    forward_loop: Callable[[nn.Module], object],
    steps: int,
    lr: float = 1e-3,
    on_step: Callable[[], object] | None = None,
) -> NormTweakResult:
    """Tune ``model``'s norm weights for ``steps`` Adam steps (one recorded calibration batch per step,
    cycling; the learning rate decays to 0 on a cosine) towards the high-precision model, in place.

    Args:
        model: the quantized model (``QuantLinear`` layers in place).
        originals: layer name -> the high-precision module it replaced (the teacher's layers).
        forward_loop: runs the model on calibration batches; its calls are recorded once and replayed.
        steps: optimizer steps (0: nothing happens).
        lr: Adam's initial learning rate.
        on_step: called after each optimizer step (a progress bar).
    """
    _check_settings(steps, lr)
    params = norm_parameters(model)
    if not params:
        raise ValueError(
            "norm tweaking tunes normalization weights (LayerNorm/RMSNorm) and this model has none: "
            "quantize without norm_tweak"
        )
    calls = record_calls(model, forward_loop)
    teacher = _Teacher(model, originals, params, calls)
    was_training = model.training
    model.eval()
    flags = {p: p.requires_grad for p in model.parameters()}
    before, metric = _mean_loss(model, calls, teacher)
    try:
        _tune(model, params, calls, teacher, steps, lr, on_step)
        after, _ = _mean_loss(model, calls, teacher)
        reverted = not after < before  # NaN included
        if reverted:  # tuning did not help on the calibration data itself: keep the calibrated model
            teacher.restore_start()
            after = before
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
        model.train(was_training)
    return NormTweakResult(steps, lr, sum(p.numel() for p in params.values()), before, after, metric, reverted)


def _check_settings(steps: int, lr: float) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"norm_tweak must be a whole number of steps >= 0, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"the norm tweaking learning rate must be > 0, got {lr!r}")


class _Teacher:
    """The high-precision model's answer to each recorded call: the original layers swapped back in, the
    starting norm weights and a high-precision KV cache, for one call, then the student restored. An
    answer never changes: computed once, kept while the answers fit in ``TEACHER_CACHE_BYTES`` (logits of
    4 x 128 tokens over a 49k vocabulary: 100 MB), else recomputed."""

    def __init__(self, model: nn.Module, originals: dict[str, nn.Module], params: dict[str, nn.Parameter], calls):
        self.model, self.originals, self.params, self.calls = model, originals, params, calls
        self.start = {n: p.detach().clone() for n, p in params.items()}
        self.quantized = {n: model.get_submodule(n) for n in originals}
        self.kv_states = [m._fp8kit_kv for m in model.modules() if isinstance(getattr(m, "_fp8kit_kv", None), dict)]
        self.answers: dict[int, Any] = {}
        self.room = TEACHER_CACHE_BYTES

    def restore_start(self) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.start[n])

    def _run(self, args: tuple, kwargs: dict) -> Any:
        model = self.model
        tuned = {n: p.detach().clone() for n, p in self.params.items()}
        for n, m in self.originals.items():
            swap_submodule(model, n, m)
        modes = [st["mode"] for st in self.kv_states]
        for st in self.kv_states:  # the teacher's keys and values in high precision too
            st["mode"] = "off"
        try:
            self.restore_start()
            with torch.no_grad():
                return model(*args, **kwargs)
        finally:
            for st, mode in zip(self.kv_states, modes, strict=True):
                st["mode"] = mode
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(tuned[n])
            for n, m in self.quantized.items():
                swap_submodule(model, n, m)

    def __call__(self, i: int) -> Any:
        if i in self.answers:
            return self.answers[i]
        out = self._run(*self.calls[i])
        logits = getattr(out, "logits", None)
        kept = SimpleNamespace(logits=logits) if isinstance(logits, torch.Tensor) else _output_tensor(out)
        size = _tensor_bytes(kept.logits if isinstance(kept, SimpleNamespace) else kept)
        if size <= self.room:
            self.answers[i], self.room = kept, self.room - size
        return kept


def _mean_loss(model: nn.Module, calls, teacher: _Teacher) -> tuple[float, str]:
    """The student's mean distance to the teacher over the recorded calls, and the metric's name."""
    total, metric = 0.0, ""
    with torch.no_grad():
        for i, (a, k) in enumerate(calls):
            loss, metric = _distance(model(*a, **k), teacher(i))
            total += float(loss)
    return total / len(calls), metric


def _tune(model: nn.Module, params: dict[str, nn.Parameter], calls, teacher: _Teacher, steps: int, lr: float, on_step):
    """``steps`` Adam steps on the norm weights only (one recorded call per step, cycling; cosine decay)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.Adam(params.values(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    with holding_dequantized_weights(model):  # the quantized weights are frozen here
        for step in range(steps):
            args, kwargs = calls[step % len(calls)]
            target = teacher(step % len(calls))
            with torch.enable_grad():
                loss, _ = _distance(model(*args, **kwargs), target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
            schedule.step()
            if on_step is not None:
                on_step()
    for p in params.values():
        p.requires_grad_(False)
