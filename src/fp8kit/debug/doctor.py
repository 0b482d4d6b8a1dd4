"""``fp8kit.debug.doctor``: run FP8 beside BF16 and find where, when and why they part.

Both copies of the model start from the same weights and see the same batches with the same
optimizer. Every step the doctor records the two losses, each converted layer's output error of FP8
relative to BF16 (propagated through the network), the weight-gradient error, and the inspector's
per-operand statistics of the FP8 copy (local: what quantizing that operand did). The diagnosis
(``fp8kit.debug.diagnosis``) then sorts the problem into NVIDIA's three kinds, names the culprits and
ranks fixes:

* ``spike``: the FP8 loss jumps (robust z-score); if BF16 spikes at the same step it is not FP8's fault;
* ``divergence``: FP8 loss becomes non-finite or leaves BF16 (> ``divergence_tol``); early divergence
  points at a software bug (e.g. a wrong scale), later divergence at numerics;
* ``gap``: FP8 trains but its final loss stays above BF16's by more than ``gap_tol``.

Culprits are operands whose readings depart from their own clean history (SQNR ``drop_db`` below it),
fall under ``floor_db``, or saturate or underflow, ranked by severity times persistence (dB past the
threshold summed over the steps past it). When the loss shows none of the three problems, the run is
``latent`` if an operand's departure persists for most of the run or an early-warning signal grows toward
saturation (``fp8kit.debug.trends``): its culprits are those findings, and its fixes (``debug.fixes``)
carry the SQNR each gives on the recorded operand. Otherwise it is ``healthy``: no culprits, and its
departures listed as ``notes``, as are, in any run, the departures that score under ``marginal_db`` (a
reading at the edge of a threshold). Fixes are recommended only for a problem or a latent finding.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..nn import convert, to_bf16_gemms
from ..nn.attention import STATE_NAME, attention_states
from ..nn.experts import FP8Experts
from ..nn.linear import Linear as FP8Linear
from ..numerics.recipes import CurrentScaling, DelayedScaling, Recipe, recipe_from_name
from .detectors import NaNDetector
from .diagnosis import Culprit, Recommendation, diagnose, final_gap, recommend
from .fixes import latent_fixes, operand_layer
from .inspector import Inspector, expert_param_names
from .trends import Trend

__all__ = ["DEFAULT_LR", "DEFAULT_STEPS", "Culprit", "DoctorReport", "Recommendation", "default_loss", "doctor"]

DEFAULT_STEPS = 30  # steps of each copy (``fp8kit doctor --steps``)
DEFAULT_LR = 2e-3  # AdamW learning rate: the demo model's peak rate in ``fp8kit train`` (tests hold them equal)


@dataclass
class DoctorReport:
    healthy: bool
    kind: str  # "spike" | "divergence" | "gap" | "latent" | "none" (healthy)
    culprits: list[Culprit]  # most suspect first (latent: the latent findings); empty in a healthy run
    recommendations: list[Recommendation]
    summary: str
    recipe: str
    steps: int
    losses: dict[str, list[float]]  # "bf16", "fp8" and, with a noise floor, "bf16_nudged" per step
    layer_error: dict[str, list[float]]  # layer -> per-step relative output error (FP8 vs BF16)
    grad_error: dict[str, list[float]]  # layer -> per-step relative weight-gradient error
    stats: list[dict[str, Any]] = field(repr=False, default_factory=list)
    first_nonfinite: dict[str, Any] | None = None
    spikes: dict[str, list[int]] = field(default_factory=dict)
    applied: dict[str, Any] | None = None
    notes: list[Culprit] = field(default_factory=list)  # departures without a loss effect, or marginal ones
    trends: list[Trend] = field(default_factory=list)  # growing early-warning signals (``debug.trends``)

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


def _on_device(model: nn.Module, batches: Iterable[Any], device: torch.device) -> tuple[nn.Module, list[Any]]:
    """``model`` (a copy when it must move) and ``batches`` (tensors, or dicts of them) on ``device``."""
    if next(model.parameters()).device != device:
        model = copy.deepcopy(model).to(device)

    def move(b: Any) -> Any:
        if isinstance(b, torch.Tensor):
            return b.to(device)
        return {k: move(v) for k, v in b.items()} if isinstance(b, dict) else b

    return model, [move(b) for b in batches]


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


def _pair_models(
    model: nn.Module,
    recipe: Recipe,
    module_filter: Callable[[str, nn.Module], bool] | None,
    prepare_fp8: Callable[[nn.Module], None] | None,
    convert_kwargs: dict[str, Any] | None = None,
) -> tuple[nn.Module, nn.Module, list[str]]:
    """``(BF16 copy, FP8 copy, names of the FP8 layers)`` of ``model``, both in training mode."""
    ref = to_bf16_gemms(copy.deepcopy(model))
    fp8 = convert(copy.deepcopy(model), recipe, module_filter, **(convert_kwargs or {}))
    to_bf16_gemms(fp8)
    names = [n for n, m in fp8.named_modules() if isinstance(m, (FP8Linear, FP8Experts))]
    if not names:
        raise ValueError(
            "doctor: no layer was converted to FP8 ("
            + ("the module_filter matched nothing" if module_filter else "the model has no eligible nn.Linear")
            + ")"
        )
    if prepare_fp8 is not None:
        prepare_fp8(fp8)
    return ref.train(), fp8.train(), names


def _optimizer_step(opt: torch.optim.Optimizer) -> None:
    """Clip the gradients to norm 1, step, zero them (the doctor's update, the same for both copies)."""
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train_pair(
    model: nn.Module,
    batches: list[Any],
    recipe: Recipe,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    lr: float,
    module_filter: Callable[[str, nn.Module], bool] | None,
    prepare_fp8: Callable[[nn.Module], None] | None,
    seed: int,
    progress: bool = False,
    desc: str = "bf16 + fp8",
    convert_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train a BF16 and an FP8 copy of ``model`` in lockstep on ``batches``, recording per step both losses,
    each FP8 layer's output error and each weight's gradient error against the BF16 copy, and the
    inspector's statistics; stops at the first non-finite FP8 loss. ``progress``: a bar over the steps."""
    from ..runtime.progress import bar

    torch.manual_seed(seed)
    ref, fp8, names = _pair_models(model, recipe, module_filter, prepare_fp8, convert_kwargs)
    opts = (torch.optim.AdamW(ref.parameters(), lr=lr), torch.optim.AdamW(fp8.parameters(), lr=lr))
    losses: dict[str, list[float]] = {"bf16": [], "fp8": []}
    layer_error: dict[str, list[float]] = {n: [] for n in names}
    weights = _weights_by_name(fp8, names)  # per Linear its weight, per expert each of its 3-D weights' slice
    grad_error: dict[str, list[float]] = {n: [] for n in weights}
    order: list[str] = []
    out_ref: dict[str, torch.Tensor] = {}
    out_fp8: dict[str, torch.Tensor] = {}
    hooks = _capture_outputs(ref, names, out_ref, []) + _capture_outputs(fp8, names, out_fp8, order)
    stopped = None
    steps_bar = bar(len(batches), f"  doctor {desc}", "step", enabled=progress)
    try:
        with Inspector(fp8, every=1, tensorboard=False) as insp, NaNDetector(fp8) as nan:
            for step, batch in enumerate(batches):
                if steps_bar is not None:
                    steps_bar.update(1)
                insp.current_step = nan.current_step = step
                loss_r, loss_f = loss_fn(ref, batch), loss_fn(fp8, batch)
                losses["bf16"].append(loss_r.item())
                losses["fp8"].append(loss_f.item())
                for n in names:
                    both = n in out_fp8 and n in out_ref
                    layer_error[n].append(_relerr(out_fp8[n], out_ref[n]) if both else math.nan)
                loss_r.backward()
                if math.isfinite(losses["fp8"][-1]):
                    loss_f.backward()
                for n, (module, attr, e) in weights.items():
                    gr, gf = (_grad(m.get_submodule(module), attr, e) for m in (ref, fp8))
                    grad_error[n].append(_relerr(gf, gr) if gr is not None and gf is not None else math.nan)
                for opt in opts:
                    _optimizer_step(opt)
                if not math.isfinite(losses["fp8"][-1]):
                    stopped = step
                    break
        first_nonfinite = nan.first
    finally:
        for h in hooks:
            h.remove()
        if steps_bar is not None:
            steps_bar.close()
    return {
        "losses": losses,
        "layer_error": layer_error,
        "grad_error": grad_error,
        "stats": insp.records,
        "order": order,
        "first_nonfinite": first_nonfinite,
        "stopped": stopped,
        "names": names,
        "attention": [n.removesuffix(f".{STATE_NAME}") for n in attention_states(fp8)],
        "model": fp8,
        "last_batch": batches[min(len(losses["fp8"]), len(batches)) - 1],
    }


def _nudged_losses(
    model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], lr: float,
    layer: str, seed: int, progress: bool = False,
) -> list[float]:  # fmt: skip
    """The losses of a BF16 copy of ``model`` whose ``layer`` weight is moved to neighbouring bfloat16 values
    (each element one ulp up or down, at random), trained as the pair is: the run-to-run spread a gap is
    measured against. ``progress``: a bar over the steps."""
    from ..runtime.progress import bar

    torch.manual_seed(seed)
    ref = to_bf16_gemms(copy.deepcopy(model)).train()
    weight = next(p for p in ref.get_submodule(layer).parameters() if p.dim() >= 2)
    with torch.no_grad():
        bits = weight.to(torch.bfloat16).view(torch.int16)
        gen = torch.Generator().manual_seed(seed)
        step = (torch.randint(0, 2, bits.shape, generator=gen) * 2 - 1).to(torch.int16)
        step[(bits & 0x7FFF) == 0] = 1  # a zero moves to the smallest subnormal of its sign
        weight.copy_((bits + step).view(torch.bfloat16).to(weight.dtype))
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses = []
    steps_bar = bar(len(batches), "  doctor bf16 one ulp off", "step", enabled=progress)
    for batch in batches:
        loss = loss_fn(ref, batch)
        losses.append(loss.item())
        if steps_bar is not None:
            steps_bar.update(1)
        if not math.isfinite(losses[-1]):
            break
        loss.backward()
        _optimizer_step(opt)
    if steps_bar is not None:
        steps_bar.close()
    return losses


def _weights_by_name(model: nn.Module, names: list[str]) -> dict[str, tuple[str, str, int | None]]:
    """``{reported name: (module, parameter, expert or None)}``: a Linear's weight under the layer's name, each
    expert's weight of an experts module as ``"{module}[{e}].{weight}"`` (as the inspector names them)."""
    out: dict[str, tuple[str, str, int | None]] = {}
    for n in names:
        m = model.get_submodule(n)
        if isinstance(m, FP8Experts):
            for attr in expert_param_names(m):
                out.update({f"{n}[{e}].{attr}": (n, attr, e) for e in range(m.num_experts)})
        else:
            out[n] = (n, "weight", None)
    return out


def _grad(module: nn.Module, attr: str, expert: int | None) -> torch.Tensor | None:
    g = getattr(module, attr).grad
    return g if g is None or expert is None else g[expert]


def _fix_kwargs(fix: dict[str, Any], recipe: Recipe, module_filter, names: list[str]):
    """``(recipe or per-layer plan, module_filter, convert keywords)`` that apply ``fix``."""
    if fix["type"] == "bf16_layers":
        skip = set(fix["layers"])
        base = module_filter

        def filt(name: str, m: nn.Module) -> bool:
            return name not in skip and (base(name, m) if base else True)

        return recipe, filt, {}
    if fix["type"] == "recipe":
        if fix["recipe"] == "delayed":
            return DelayedScaling(amax_history_len=fix["amax_history_len"], margin=fix["margin"]), module_filter, {}
        if fix["recipe"] == "current":
            return CurrentScaling(), module_filter, {}
        return recipe_from_name(fix["recipe"]), module_filter, {}
    if fix["type"] == "layer_recipe":
        plan: dict[str, Recipe] = {n: recipe for n in names}
        plan.update(dict.fromkeys(fix["layers"], recipe_from_name(fix["recipe"])))
        return plan, module_filter, {}
    if fix["type"] == "smooth_swiglu":
        return recipe, module_filter, {"smooth_swiglu": True}
    if fix["type"] == "bf16_attention":
        kept = set(fix["blocks"])
        return recipe, module_filter, {"attention_filter": lambda name, m: name not in kept}
    raise ValueError(f"doctor cannot apply a {fix['type']!r} fix automatically")


@torch.no_grad()
def _capture_input(model: nn.Module, layer: str, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]):
    """``layer``'s input in one more forward of ``model`` on ``batch`` (the recorded operand)."""
    seen: dict[str, torch.Tensor] = {}
    handle = model.get_submodule(layer).register_forward_pre_hook(lambda _m, a: seen.setdefault("x", a[0].detach()))
    try:
        loss_fn(model, batch)
    finally:
        handle.remove()
    return seen.get("x")


def _clean_channel_sqnr(stats: list[dict[str, Any]], layer: str, before: int) -> float | None:
    """The median of ``layer``'s input median-channel SQNR readings before step ``before`` (None: none)."""
    vals = [
        r["channel_sqnr_db"]
        for r in stats
        if r["layer"] == layer and r["operand"] == "input" and r["recipe"] == "actual" and r["step"] < before
        and math.isfinite(r.get("channel_sqnr_db", math.nan))
    ]  # fmt: skip
    return sorted(vals)[len(vals) // 2] if vals else None


def _latent_recommendations(
    culprits: list[Culprit], run: dict[str, Any], recipe: Recipe, loss_fn: Callable[[nn.Module, Any], torch.Tensor]
) -> list[Recommendation]:
    """The ranked fixes of the first latent finding about an FP8 layer's input (``debug.fixes``); with none
    (a weight's or a gradient's), the fixes ``recommend`` gives a problem."""
    for c in culprits:
        layer = operand_layer(c, run["names"])
        if layer is None:
            continue
        x = _capture_input(run["model"], layer, run["last_batch"], loss_fn)
        if x is not None:
            clean = _clean_channel_sqnr(run["stats"], layer, c.step)
            return latent_fixes(c, layer, x, run["model"], recipe, clean)
    departures = [c for c in culprits if c.projected_step is None]
    return recommend(departures, recipe, run["names"], run["attention"]) if departures else []


def saturation_levels(recipe: Recipe) -> dict[str, float]:
    """The early-warning signals' saturation levels under ``recipe`` (``trends.find_trends``): under a
    per-tensor input scale, an outlier ratio of ``fmt.max / fmt.min_normal`` puts the median channel below
    the format's normal range; tile recipes give each tile its own scale, so the ratio has no such level."""
    if not recipe.per_tensor:
        return {}
    fmt = recipe.format_for("input")
    return {"outlier_ratio": fmt.max / fmt.min_normal}


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
    marginal_db: float = 3.0,
    seed: int = 0,
    device: str | torch.device | None = None,
    noise_floor: bool = False,
    progress: bool = False,
    attention: Any = None,
) -> DoctorReport:
    """Diagnose FP8 training of ``model`` (a high-precision module; copied, never modified).

    Args:
        batches: model inputs (tensors or dicts); cycled if fewer than ``steps``.
        recipe: the FP8 recipe (default ``DelayedScaling()``), or its name.
        loss_fn: ``loss_fn(model, batch) -> scalar`` (default: ``.loss`` of the output, or its mean).
        module_filter: as in ``fp8kit.convert``.
        prepare_fp8: called once on the converted FP8 copy before training (to attach hooks).
        apply: re-run with the top recommended fix (a recipe, layers in BF16, a tile recipe for one layer,
            Smooth-SwiGLU) and store the outcome in ``report.applied``.
        gap_tol, divergence_tol: relative loss excess of FP8 over BF16 that makes a gap, a divergence.
        drop_db, floor_db: an operand departs when its SQNR falls ``drop_db`` below its own clean
            history or under ``floor_db``.
        marginal_db: a departure scoring less (dB past the threshold summed over its steps) is a note.
        spike_z: robust z-score of a loss spike.
        device: where both copies train (default: where ``model`` is); batches follow.
        noise_floor: also train a BF16 copy with one layer's weights one ulp off (``losses["bf16_nudged"]``): a gap
            within ``NOISE_FACTOR`` times its final gap is the run-to-run spread, not FP8's (a third run).
        progress: a bar over the steps of each run, on stderr (``fp8kit.runtime.progress``).
        attention: FP8 attention in the FP8 copy too (``fp8kit.convert``'s ``attention``: ``"fp8"``, ...); its
            operands are watched as the layers' are, and a departure there is fixed by BF16 attention in the
            blocks named.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if marginal_db < 0:
        raise ValueError(f"marginal_db must be >= 0 (dB past a threshold), got {marginal_db}")
    recipe = recipe_from_name(recipe) if isinstance(recipe, str) else (recipe or DelayedScaling())
    if device is not None:
        model, batches = _on_device(model, batches, torch.device(device))
    data = list(itertools.islice(itertools.cycle(list(batches)), steps)) if steps else []
    if not data:
        raise ValueError("doctor: no batches given")
    loss_fn = loss_fn or default_loss
    limits = {
        "gap_tol": gap_tol,
        "divergence_tol": divergence_tol,
        "spike_z": spike_z,
        "drop_db": drop_db,
        "floor_db": floor_db,
        "marginal_db": marginal_db,
        "saturation": saturation_levels(recipe),
    }
    base_kwargs = {"attention": attention} if attention is not None else {}
    run = _train_pair(
        model, data, recipe, loss_fn, lr, module_filter, prepare_fp8, seed, progress, "bf16 + fp8", base_kwargs
    )
    if noise_floor:
        run["losses"]["bf16_nudged"] = _nudged_losses(model, data, loss_fn, lr, run["names"][0], seed, progress)
    found = diagnose(run, **limits)
    # fixes are recommended for problems the loss shows and for latent findings; departures without a loss
    # effect that recover (e.g. a delayed scale one step stale while gradients grow after the first update)
    # are notes and do not alarm
    if found.kind == "latent":
        recs = _latent_recommendations(found.culprits, run, recipe, loss_fn)
    else:
        recs = recommend(found.culprits, recipe, run["names"], run["attention"]) if found.kind != "none" else []
    report = DoctorReport(
        healthy=found.kind == "none",
        kind=found.kind,
        culprits=found.culprits,
        recommendations=recs,
        summary=found.summary,
        recipe=recipe.kind,
        steps=len(run["losses"]["fp8"]),
        losses=run["losses"],
        layer_error=run["layer_error"],
        grad_error=run["grad_error"],
        stats=run["stats"],
        first_nonfinite=run["first_nonfinite"],
        spikes=found.spikes,
        notes=found.notes,
        trends=found.trends,
    )
    if apply and recs:
        top = next((r for r in recs if r.fix["type"] != "manual"), None)
        if top is not None:
            new_recipe, new_filter, kwargs = _fix_kwargs(top.fix, recipe, module_filter, run["names"])
            kwargs = base_kwargs | kwargs
            rerun = _train_pair(
                model, data, new_recipe, loss_fn, lr, new_filter, prepare_fp8, seed, progress, "fix", kwargs
            )
            if noise_floor:  # the BF16 copies train as before: the same spread
                rerun["losses"]["bf16_nudged"] = run["losses"]["bf16_nudged"]
            after = diagnose(rerun, **limits)
            report.applied = {
                "fix": top.action,
                "gap_before": final_gap(run["losses"]),
                "gap_after": final_gap(rerun["losses"]),
                "kind_after": after.kind,
                "summary_after": after.summary,
                "culprits_after": [asdict(c) for c in after.culprits[:5]],
                "healthy_after": after.kind == "none",
                "losses_after": rerun["losses"],
            }
    return report
