"""``ptq.quantize`` as a pipeline of named steps: the same codes and scales as the library functions
composed by hand, the plan line names every step that runs, and the run is quiet unless asked."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fp8kit import ptq
from fp8kit.ptq.calibrate import choose_amax, observe_inputs
from fp8kit.ptq.gptq import collect_hessians, gptq_linear
from fp8kit.ptq.layer_error import rank_by_fisher
from fp8kit.ptq.quantize import PIPELINE
from fp8kit.ptq.smoothquant import apply_smoothing, find_mappings
from tests.helpers.models import calib, tiny_llama

pytest.importorskip("transformers")

BATCHES = [torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]
LINEARS = [
    f"model.layers.{i}.{p}"
    for i in range(2)
    for p in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


def by_hand(model: nn.Module, scheme: str, loop, alpha: float, keep: int) -> dict[str, ptq.QuantLinear]:
    """The steps of ``quantize`` written out with the library functions (AWQ, calibration, SmoothQuant,
    scales, GPTQ, Fisher ranking), returning the quantized modules that stay quantized."""
    sch = ptq.get_scheme(scheme)
    if sch.act_format is None:
        ptq.apply_awq(model, find_mappings(model, set(LINEARS)), loop, sch)
    amax: dict[str, float] = {}
    if sch.static_activations:
        obs = observe_inputs(model, LINEARS, loop)
        if sch.smooth:
            apply_smoothing(model, find_mappings(model, set(LINEARS)), obs, alpha)
            obs = observe_inputs(model, LINEARS, loop)
        amax = {n: choose_amax(obs[n], sch.act_format, "max") for n in LINEARS}
    hessians = collect_hessians(model, LINEARS, loop)
    qmods = {n: gptq_linear(model.get_submodule(n), hessians[n], sch, amax.get(n)) for n in LINEARS}
    for item in rank_by_fisher(model, qmods, loop)[:keep]:
        del qmods[item.name]
    return qmods


@pytest.mark.parametrize("scheme", ["fp8", "fp8-dynamic", "int8-smoothquant", "int8-weight-only"])
def test_pipeline_matches_the_steps_composed_by_hand(scheme):
    loop = calib(BATCHES)
    model = tiny_llama()
    ref_model = copy.deepcopy(model)
    awq = ptq.get_scheme(scheme).act_format is None
    ptq.quantize(model, scheme, loop, calibration="max", alpha=0.7, gptq=True, awq=awq, keep_bf16=3)
    expected = by_hand(ref_model, scheme, loop, alpha=0.7, keep=3)
    assert sorted(model.ptq_report.quantized) == sorted(expected) and len(expected) == len(LINEARS) - 3
    for name, q in expected.items():
        got = model.get_submodule(name)
        assert isinstance(got, ptq.QuantLinear)
        assert torch.equal(got.weight, q.weight), name  # the 8-bit codes, bit for bit
        assert torch.equal(got.weight_scale, q.weight_scale), name
        if q.input_scale is not None:
            assert torch.equal(got.input_scale, q.input_scale), name
    for name in set(LINEARS) - set(expected):  # the kept layers: high precision, folded like the reference
        assert type(model.get_submodule(name)) is nn.Linear
        assert torch.equal(model.get_submodule(name).weight, ref_model.get_submodule(name).weight), name


def plan_of(capsys, scheme: str, **kw) -> str:
    ptq.quantize(tiny_llama(), scheme, calib(BATCHES), progress=True, **kw)
    return capsys.readouterr().err.splitlines()[0]


@pytest.mark.parametrize(
    ("scheme", "kw", "steps"),
    [
        (
            "fp8",
            {"gptq": True, "keep_bf16": 2, "norm_tweak": 2, "kv_cache": True},
            [
                "calibrate",
                "activation scales",
                "KV-cache",
                "GPTQ Hessians",
                "GPTQ 14 layers",
                "keep 2 in BF16",
                "swap in",
                "norm tweak (2 steps)",
            ],
        ),
        ("int8-smoothquant", {"alpha": "search"}, ["calibrate", "SmoothQuant (alpha searched", "round 14 layers"]),
        ("int8-weight-only", {"awq": True, "gptq": True}, ["AWQ", "GPTQ Hessians", "GPTQ 14 layers"]),
        ("fp8-dynamic", {}, ["round 14 layers", "swap in"]),
    ],
)
def test_plan_line_names_every_step_that_runs(capsys, scheme, kw, steps):
    line = plan_of(capsys, scheme, **kw)
    assert line.startswith(f"fp8kit.ptq {scheme} on 14 Linear layers")
    positions = [line.index(s) for s in steps]  # each named, in pipeline order
    assert positions == sorted(positions), line
    assert line.count(" -> ") + 1 == sum(s.runs(_probe(scheme, kw)) for s in PIPELINE)


def _probe(scheme: str, kw: dict):
    """The ``_Run`` that ``quantize`` would build (to count the steps that run)."""
    from fp8kit.ptq.progress import Progress
    from fp8kit.ptq.quantize import PTQOptions, PTQReport, _choose_data, _Run, _select_layers

    sch = ptq.get_scheme(scheme)
    run = _Run(tiny_llama(), sch, calib(BATCHES), PTQOptions(**kw), PTQReport(scheme), Progress(False))
    _select_layers(run)
    _choose_data(run)
    return run


def test_estimate_follows_the_first_timed_pass(capsys):
    ptq.quantize(tiny_llama(), "fp8", calib(BATCHES), gptq=True, norm_tweak=3, progress=True)
    err = capsys.readouterr().err
    estimate = next(line for line in err.splitlines() if "one pass over the calibration data" in line)
    assert f"{len(BATCHES)} batches" in estimate
    assert "gptq hessians ~" in estimate and "norm tweak ~" in estimate


def test_quiet_unless_asked(capsys):
    """Under pytest stderr is not a terminal: ``progress=None`` prints nothing, as the training loop."""
    ptq.quantize(tiny_llama(), "fp8", calib(BATCHES), gptq=True, norm_tweak=2)
    assert capsys.readouterr().err == ""


def test_every_layer_in_fp8_beside_the_default():
    """``--keep-bf16 0`` quantizes every Linear but the head, as ModelOpt and llm-compressor
    do, while the default keeps its share of layers in BF16; the settings line says which."""
    from fp8kit.jobs.quantize import ptq_settings, settings_text

    every = ptq_settings("fp8", keep_bf16=0, norm_tweak=0, n_layers=len(LINEARS))
    default = ptq_settings("fp8", n_layers=len(LINEARS), norm_tweak=2)
    assert every["keep_bf16"] == 0 and default["keep_bf16"] >= 1
    m = ptq.quantize(tiny_llama(), "fp8", calib(BATCHES), **every)
    assert sorted(m.ptq_report.quantized) == sorted(LINEARS) and m.ptq_report.norm_tweak is None
    assert "BF16" not in settings_text(every)
    m = ptq.quantize(tiny_llama(), "fp8", calib(BATCHES), **default)
    kept = [n for n, why in m.ptq_report.skipped.items() if "keep_bf16" in why]
    assert len(kept) == default["keep_bf16"] and len(m.ptq_report.quantized) == len(LINEARS) - len(kept)
    assert f"{default['keep_bf16']} most sensitive layers kept in BF16" in settings_text(default)
