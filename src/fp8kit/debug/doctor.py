"""``fp8kit.debug.doctor``: run FP8 beside BF16 and find where, when and why they part.

Both copies of the model start from the same weights and see the same batches with the same
optimizer. Every step the doctor records the two losses, each converted layer's output error of FP8
relative to BF16 (propagated through the network), the weight-gradient error, and the inspector's
per-operand statistics of the FP8 copy (local: what quantizing that operand did). It then sorts the
problem into NVIDIA's three kinds, names the culprits and ranks fixes:

* ``spike``: the FP8 loss jumps (robust z-score); if BF16 spikes at the same step it is not FP8's fault;
* ``divergence``: FP8 loss becomes non-finite or leaves BF16 (> ``divergence_tol``); early divergence
  points at a software bug (e.g. a wrong scale), later divergence at numerics;
* ``gap``: FP8 trains but its final loss stays above BF16's by more than ``gap_tol``.

Culprits are (layer, operand, first step) where an operand's SQNR drops ``drop_db`` below its own
history, where it falls under ``floor_db``, or where saturation or underflow appears; the earliest
step comes first and, within a step, the layer that runs first. The run is ``healthy`` when the loss
shows none of the three problems; anomalies without a loss effect are still listed, and fixes are
recommended only for a problem.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..nn import convert, to_bf16_gemms
from ..nn.linear import Linear as FP8Linear
from ..recipes import CurrentScaling, DelayedScaling, Recipe, recipe_from_name
from .detectors import NaNDetector, SpikeDetector
from .inspector import Inspector

__all__ = ["DEFAULT_LR", "DEFAULT_STEPS", "Culprit", "DoctorReport", "Recommendation", "default_loss", "doctor"]

DEFAULT_STEPS = 30  # steps of each copy (``fp8kit doctor --steps``)
DEFAULT_LR = 2e-3  # AdamW learning rate: the demo model's peak rate in ``fp8kit train`` (tests hold them equal)


@dataclass
class Culprit:
    layer: str
    operand: str
    step: int
    reason: str
    severity: float  # dB of SQNR lost (or an equivalent), larger is worse


@dataclass
class Recommendation:
    action: str
    fix: dict[str, Any]  # {"type": "bf16_layers", "layers": [...]} | {"type": "recipe", "recipe": "..."} | ...
    why: str


@dataclass
class DoctorReport:
    healthy: bool
    kind: str
    culprits: list[Culprit]
    recommendations: list[Recommendation]
    summary: str
    recipe: str
    steps: int
    losses: dict[str, list[float]]
    layer_error: dict[str, list[float]]  # layer -> per-step relative output error (FP8 vs BF16)
    grad_error: dict[str, list[float]]  # layer -> per-step relative weight-gradient error
    stats: list[dict[str, Any]] = field(repr=False, default_factory=list)
    first_nonfinite: dict[str, Any] | None = None
    spikes: dict[str, list[int]] = field(default_factory=dict)
    applied: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("stats")
        return d

    def save(self, out_dir: str | Path) -> Path:
        """Write ``report.md`` (with PNG plots), ``report.json`` and ``fp8_stats.jsonl`` to ``out_dir``."""
        from .report import write_report

        return write_report(self.to_dict(), self.stats, Path(out_dir))


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The output's ``.loss`` (Hugging Face models given labels), else the mean of the output."""
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    if hasattr(out, "loss") and out.loss is not None:
        return out.loss
    if hasattr(out, "logits"):
        out = out.logits
    if not isinstance(out, torch.Tensor):
        raise TypeError("doctor: the model output has no .loss and is not a tensor; pass loss_fn=")
    return out.float().mean()


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    den = float(b.norm())
    num = float((a - b).norm())
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _capture_outputs(model: nn.Module, names: list[str], store: dict[str, torch.Tensor], order: list[str]):
    hooks = []
    for name in names:

        def hook(_m, _a, out, name=name):
            if isinstance(out, torch.Tensor):
                store[name] = out.detach()
                if name not in order:
                    order.append(name)

        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    return hooks


def _train_pair(
    model: nn.Module,
    batches: list[Any],
    recipe: Recipe,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    lr: float,
    module_filter: Callable[[str, nn.Module], bool] | None,
    prepare_fp8: Callable[[nn.Module], None] | None,
    seed: int,
) -> dict[str, Any]:
    torch.manual_seed(seed)
    ref = to_bf16_gemms(copy.deepcopy(model))
    fp8 = convert(copy.deepcopy(model), recipe, module_filter)
    to_bf16_gemms(fp8)
    names = [n for n, m in fp8.named_modules() if isinstance(m, FP8Linear)]
    if not names:
        raise ValueError(
            "doctor: no layer was converted to FP8 ("
            + ("the module_filter matched nothing" if module_filter else "the model has no eligible nn.Linear")
            + ")"
        )
    if prepare_fp8 is not None:
        prepare_fp8(fp8)
    ref.train()
    fp8.train()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt_fp8 = torch.optim.AdamW(fp8.parameters(), lr=lr)
    losses: dict[str, list[float]] = {"bf16": [], "fp8": []}
    layer_error: dict[str, list[float]] = {n: [] for n in names}
    grad_error: dict[str, list[float]] = {n: [] for n in names}
    order: list[str] = []
    out_ref: dict[str, torch.Tensor] = {}
    out_fp8: dict[str, torch.Tensor] = {}
    hooks = _capture_outputs(ref, names, out_ref, []) + _capture_outputs(fp8, names, out_fp8, order)
    stopped = None
    try:
        with Inspector(fp8, every=1, tensorboard=False) as insp, NaNDetector(fp8) as nan:
            for step, batch in enumerate(batches):
                insp.current_step = step
                nan.current_step = step
                loss_r = loss_fn(ref, batch)
                loss_f = loss_fn(fp8, batch)
                losses["bf16"].append(loss_r.item())
                losses["fp8"].append(loss_f.item())
                for n in names:
                    layer_error[n].append(
                        _relerr(out_fp8[n], out_ref[n]) if n in out_fp8 and n in out_ref else math.nan
                    )
                loss_r.backward()
                if math.isfinite(losses["fp8"][-1]):
                    loss_f.backward()
                for n in names:
                    gr, gf = ref.get_submodule(n).weight.grad, fp8.get_submodule(n).weight.grad
                    grad_error[n].append(_relerr(gf, gr) if gr is not None and gf is not None else math.nan)
                for o in (opt_ref, opt_fp8):
                    torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 1.0)
                    o.step()
                    o.zero_grad(set_to_none=True)
                if not math.isfinite(losses["fp8"][-1]):
                    stopped = step
                    break
        first_nonfinite = nan.first
    finally:
        for h in hooks:
            h.remove()
    return {
        "losses": losses,
        "layer_error": layer_error,
        "grad_error": grad_error,
        "stats": insp.records,
        "order": order,
        "first_nonfinite": first_nonfinite,
        "stopped": stopped,
        "names": names,
    }


def _find_culprits(stats: list[dict[str, Any]], order: list[str], drop_db: float, floor_db: float) -> list[Culprit]:
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in stats:
        if r["recipe"] == "actual":
            series.setdefault((r["layer"], r["operand"]), []).append(r)
    found: list[Culprit] = []
    for (layer, operand), recs in series.items():
        recs.sort(key=lambda r: r["step"])
        for i, r in enumerate(recs):
            prev = [p["sqnr_db"] for p in recs[max(0, i - 10) : i] if math.isfinite(p["sqnr_db"])]
            sq = r["sqnr_db"]
            reason, severity = None, 0.0
            sat = r["saturation_pct"]
            prev_sat = statistics.median([p["saturation_pct"] for p in recs[max(0, i - 10) : i]]) if i else 0.0
            prev_uf = statistics.median([p["underflow_pct"] for p in recs[max(0, i - 10) : i]]) if i else 0.0
            if r.get("nonfinite", 0):
                reason, severity = "non-finite values", 100.0
            elif len(prev) >= 3 and sq < statistics.median(prev) - drop_db:
                reason, severity = (
                    f"SQNR fell {statistics.median(prev) - sq:.1f} dB to {sq:.1f} dB",
                    statistics.median(prev) - sq,
                )
            elif sq < floor_db:
                reason, severity = f"SQNR {sq:.1f} dB is below {floor_db:.0f} dB", floor_db - sq
            elif sat > 5.0 and sat > 10 * prev_sat:
                reason, severity = f"{sat:.2f}% of values saturate", sat
            elif r["underflow_pct"] > 20 and r["underflow_pct"] > 5 * max(prev_uf, 1.0):
                reason, severity = (
                    f"{r['underflow_pct']:.1f}% of non-zero values underflow to zero",
                    r["underflow_pct"] / 5,
                )
            if reason is None:
                continue
            details = [f"saturation {sat:.2f}%", f"underflow {r['underflow_pct']:.1f}%"]
            if "staleness" in r:
                details.append(f"amax/scale-amax {r['staleness']:.3g}")
            found.append(Culprit(layer, operand, r["step"], f"{reason} ({', '.join(details)})", float(severity)))
            break  # the first anomaly of this operand
    rank = {n: i for i, n in enumerate(order)}
    # within a step: forward operands in execution order, then gradients in backward (reverse) order
    found.sort(
        key=lambda c: (
            c.step,
            c.operand == "grad",
            (-1 if c.operand == "grad" else 1) * rank.get(c.layer, len(rank)),
            -c.severity,
        )
    )
    return found


def _final_gap(losses: dict[str, list[float]]) -> float:
    """FP8 over BF16 loss, relative, on the mean of the last fifth of the steps."""
    lf, lr = losses["fp8"], losses["bf16"]
    tail = max(1, len(lr) // 5)
    mean_f, mean_r = sum(lf[-tail:]) / tail, sum(lr[-tail:]) / tail
    return (mean_f - mean_r) / abs(mean_r) if mean_r else math.inf


def _classify(run: dict[str, Any], gap_tol: float, divergence_tol: float, spike_z: float) -> tuple[str, str, dict]:
    lf, lr = run["losses"]["fp8"], run["losses"]["bf16"]
    n = len(lr)
    spikes: dict[str, list[int]] = {}
    for key, series in (("fp8", lf), ("bf16", lr)):
        det = SpikeDetector(window=20, threshold=spike_z, min_history=min(5, max(3, n // 4)))
        spikes[key] = [s.step - 1 for s in (det.update(v) for v in series) if s is not None]
    gap = _final_gap(run["losses"])
    bad_ref = next((i for i, v in enumerate(lr) if not math.isfinite(v)), None)
    if bad_ref is not None:
        return "divergence", f"BF16 too becomes non-finite at step {bad_ref}: not FP8's fault", spikes
    if run["stopped"] is not None or not math.isfinite(gap) or gap > divergence_tol:
        step = (
            run["stopped"]
            if run["stopped"] is not None
            else next((i for i in range(n) if (lf[i] - lr[i]) / abs(lr[i]) > divergence_tol), n - 1)
        )
        when = "early" if step < max(3, n // 10) else "late"
        hint = "points at a software bug (a wrong scale or format)" if when == "early" else "points at numerics"
        return "divergence", f"FP8 diverges from BF16 at step {step} ({when}: {hint})", spikes
    fp8_only = [s for s in spikes["fp8"] if not any(abs(s - b) <= 1 for b in spikes["bf16"])]
    if spikes["fp8"]:
        if fp8_only:
            return "spike", f"FP8 loss spikes at steps {fp8_only} that BF16 does not have", spikes
        return "spike", f"loss spikes at steps {spikes['fp8']} in BF16 too: not FP8's fault (data or LR)", spikes
    if gap > gap_tol:
        return "gap", f"FP8 ends {100 * gap:.2f}% above BF16 (tolerance {100 * gap_tol:.1f}%)", spikes
    return "none", f"FP8 tracks BF16 (final gap {100 * gap:+.2f}%)", spikes


def _recommend(culprits: list[Culprit], recipe: Recipe, fp8_layers: list[str]) -> list[Recommendation]:
    recs: list[Recommendation] = []
    outside = [c for c in culprits if c.layer not in fp8_layers]
    if outside:
        c = outside[0]
        recs.append(
            Recommendation(
                f"look at {c.layer!r} ({c.operand}, step {c.step}): it is not an FP8 layer, so its {c.reason} "
                "comes from the model or the data, not from FP8",
                {"type": "manual"},
                "the first anomaly appears outside the converted layers",
            )
        )
    culprits = [c for c in culprits if c.layer in fp8_layers]
    if not culprits:
        return recs
    top = culprits[0]
    layers = list(dict.fromkeys(c.layer for c in culprits[:3]))
    recs.append(
        Recommendation(
            f"keep {', '.join(layers)} in BF16: fp8kit.convert(model, recipe, module_filter=lambda n, m: n not in "
            f"{layers!r})",
            {"type": "bf16_layers", "layers": layers},
            f"{top.layer} {top.operand}: {top.reason}",
        )
    )
    stale = "amax/scale-amax" in top.reason and ("saturate" in top.reason or "fell" in top.reason)
    if isinstance(recipe, DelayedScaling):
        recs.append(
            Recommendation(
                "switch to current scaling (fp8kit.CurrentScaling()): the scale follows this step's amax",
                {"type": "recipe", "recipe": "current"},
                "delayed scaling reuses an amax history that a sudden change outgrows"
                if stale
                else "a per-step scale removes stale-scale saturation",
            )
        )
    if "underflow" in top.reason or "fell" in top.reason:
        recs.append(
            Recommendation(
                "use block scaling (fp8kit.BlockScaling(): 1x128 activation tiles) so an outlier channel "
                "sets the scale of its own tiles only",
                {"type": "recipe", "recipe": "block"},
                "one large channel stretches a per-tensor range and pushes the rest toward underflow",
            )
        )
    if top.operand == "input" and top.layer.endswith(("down_proj", "fc2", "w2")):
        recs.append(
            Recommendation(
                "smooth the outlier channel before quantizing (Smooth-SwiGLU: per-channel scale on the "
                "SwiGLU output folded into the down projection)",
                {"type": "manual"},
                "SwiGLU outputs grow outlier channels late in training (Fishman et al., 2024)",
            )
        )
    if isinstance(recipe, DelayedScaling):
        recs.append(
            Recommendation(
                f"shorten the amax history (amax_history_len=16 instead of {recipe.amax_history_len}) or add margin=1",
                {"type": "recipe", "recipe": "delayed", "amax_history_len": 16, "margin": 1},
                "a shorter window adapts faster; a margin leaves headroom above the amax",
            )
        )
    return recs


def _fix_kwargs(fix: dict[str, Any], recipe: Recipe, module_filter):
    if fix["type"] == "bf16_layers":
        skip = set(fix["layers"])
        base = module_filter

        def filt(name: str, m: nn.Module) -> bool:
            return name not in skip and (base(name, m) if base else True)

        return recipe, filt
    if fix["type"] == "recipe":
        if fix["recipe"] == "delayed":
            return DelayedScaling(amax_history_len=fix["amax_history_len"], margin=fix["margin"]), module_filter
        if fix["recipe"] == "current":
            return CurrentScaling(), module_filter
        return recipe_from_name(fix["recipe"]), module_filter
    raise ValueError(f"doctor cannot apply a {fix['type']!r} fix automatically")


def doctor(
    model: nn.Module,
    batches: Iterable[Any],
    recipe: Recipe | str | None = None,
    steps: int = DEFAULT_STEPS,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    *,
    lr: float = DEFAULT_LR,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
    prepare_fp8: Callable[[nn.Module], None] | None = None,
    apply: bool = False,
    gap_tol: float = 0.02,
    divergence_tol: float = 0.25,
    drop_db: float = 10.0,
    floor_db: float = 12.0,
    spike_z: float = 8.0,
    seed: int = 0,
) -> DoctorReport:
    """Diagnose FP8 training of ``model`` (a high-precision module; copied, never modified).

    Args:
        batches: model inputs (tensors or dicts); cycled if fewer than ``steps``.
        recipe: the FP8 recipe (default ``DelayedScaling()``), or its name.
        loss_fn: ``loss_fn(model, batch) -> scalar`` (default: ``.loss`` of the output, or its mean).
        module_filter: as in ``fp8kit.convert``.
        prepare_fp8: called once on the converted FP8 copy before training (to attach hooks).
        apply: re-run with the top recommended fix and store the outcome in ``report.applied``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    recipe = recipe_from_name(recipe) if isinstance(recipe, str) else (recipe or DelayedScaling())
    data = list(itertools.islice(itertools.cycle(list(batches)), steps)) if steps else []
    if not data:
        raise ValueError("doctor: no batches given")
    loss_fn = loss_fn or default_loss
    run = _train_pair(model, data, recipe, loss_fn, lr, module_filter, prepare_fp8, seed)
    kind, summary, spikes = _classify(run, gap_tol, divergence_tol, spike_z)
    culprits = _find_culprits(run["stats"], run["order"], drop_db, floor_db)
    if run["first_nonfinite"] is not None and not any(c.reason == "non-finite values" for c in culprits):
        f = run["first_nonfinite"]
        culprits.insert(0, Culprit(f["layer"], f["operand"], f["step"], "first non-finite value", 100.0))
    # fixes are recommended for problems the loss shows; anomalies without a loss effect (e.g. a delayed
    # scale one step stale while activations grow early in training) are listed but do not alarm
    recs = _recommend(culprits, recipe, run["names"]) if kind != "none" else []
    if kind == "none":
        summary += (
            f"; {len(culprits)} transient numerics anomalies logged, none with a loss effect"
            if culprits
            else "; no layer shows a numerics anomaly"
        )
    report = DoctorReport(
        healthy=kind == "none",
        kind=kind,
        culprits=culprits,
        recommendations=recs,
        summary=summary,
        recipe=recipe.kind,
        steps=len(run["losses"]["fp8"]),
        losses=run["losses"],
        layer_error=run["layer_error"],
        grad_error=run["grad_error"],
        stats=run["stats"],
        first_nonfinite=run["first_nonfinite"],
        spikes=spikes,
    )
    if apply and recs:
        top = next((r for r in recs if r.fix["type"] != "manual"), None)
        if top is not None:
            new_recipe, new_filter = _fix_kwargs(top.fix, recipe, module_filter)
            rerun = _train_pair(model, data, new_recipe, loss_fn, lr, new_filter, prepare_fp8, seed)
            kind2, summary2, _ = _classify(rerun, gap_tol, divergence_tol, spike_z)
            culprits2 = _find_culprits(rerun["stats"], rerun["order"], drop_db, floor_db)
            report.applied = {
                "fix": top.action,
                "gap_before": _final_gap(run["losses"]),
                "gap_after": _final_gap(rerun["losses"]),
                "kind_after": kind2,
                "summary_after": summary2,
                "culprits_after": [asdict(c) for c in culprits2[:5]],
                "losses_after": rerun["losses"],
            }
    return report
