"""``fp8kit.ptq.quantize``: post-training quantization of a model's ``nn.Linear`` layers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..nn.convert import is_output_head
from ..nn.linear import Linear as FP8Linear
from ..recipes import DelayedScaling
from .calibrate import CALIBRATION_METHODS, choose_amax, observe_inputs
from .kv_cache import enable_fp8_kv, finish_calibration
from .linear import QuantLinear
from .schemes import Scheme, get_scheme
from .smoothquant import apply_smoothing, apply_smoothing_search, find_mappings

if TYPE_CHECKING:
    from .layer_error import LayerScore
    from .norm_tweak import NormTweakResult

__all__ = ["PTQReport", "quantize"]

ROWS_PER_BATCH = 64  # calibration tokens per batch kept for the SmoothQuant alpha search


@dataclass
class PTQReport:
    """What ``quantize`` did: the scheme, quantized and skipped layers, calibrated amaxes."""

    scheme: str
    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    input_amax: dict[str, float] = field(default_factory=dict)
    smoothed: list[str] = field(default_factory=list)
    smooth_alpha: dict[str, float | None] = field(default_factory=dict)
    kv_cache: bool = False
    calibration: str | None = None
    norm_tweak: NormTweakResult | None = None
    gptq: bool = False
    awq: dict[str, float] = field(default_factory=dict)
    sensitivity: list[LayerScore] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fp8kit.ptq ({self.scheme}): quantized {len(self.quantized)} Linear layers"]
        if self.smooth_alpha:
            searched = [a for a in self.smooth_alpha.values() if a is not None]
            detail = (
                f" (alpha searched per group: {min(searched)}-{max(searched)}, "
                f"{len(self.smooth_alpha) - len(searched)} left unsmoothed)"
                if len(set(self.smooth_alpha.values())) > 1 and searched
                else ""
            )
            lines.append(f"  SmoothQuant folded into {len(self.smoothed)} producers{detail}")
        if self.awq:
            lines.append(f"  AWQ scales folded into {len(self.awq)} producers")
        if self.gptq:
            lines.append("  GPTQ weight rounding (Hessian-aware error compensation)")
        if self.kv_cache:
            lines.append("  FP8 KV cache (per-tensor static k/v scales)")
        if self.norm_tweak is not None:
            t = self.norm_tweak
            lines.append(
                f"  norm tweaking: {t.parameters} norm weights, {t.steps} steps at lr {t.lr:g}: calibration "
                f"{t.metric} {t.loss_before:.4g} -> {t.loss_after:.4g}" + (" (no gain: reverted)" if t.reverted else "")
            )
        for name, why in self.skipped.items():
            lines.append(f"  kept {name}: {why}")
        return "\n".join(lines)


def _default_skip(model: nn.Module) -> Callable[[str, nn.Module], str | None]:
    head = is_output_head(model)

    def why(name: str, module: nn.Module) -> str | None:
        if head(name, module):
            return "output head (kept in high precision, as ModelOpt and llm-compressor do)"
        return None

    return why


def _trained_input_amax(model: nn.Module, targets: list[str]) -> dict[str, float]:
    """Input amax of layers trained by ``fp8kit.convert`` with delayed scaling (max of the history)."""
    out: dict[str, float] = {}
    for name in targets:
        m = model.get_submodule(name)
        if isinstance(m, FP8Linear) and isinstance(m.recipe, DelayedScaling) and int(m.fp8_seen[0]) > 0:
            out[name] = float(m.fp8_amax_history[0].max())
    return out


def quantize(
    model: nn.Module,
    scheme: Scheme | str,
    forward_loop: Callable[[nn.Module], object] | None = None,
    *,
    calibration: str = "max",
    percentile: float = 99.99,
    alpha: float | str = 0.5,
    smooth: bool | None = None,
    kv_cache: bool = False,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    gptq: bool = False,
    awq: bool = False,
    keep_bf16: int = 0,
    norm_tweak: int = 0,
    norm_tweak_lr: float = 1e-3,
    _originals: dict[str, nn.Module] | None = None,
) -> nn.Module:
    """Quantize ``model``'s ``nn.Linear`` layers in place for inference and return it.

    Args:
        scheme: ``"fp8"``, ``"fp8-dynamic"``, ``"int8-smoothquant"`` or ``"int8-weight-only"``.
        forward_loop: ``forward_loop(model)`` runs the model on calibration data (ModelOpt's
            convention); required by the static schemes (``fp8``, ``int8-smoothquant``) and ``kv_cache``,
            except that a model trained with ``fp8kit.convert`` under delayed scaling exports to ``fp8``
            with its trained input amax (every layer's history) and needs none.
        calibration: ``"max"``, ``"percentile"`` or ``"mse"`` (static activation scales).
        percentile: for ``calibration="percentile"``.
        alpha: SmoothQuant migration strength in ``[0, 1]``, or ``"search"``: each group (norm -> q/k/v,
            norm -> gate/up, up -> down) gets the alpha on an 11-point grid, or no smoothing, with the
            smallest quantized output error on calibration tokens (``smoothquant.search_alpha``).
        smooth: fold SmoothQuant factors before quantizing; ``None``: the scheme's own choice (only
            ``int8-smoothquant``). The folds keep the model's function, so any W8A8 scheme may use them
            (static ``fp8`` activations lose less with them on SmolLM2, BENCHMARKS.md).
        kv_cache: FP8 KV cache with per-tensor static k/v scales (FP8 schemes, Llama-style attention).
        module_filter: ``(name, module) -> bool`` chooses layers (replaces the default, which keeps the
            output head in high precision).
        gptq: round the weights with GPTQ (``ptq.gptq``; Hessians from ``forward_loop``) instead of to nearest.
        awq: AWQ-style per-channel scale search before rounding (``ptq.awq``; weight-only schemes).
        keep_bf16: keep in high precision the ``keep_bf16`` layers whose quantization alone worsens the
            model most over ``forward_loop``: for causal LMs by the Fisher estimate of the next-token loss
            increase (``layer_error.rank_by_fisher``, one pass with gradients), for other models by the
            relative output error (``rank_by_output_error``, one ``forward_loop`` per quantized layer).
        norm_tweak: after quantizing, tune the norm weights for this many Adam steps (learning rate
            ``norm_tweak_lr``) so the quantized model's outputs match the high-precision model's on
            ``forward_loop``'s batches (``ptq.norm_tweak``; KL of next-token distributions for causal LMs).
            Only norm weights change; nothing is kept if the calibration loss does not fall.

    The report is stored as ``model.ptq_report``.
    """
    scheme = get_scheme(scheme)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize() takes an nn.Module, got {type(model).__name__}")
    if calibration not in CALIBRATION_METHODS:
        raise ValueError(f"unknown calibration method {calibration!r}; accepted: {', '.join(CALIBRATION_METHODS)}")
    if kv_cache and not scheme.is_fp8:
        raise ValueError(f"kv_cache (fp8-kv) goes with the FP8 schemes, not {scheme.name!r}")
    if awq and scheme.act_format is not None:
        raise ValueError(f"awq goes with the weight-only scheme (int8-weight-only), not {scheme.name!r}")
    if not (alpha == "search" or (isinstance(alpha, (int, float)) and 0 <= alpha <= 1)):
        raise ValueError(f"alpha must be a number in [0, 1] or 'search', got {alpha!r}")
    if isinstance(keep_bf16, bool) or not isinstance(keep_bf16, int) or keep_bf16 < 0:
        raise ValueError(f"keep_bf16 must be a whole number >= 0, got {keep_bf16!r}")
    do_smooth = scheme.smooth if smooth is None else bool(smooth)
    if do_smooth and scheme.act_format is None:
        raise ValueError(f"smooth goes with schemes that quantize activations, not {scheme.name!r}")
    if isinstance(norm_tweak, bool) or not isinstance(norm_tweak, int) or norm_tweak < 0:
        raise ValueError(f"norm_tweak must be a whole number of steps >= 0, got {norm_tweak!r}")
    needs_data = scheme.static_activations or do_smooth or kv_cache or gptq or awq or keep_bf16 > 0 or norm_tweak > 0
    report = PTQReport(scheme.name, kv_cache=kv_cache, calibration=calibration if needs_data else None)
    skip = _default_skip(model)
    targets: list[str] = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear and type(module) is not FP8Linear:
            continue
        reason = (
            (None if module_filter(name, module) else "excluded by module_filter")
            if module_filter
            else skip(name, module)
        )
        if reason:
            report.skipped[name] = reason
        else:
            targets.append(name)
    if not targets:
        raise ValueError(
            "no nn.Linear layer to quantize"
            + (" (the module_filter matched none)" if module_filter else " in this model")
        )
    if keep_bf16 >= len(targets):
        raise ValueError(f"keep_bf16={keep_bf16} would keep all {len(targets)} quantizable layers: give fewer")
    was_training = model.training
    model.eval()
    amax: dict[str, float] = {}
    trained = _trained_input_amax(model, targets) if scheme.name == "fp8" else {}
    if trained and len(trained) == len(targets) and not (kv_cache or gptq or keep_bf16 or norm_tweak):
        # every layer was trained with delayed scaling: reuse its amax history, no calibration needed
        needs_data = False
        amax = trained
        report.calibration = "trained delayed-scaling amax history"
    elif needs_data:
        if forward_loop is None:
            what = next(
                (
                    k
                    for k, v in (("gptq", gptq), ("awq", awq), ("keep_bf16", keep_bf16), ("norm_tweak", norm_tweak))
                    if v
                ),
                None,
            )
            raise ValueError(
                f"{what + ' needs calibration data' if what else f'scheme {scheme.name!r} has static scales'}"
                f"{' (with fp8-kv)' if kv_cache else ''}: pass "
                "forward_loop=lambda m: [m(x) for x in calibration_batches]"
            )
        if awq:
            from .awq import apply_awq

            report.awq = apply_awq(model, find_mappings(model, set(targets)), forward_loop, scheme)
        search = do_smooth and alpha == "search"
        observers = observe_inputs(model, targets, forward_loop, keep_rows=ROWS_PER_BATCH if search else 0)
        if do_smooth:
            mappings = find_mappings(model, set(targets))
            if search:
                rows = {m.targets[0]: observers[m.targets[0]].rows() for m in mappings}
                report.smooth_alpha = apply_smoothing_search(model, mappings, observers, rows, scheme)
            else:
                apply_smoothing(model, mappings, observers, alpha)
                report.smooth_alpha = dict.fromkeys((m.source for m in mappings), float(alpha))
            report.smoothed = [src for src, a in report.smooth_alpha.items() if a is not None]
            if mappings:  # the smoothed inputs have new ranges: observe again
                observers = observe_inputs(model, targets, forward_loop)
        blocks = enable_fp8_kv(model, "observe") if kv_cache else None
        if scheme.static_activations or blocks is not None:
            if blocks is not None:  # one more pass records the post-RoPE k/v amax
                with torch.no_grad():
                    forward_loop(model)
                finish_calibration(blocks, calibration, percentile)
            if scheme.static_activations:
                for name in targets:
                    amax[name] = choose_amax(observers[name], scheme.act_format, calibration, percentile)
    hessians = {}
    if gptq:
        from .gptq import collect_hessians

        hessians = collect_hessians(model, targets, forward_loop)
        report.gptq = True
    qmods: dict[str, QuantLinear] = {}
    for name in targets:
        linear = model.get_submodule(name)
        if gptq:
            from .gptq import gptq_linear

            qmods[name] = gptq_linear(linear, hessians.pop(name), scheme, amax.get(name))
        else:
            qmods[name] = QuantLinear.from_linear(linear, scheme, amax.get(name))
    if keep_bf16:
        from .layer_error import rank_by_fisher, rank_by_output_error

        # causal LMs: one pass with gradients; other models: one forward_loop per layer
        report.sensitivity = rank_by_fisher(model, qmods, forward_loop) or rank_by_output_error(
            model, qmods, forward_loop
        )
        for item in report.sensitivity[:keep_bf16]:
            report.skipped[item.name] = f"kept in high precision: among the {keep_bf16} most sensitive (keep_bf16)"
            del qmods[item.name]
            amax.pop(item.name, None)
    originals = {} if _originals is None else _originals
    for name, q in qmods.items():
        originals[name] = model.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, q)
        report.quantized.append(name)
    report.input_amax = amax
    if norm_tweak:
        from .norm_tweak import tweak_norms

        report.norm_tweak = tweak_norms(
            model, {n: originals[n] for n in qmods}, forward_loop, norm_tweak, norm_tweak_lr
        )
    model.train(was_training)
    object.__setattr__(model, "ptq_report", report)
    return model
