"""``fp8kit.ptq.quantize``: post-training quantization of a model's ``nn.Linear`` layers and MoE experts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..nn.attention import AttentionRecipe, attention_recipe, calibrate_fp8_attention, enable_fp8_attention
from ..nn.convert import is_output_head
from ..nn.linear import Linear as FP8Linear
from ..nn.linear_like import as_linear, is_conv1d, linear_dims, linear_like_why_not, weights_read_outside
from ..nn.towers import find_towers
from ..numerics.recipes import DelayedScaling
from ..numerics.scaling import nvfp4_tensor_scale, parse_granularity
from .calibrate import CALIBRATION_METHODS, InputObserver, choose_amax, observe_inputs
from .experts import ExpertsObserver, find_experts, fp4_experts_problem, observe_experts, quantize_experts_module
from .kv_cache import enable_fp8_kv, finish_calibration
from .linear import QuantLinear
from .progress import Progress
from .report import PTQReport
from .schemes import Scheme, get_scheme
from .smoothquant import apply_smoothing, apply_smoothing_search, find_mappings

__all__ = ["PIPELINE", "PTQOptions", "PTQReport", "plan_line", "quantize"]

ROWS_PER_BATCH = 64  # calibration tokens per batch kept for the SmoothQuant alpha search


_GATE = "MoE gate (kept in high precision, as vLLM and llm-compressor do)"


def _default_skip(model: nn.Module, towers: bool = False) -> Callable[[str, nn.Module], str | None]:
    """Reason the default layer choice keeps a layer in high precision: the output head, the gates beside MoE
    experts (a router, or a shared expert's one-output gate, as Qwen2-MoE's ``shared_expert_gate``), and a
    multimodal model's vision/audio towers and projectors (``nn.towers``) unless ``towers``; else ``None``."""
    head = is_output_head(model)
    found = None if towers else find_towers(model)
    gates = _moe_gates(model)

    def why(name: str, module: nn.Module) -> str | None:
        if head(name, module):
            return "output head (kept in high precision, as ModelOpt and llm-compressor do)"
        if name in gates:
            return _GATE
        return found.why_kept(name) if found is not None else None

    return why


def _moe_gates(model: nn.Module) -> set[str]:
    """The Linear layers beside an experts module that gate rather than transform: its router ``gate`` and
    any sibling with a single output (a shared expert's gate)."""
    gates = set()
    for name in find_experts(model):
        parent = name.rpartition(".")[0]
        for child_name, child in (model.get_submodule(parent) if parent else model).named_children():
            weight = getattr(child, "weight", None)
            one_output = isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == 1
            if isinstance(child, nn.Linear) and (child_name == "gate" or one_output):
                gates.add(f"{parent}.{child_name}" if parent else child_name)
    return gates


def _trained_input_amax(model: nn.Module, targets: list[str]) -> dict[str, float]:
    """Input amax of layers trained by ``fp8kit.convert`` with delayed scaling (max of the history)."""
    out: dict[str, float] = {}
    for name in targets:
        m = model.get_submodule(name)
        if isinstance(m, FP8Linear) and isinstance(m.recipe, DelayedScaling) and int(m.fp8_seen[0]) > 0:
            out[name] = float(m.fp8_amax_history[0].max())
    return out


@dataclass(frozen=True)
class PTQOptions:
    """The switches of one ``quantize`` call (documented there), checked against the scheme by ``check``."""

    calibration: str = "max"
    percentile: float = 99.99
    alpha: float | str = 0.5
    smooth: bool | None = None
    kv_cache: bool = False
    module_filter: Callable[[str, nn.Module], bool] | None = None
    gptq: bool = False
    awq: bool = False
    keep_bf16: int = 0
    norm_tweak: int = 0
    norm_tweak_lr: float = 1e-3
    towers: bool = False

    def check(self, scheme: Scheme) -> None:
        """One clear error for a switch that does not fit ``scheme`` or is out of range."""
        if self.towers and self.module_filter is not None:
            raise ValueError(
                "towers=True changes the default layer choice, which module_filter replaces: give one of them "
                "(module_filter alone chooses the towers' layers too)"
            )
        if self.calibration not in CALIBRATION_METHODS:
            raise ValueError(
                f"unknown calibration method {self.calibration!r}; accepted: {', '.join(CALIBRATION_METHODS)}"
            )
        if scheme.act_strategy == "nvfp4" and self.calibration == "mse":
            raise ValueError(
                f"{scheme.name} calibrates its activations' per-tensor scale only (the 1x16 block scales follow "
                "the data at run time): use calibration 'max' (ModelOpt's and llm-compressor's) or 'percentile'"
            )
        if self.kv_cache and not scheme.is_fp8:
            raise ValueError(f"kv_cache (fp8-kv) goes with the FP8 schemes, not {scheme.name!r}")
        if self.awq and scheme.act_format is not None:
            raise ValueError(f"awq goes with the weight-only scheme (int8-weight-only), not {scheme.name!r}")
        a = self.alpha
        if not (a == "search" or (isinstance(a, (int, float)) and 0 <= a <= 1)):
            raise ValueError(f"alpha must be a number in [0, 1] or 'search', got {a!r}")
        if isinstance(self.keep_bf16, bool) or not isinstance(self.keep_bf16, int) or self.keep_bf16 < 0:
            raise ValueError(f"keep_bf16 must be a whole number >= 0, got {self.keep_bf16!r}")
        if self.smooth_for(scheme) and scheme.act_format is None:
            raise ValueError(f"smooth goes with schemes that quantize activations, not {scheme.name!r}")
        if isinstance(self.norm_tweak, bool) or not isinstance(self.norm_tweak, int) or self.norm_tweak < 0:
            raise ValueError(f"norm_tweak must be a whole number of steps >= 0, got {self.norm_tweak!r}")

    def smooth_for(self, scheme: Scheme) -> bool:
        """Whether SmoothQuant folds run: ``smooth``, or the scheme's own choice when it is ``None``."""
        return scheme.smooth if self.smooth is None else bool(self.smooth)

    def needs_data(self, scheme: Scheme) -> bool:
        """Whether the run needs ``forward_loop`` (static scales, folds, GPTQ/AWQ, ranking, norm tweaking)."""
        return (
            scheme.static_activations
            or self.smooth_for(scheme)
            or self.kv_cache
            or self.gptq
            or self.awq
            or self.keep_bf16 > 0
            or self.norm_tweak > 0
        )


UNREACHED = (
    "never ran during calibration (the forward_loop does not reach it, e.g. a vision or encoder part fed no input), "
    "so no static input scale: kept in high precision"
)


@dataclass
class _Run:
    """What the steps of one ``quantize`` call share: the inputs, and what each step leaves for the next."""

    model: nn.Module
    scheme: Scheme
    forward_loop: Callable[[nn.Module], object] | None
    opts: PTQOptions
    report: PTQReport
    progress: Progress
    calibrating: bool = False  # runs forward_loop (not a data-free run, nor one with trained amax)
    targets: list[str] = field(default_factory=list)  # the Linear layers to quantize
    observers: dict[str, InputObserver] = field(default_factory=dict)  # their calibrated inputs
    amax: dict[str, float] = field(default_factory=dict)  # their static input amax
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # GPTQ's 2 X^T X / N
    qmods: dict[str, QuantLinear] = field(default_factory=dict)  # their quantized replacements
    originals: dict[str, nn.Module] = field(default_factory=dict)  # the modules the replacements replaced
    experts: list[str] = field(default_factory=list)  # the MoE experts modules to quantize
    expert_observers: dict[str, ExpertsObserver] = field(default_factory=dict)
    expert_amax: dict[str, tuple[float, float]] = field(default_factory=dict)  # (gate_up, down) input amax
    expert_hessians: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # GPTQ


@dataclass(frozen=True)
class _Step:
    """One named step of the pipeline: when it runs, what it does, and what it says it will do (for the plan
    line) and cost (in passes over the calibration data, for the estimate)."""

    name: str
    runs: Callable[[_Run], bool]
    apply: Callable[[_Run], None]
    plan: Callable[[_Run], str]
    passes: Callable[[_Run], float] = lambda r: 0.0


def _fp4_misfit(scheme: Scheme, module: nn.Module) -> str | None:
    """Why an FP4 scheme leaves ``module`` in high precision (its input dim is not a whole number of blocks)."""
    if not scheme.is_fp4:
        return None
    in_features = linear_dims(module)[0]
    block = parse_granularity(scheme.weight_granularity).block_shape(1, in_features)[1]
    if in_features % block:
        return f"in_features {in_features} is not a multiple of {scheme.name}'s {block}-element blocks"
    return None


def _conv1d_misfit(scheme: Scheme, module: nn.Module) -> str | None:
    """Why ``scheme`` leaves a ``Conv1D`` (weight stored ``(in, out)``) in high precision: a checkpoint's
    blocks run along the stored rows' last dim, the layer's outputs, not its inputs."""
    if is_conv1d(module) and (scheme.is_fp4 or scheme.weight_strategy == "block"):
        return (
            f"Conv1D stores its weight (in, out): {scheme.name}'s weight blocks in the checkpoint would run along "
            "its outputs (use an fp8 or int8 scheme for it)"
        )
    return None


def layer_scheme(scheme: Scheme, module: nn.Module) -> Scheme:
    """The scheme a layer is quantized in: ``scheme``, but per-tensor weights for a ``Conv1D`` under a per-channel
    scheme (its checkpoint stores the weight ``(in, out)``, and compressed-tensors' per-channel scales run along
    the stored rows, the layer's inputs: one scale per tensor is what every reader applies right)."""
    if is_conv1d(module) and scheme.weight_strategy == "channel":
        return dataclasses.replace(scheme, weight_strategy="tensor")
    return scheme


def _select_layers(run: _Run) -> None:
    """The Linear layers to quantize (``module_filter``, or all but the output head); the rest are reported."""
    model, opts, report = run.model, run.opts, run.report
    skip = _default_skip(model, opts.towers)
    read_outside = weights_read_outside(model)
    for name, module in model.named_modules():
        linear = type(module) is nn.Linear or isinstance(module, FP8Linear) or is_conv1d(module)
        subclass = isinstance(module, nn.Linear) and not type(module).__module__.startswith("fp8kit.")
        if not (linear or subclass):
            continue
        reason = (
            (None if opts.module_filter(name, module) else "excluded by module_filter")
            if opts.module_filter
            else skip(name, module)
        )
        reason = reason or _conv1d_misfit(run.scheme, module) or _fp4_misfit(run.scheme, module)
        reason = reason or (None if linear else linear_like_why_not(module)) or read_outside.get(name)
        if reason:
            report.skipped[name] = reason
        else:
            run.targets.append(name)
    for name, module in find_experts(model).items():
        tower = None if opts.module_filter else skip(name, module)
        keep = opts.module_filter(name, module) if opts.module_filter else tower is None
        misfit = fp4_experts_problem(module, run.scheme) if keep else None
        if keep and not misfit:
            run.experts.append(name)
        else:
            report.skipped[name] = misfit or tower or "excluded by module_filter"
            keep = False
        parent = name.rpartition(".")[0]
        router = f"{parent}.gate" if parent else "gate"
        if (
            keep
            and router not in report.skipped
            and isinstance(getattr(model.get_submodule(parent), "gate", None), nn.Module)
        ):
            report.skipped[router] = "MoE router (kept in high precision, as DeepSeek-V3 and llm-compressor do)"
    if not run.targets and not run.experts:
        why = "; ".join(f"{n}: {r}" for n, r in list(report.skipped.items())[:3])
        raise ValueError(
            "no nn.Linear (or Conv1D) layer to quantize"
            + (" (the module_filter matched none)" if opts.module_filter else " in this model")
            + (f" (skipped {why})" if why else "")
        )
    if opts.keep_bf16 and opts.keep_bf16 >= len(run.targets):
        raise ValueError(f"keep_bf16={opts.keep_bf16} would keep all {len(run.targets)} quantizable layers: give fewer")


def _choose_data(run: _Run) -> None:
    """Calibrate on ``forward_loop``, or reuse the trained delayed-scaling amax of a model trained in FP8
    (every layer, nothing else asking for data), or need no data at all."""
    scheme, opts = run.scheme, run.opts
    if not opts.needs_data(scheme):
        return
    trained = _trained_input_amax(run.model, run.targets) if scheme.name == "fp8" else {}
    if len(trained) == len(run.targets) and not (
        run.experts or opts.kv_cache or opts.gptq or opts.keep_bf16 or opts.norm_tweak
    ):
        run.amax = trained
        run.report.calibration = "trained delayed-scaling amax history"
        return
    if run.forward_loop is None:
        asked = (("gptq", opts.gptq), ("awq", opts.awq), ("keep_bf16", opts.keep_bf16), ("norm_tweak", opts.norm_tweak))
        what = next((k for k, v in asked if v), None)
        raise ValueError(
            f"{what + ' needs calibration data' if what else f'scheme {scheme.name!r} has static scales'}"
            f"{' (with fp8-kv)' if opts.kv_cache else ''}: pass "
            "forward_loop=lambda m: [m(x) for x in calibration_batches]"
        )
    run.calibrating = True
    run.report.calibration = opts.calibration


def _awq(run: _Run) -> None:
    from .awq import apply_awq

    mappings = find_mappings(run.model, set(run.targets))
    with run.progress.phase("AWQ", run.progress.batches, model=run.model, timed_pass=True):
        run.report.awq = apply_awq(run.model, mappings, run.forward_loop, run.scheme)


def _observe(run: _Run) -> None:
    search = run.opts.smooth_for(run.scheme) and run.opts.alpha == "search"
    with (
        run.progress.phase("calibrate", run.progress.batches, model=run.model, timed_pass=True),
        observe_experts(run.model, run.experts) as expert_observers,
    ):
        run.observers = observe_inputs(
            run.model, run.targets, run.forward_loop, keep_rows=ROWS_PER_BATCH if search else 0
        )
    run.expert_observers = expert_observers
    run.report.expert_tokens = {n: o.tokens.tolist() for n, o in expert_observers.items()}
    if run.scheme.static_activations:  # a layer the calibration never reaches has no static scale: kept high
        for name in [n for n in run.targets if run.observers[n].batches == 0]:
            run.targets.remove(name)
            del run.observers[name]
            run.report.skipped[name] = UNREACHED


def _smooth(run: _Run) -> None:
    model, opts, report = run.model, run.opts, run.report
    mappings = find_mappings(model, set(run.targets))
    factors: dict[str, torch.Tensor] = {}
    if opts.alpha == "search":
        rows = {m.targets[0]: run.observers[m.targets[0]].rows() for m in mappings}
        report.smooth_alpha = apply_smoothing_search(model, mappings, run.observers, rows, run.scheme, factors=factors)
    else:
        factors = apply_smoothing(model, mappings, run.observers, opts.alpha)
        report.smooth_alpha = dict.fromkeys((m.source for m in mappings), float(opts.alpha))
    report.smoothed = [src for src, a in report.smooth_alpha.items() if a is not None]
    report.smooth_folds = [(m, factors[m.source]) for m in mappings if m.source in factors]
    if mappings:  # the smoothed inputs have new ranges: observe again
        with run.progress.phase("re-calibrate", run.progress.batches, model=model):
            run.observers = observe_inputs(model, run.targets, run.forward_loop)


def _activation_scales(run: _Run) -> None:
    opts, fmt = run.opts, run.scheme.act_format
    for name in run.targets:
        run.amax[name] = choose_amax(run.observers[name], fmt, opts.calibration, opts.percentile)
    for name, obs in run.expert_observers.items():
        run.expert_amax[name] = obs.amax(fmt, opts.calibration, opts.percentile)


def _kv_scales(run: _Run) -> None:
    blocks = enable_fp8_kv(run.model, "observe")
    with run.progress.phase("KV cache", run.progress.batches, model=run.model, timed_pass=True), torch.no_grad():
        run.forward_loop(run.model)  # records the post-RoPE k/v amax
    finish_calibration(blocks, run.opts.calibration, run.opts.percentile)


def _hessians(run: _Run) -> None:
    from .experts import collect_expert_hessians
    from .gptq import collect_hessians

    with (
        run.progress.phase("GPTQ Hessians", run.progress.batches, model=run.model, timed_pass=True),
        collect_expert_hessians(run.model, run.experts) as experts,
    ):
        run.hessians = collect_hessians(run.model, run.targets, run.forward_loop)
    run.expert_hessians = {n: c.hessians() for n, c in experts.items()}
    run.report.gptq = True


def shared_weight_scales(model: nn.Module, scheme: Scheme, targets: list[str]) -> dict[str, torch.Tensor]:
    """NVFP4's per-tensor weight scale of the layers that read one input (q/k/v, gate/up): one per group, from
    the largest of their weights' amaxes. Serving engines fuse such layers into one GEMM with one per-tensor
    scale (vLLM takes the max of the shards', TensorRT-LLM the fused layer's), and ModelOpt's and llm-compressor's
    NVFP4 exports share it the same way. Empty for other schemes."""
    if scheme.weight_strategy != "nvfp4":
        return {}
    shared: dict[str, torch.Tensor] = {}
    for mapping in find_mappings(model, set(targets)):
        if len(mapping.targets) > 1:
            amax = max(float(model.get_submodule(t).weight.detach().abs().amax()) for t in mapping.targets)
            shared.update(dict.fromkeys(mapping.targets, nvfp4_tensor_scale(amax)))
    return shared


def _quantize_layers(run: _Run) -> None:
    from .gptq import gptq_linear

    shared = shared_weight_scales(run.model, run.scheme, run.targets)
    with run.progress.phase("GPTQ" if run.opts.gptq else "quantize", len(run.targets), unit="layer") as update:
        for name in run.targets:
            module, amax, scale = run.model.get_submodule(name), run.amax.get(name), shared.get(name)
            linear, scheme = as_linear(module), layer_scheme(run.scheme, module)
            if run.opts.gptq:
                hessian = run.hessians.pop(name)
                q = gptq_linear(linear, hessian, scheme, amax, weight_global_scale=scale)
            else:
                q = QuantLinear.from_linear(linear, scheme, amax, scale)
            q.checkpoint_transposed = is_conv1d(module)  # the export writes its weight back as (in, out)
            run.qmods[name] = q
            update(1)


def _rank_and_keep(run: _Run) -> None:
    from .layer_error import rank_by_fisher, rank_by_output_error

    keep, report = run.opts.keep_bf16, run.report
    with run.progress.phase("rank layers", run.progress.batches, model=run.model):
        # causal LMs: one pass with gradients; other models: one forward_loop per layer
        report.sensitivity = rank_by_fisher(run.model, run.qmods, run.forward_loop) or rank_by_output_error(
            run.model, run.qmods, run.forward_loop
        )
    for item in report.sensitivity[:keep]:
        report.skipped[item.name] = f"kept in high precision: among the {keep} most sensitive (keep_bf16)"
        del run.qmods[item.name]
        run.amax.pop(item.name, None)


def _install(run: _Run) -> None:
    for name, q in run.qmods.items():
        run.originals[name] = run.model.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        setattr(run.model.get_submodule(parent_name) if parent_name else run.model, attr, q)
        run.report.quantized.append(name)
    for name in run.experts:
        original = run.model.get_submodule(name)
        run.originals[name] = original
        hessians = run.expert_hessians.pop(name, None)  # GPTQ
        q = quantize_experts_module(original, run.scheme, run.expert_amax.get(name), name, copy=True, hessians=hessians)
        parent_name, _, attr = name.rpartition(".")
        setattr(run.model.get_submodule(parent_name) if parent_name else run.model, attr, q)
        run.report.experts.append(name)
    run.report.input_amax = dict(run.amax)
    for name, amaxes in run.expert_amax.items():  # the experts' shared static input amax per projection
        projections = run.model.get_submodule(name).projections
        run.report.input_amax.update({f"{name}.{p}": a for p, a in zip(projections, amaxes, strict=True)})


def _tweak_norms(run: _Run) -> None:
    from .norm_tweak import tweak_norms

    steps = run.opts.norm_tweak
    with run.progress.phase("norm tweak", steps, unit="step") as update:
        run.report.norm_tweak = tweak_norms(
            run.model,
            {n: run.originals[n] for n in [*run.qmods, *run.experts]},
            run.forward_loop,
            steps,
            run.opts.norm_tweak_lr,
            on_step=lambda: update(1),
        )


def _steps_per_pass(run: _Run) -> float:
    return run.opts.norm_tweak / run.progress.batches if run.progress.batches else 0.0


PIPELINE: tuple[_Step, ...] = (
    _Step(
        "awq",
        lambda r: r.calibrating and r.opts.awq,
        _awq,
        lambda r: "AWQ scale search (1 pass)",
        lambda r: 1.5,
    ),
    _Step(
        "calibrate",
        lambda r: r.calibrating and (r.scheme.static_activations or r.opts.smooth_for(r.scheme)),
        _observe,
        lambda r: f"calibrate {len(r.targets)} layer inputs (1 pass)",
        lambda r: 1.0,
    ),
    _Step(
        "smooth",
        lambda r: r.calibrating and r.opts.smooth_for(r.scheme),
        _smooth,
        lambda r: f"SmoothQuant (alpha {'searched' if r.opts.alpha == 'search' else r.opts.alpha}, 1 more pass)",
        lambda r: 1.0,
    ),
    _Step(
        "activation scales",
        lambda r: r.calibrating and r.scheme.static_activations,
        _activation_scales,
        lambda r: f"{r.opts.calibration} activation scales",
    ),
    _Step(
        "kv cache",
        lambda r: r.calibrating and r.opts.kv_cache,
        _kv_scales,
        lambda r: "FP8 KV-cache scales (1 pass)",
        lambda r: 1.0,
    ),
    _Step("gptq hessians", lambda r: r.opts.gptq, _hessians, lambda r: "GPTQ Hessians (1 pass)", lambda r: 1.0),
    _Step(
        "quantize layers",
        lambda r: True,
        _quantize_layers,
        lambda r: f"{'GPTQ' if r.opts.gptq else 'round'} {len(r.targets)} layers",
    ),
    _Step(
        "rank",
        lambda r: r.opts.keep_bf16 > 0,
        _rank_and_keep,
        lambda r: f"rank layers (1 pass with gradients), keep {r.opts.keep_bf16} in BF16",
        lambda r: 3.0,
    ),
    _Step("install", lambda r: True, _install, lambda r: "swap in"),
    _Step(
        "norm tweak",
        lambda r: r.opts.norm_tweak > 0,
        _tweak_norms,
        lambda r: f"norm tweak ({r.opts.norm_tweak} steps)",
        lambda r: 4 * _steps_per_pass(r) + 4,  # teacher + student + backward per step; loss before and after
    ),
)


def plan_line(run: _Run, steps: list[_Step]) -> str:
    """The one-line plan printed before a run: the scheme, layers, and every step that will run, in order."""
    data = "no calibration data" if not run.calibrating else "passes over forward_loop's batches"
    experts = f" and {len(run.experts)} MoE experts modules" if run.experts else ""
    return f"fp8kit.ptq {run.scheme.name} on {len(run.targets)} Linear layers{experts} ({data}): " + " -> ".join(
        s.plan(run) for s in steps
    )


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
    towers: bool = False,
    progress: bool | None = None,
    attention: str | None = None,
    _originals: dict[str, nn.Module] | None = None,
) -> nn.Module:
    """Quantize ``model``'s ``nn.Linear`` layers and MoE experts in place for inference and return it.

    ``transformers`` experts modules (3-D expert weights) become ``ptq.experts.QuantExperts`` with
    per-expert weight scales (FP4: each expert's own block scales and NVFP4 per-tensor scale); static
    calibration runs every token through every expert (the layer's output stays the routed one) and
    ``ptq_report.expert_tokens`` counts the tokens routed to each. GPTQ rounds the ``nn.Linear`` layers and
    the experts; AWQ applies to the ``nn.Linear`` layers only (the experts round to nearest). Routers stay
    in high precision.

    Args:
        scheme: ``"fp8"``, ``"fp8-dynamic"``, ``"int8-smoothquant"`` or ``"int8-weight-only"``; or FP4 weights
            (``"nvfp4-weight-only"``, ``"mxfp4-weight-only"``: round to nearest, GPTQ or AWQ; ``"nvfp4"``: W4A4,
            NVFP4 activations with a calibrated per-tensor scale; nn.Linear layers and MoE experts whose input
            dims are whole blocks).
        forward_loop: ``forward_loop(model)`` runs the model on calibration data (ModelOpt's
            convention); required by the static schemes (``fp8``, ``int8-smoothquant``, ``nvfp4``) and ``kv_cache``,
            except that a model trained with ``fp8kit.convert`` under delayed scaling exports to ``fp8``
            with its trained input amax (every layer's history) and needs none.
        calibration: ``"max"``, ``"percentile"`` or ``"mse"`` (static activation scales).
        percentile: for ``calibration="percentile"``.
        alpha: SmoothQuant migration strength in ``[0, 1]``, or ``"search"``: each group (norm -> q/k/v,
            norm -> gate/up, up -> down) gets the alpha on an 11-point grid, or no smoothing, with the
            smallest quantized output error on calibration tokens (``smoothquant.search_alpha``).
        smooth: fold SmoothQuant factors before quantizing; ``None``: the scheme's own choice (only
            ``int8-smoothquant``). The folds keep the model's function, so any scheme that quantizes
            activations may use them (W8A8 and ``nvfp4``; static ``fp8`` and ``nvfp4`` lose less with them
            on SmolLM2, BENCHMARKS.md); ``ptq_report.smooth_folds`` lists them.
        kv_cache: FP8 KV cache with per-tensor static k/v scales (FP8 schemes, Llama-style attention).
        module_filter: ``(name, module) -> bool`` chooses layers (replaces the default, which keeps the
            output head and a multimodal model's towers in high precision).
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
        towers: quantize a multimodal model's vision/audio towers and projectors too (``nn.towers``: the modules
            outside its language model); by default they stay in high precision, listed in the report, and the
            exports name them in ``ignore`` / ``exclude_modules``.
        progress: print the plan (every step that will run), an estimate per step once the first pass
            over the calibration data is timed, and a bar per step on stderr; ``None``: when stderr is a
            terminal.
        attention: FP8 attention after the layers are quantized (``nn.attention``; ``transformers`` models):
            ``"fp8"`` / ``"delayed"`` (static scales calibrated on ``forward_loop``; ``"delayed-head"`` per head)
            or ``"current"`` (each call's own scales). Not with ``kv_cache`` (FP8 attention quantizes K and V
            itself; ``ptq.kv_cache.fp8_attention_to_kv_scales`` turns its scales into the KV cache's for export).

    The steps run in the order of ``PIPELINE``: AWQ -> calibrate -> SmoothQuant -> activation scales ->
    KV-cache scales -> GPTQ Hessians -> quantize the layers -> rank and keep the most sensitive in high
    precision -> swap in -> norm tweaking, each only when its option asks for it. The report is stored
    as ``model.ptq_report``.
    """
    scheme = get_scheme(scheme)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize() takes an nn.Module, got {type(model).__name__}")
    opts = PTQOptions(
        calibration,
        percentile,
        alpha,
        smooth,
        kv_cache,
        module_filter,
        gptq,
        awq,
        keep_bf16,
        norm_tweak,
        norm_tweak_lr,
        towers,
    )
    opts.check(scheme)
    bars = Progress(progress, getattr(forward_loop, "batches", None))  # the calibration loop's batches, if it says
    attn = _attention_recipe(attention, forward_loop, kv_cache) if attention is not None else None
    run = _Run(model, scheme, forward_loop, opts, PTQReport(scheme.name, kv_cache=kv_cache), bars)
    if _originals is not None:
        run.originals = _originals
    _select_layers(run)
    _choose_data(run)
    steps = [s for s in PIPELINE if s.runs(run)]
    run.progress.say(plan_line(run, steps))
    was_training = model.training
    model.eval()
    try:
        estimated = False
        for i, step in enumerate(steps):
            step.apply(run)
            if not estimated and run.progress.pass_s is not None:
                estimated = True
                run.progress.estimate({s.name: s.passes(run) for s in steps[i + 1 :] if s.passes(run)})
    finally:
        model.train(was_training)
    object.__setattr__(model, "ptq_report", run.report)
    if attn is not None:
        _fp8_attention(model, attn, forward_loop)
    return model


def _attention_recipe(attention: str, forward_loop: Callable | None, kv_cache: bool) -> AttentionRecipe:
    """The ``AttentionRecipe`` of ``quantize(attention=...)``, checked against the other options."""
    recipe = attention_recipe(attention)
    if kv_cache:
        raise ValueError(
            "quantize(attention=...) quantizes K and V itself: drop kv_cache=True (for an exported FP8 KV cache, "
            "call fp8kit.ptq.kv_cache.fp8_attention_to_kv_scales(model) after quantize)"
        )
    if recipe.scaling == "delayed" and forward_loop is None:
        raise ValueError(f"quantize(attention={attention!r}) calibrates static scales: pass forward_loop")
    return recipe


def _fp8_attention(model: nn.Module, recipe: AttentionRecipe, forward_loop: Callable | None) -> None:
    """FP8 attention on the quantized model, its static scales calibrated on ``forward_loop``."""
    enable_fp8_attention(model, recipe)
    if recipe.scaling == "delayed":
        calibrate_fp8_attention(model, forward_loop)
