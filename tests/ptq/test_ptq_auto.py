"""``quantize(model, "auto", budget=BITS)``: the plan fits the bits budget (ModelOpt's counting), predicts no
more loss than any uniform scheme it could have chosen, gives a layer made sensitive more bits, installs
each layer's scheme, and ``fp8kit quantize --scheme auto`` writes a one-scheme plan and a mix."""

from __future__ import annotations

import json

import pytest
import torch

from fp8kit import ptq
from fp8kit.cli import main
from fp8kit.export import load_pretrained
from fp8kit.jobs import quantize_checkpoint
from fp8kit.planner.bits import EFFECTIVE_BITS, plan_bits
from tests.helpers.models import calib, save_sample_llama, tiny_llama, token_batches

pytest.importorskip("transformers")

BATCHES = token_batches(256, 3, (2, 16))
# ModelOpt 0.47 estimate_quant_compression: E4M3 / INT8 8, NVFP4 4.5 (its effective_bits override), MXFP4 4
MODELOPT_BITS = {"fp8": 8, "int8-weight-only": 8, "nvfp4-weight-only": 4.5, "mxfp4-weight-only": 4, "bf16": 16}


def auto(model, budget, **kw):
    return ptq.quantize(model, "auto", calib(BATCHES), budget=budget, **kw).ptq_report


@pytest.fixture(scope="module")
def plans():
    return {b: auto(tiny_llama(), b) for b in (4.5, 6, 8)}


def test_effective_bits_are_counted_as_modelopt_counts_them():
    assert {k: EFFECTIVE_BITS[k] for k in MODELOPT_BITS} == MODELOPT_BITS


@pytest.mark.parametrize("budget", [4.5, 6, 8])
def test_the_plan_meets_the_budget_and_beats_every_uniform_scheme_within_it(plans, budget):
    plan = plans[budget].plan
    weights = {n: tiny_llama().get_submodule(n).weight.numel() for n in plan.per_layer}
    bits = sum(EFFECTIVE_BITS[c] * weights[n] for n, c in plan.per_layer.items()) / sum(weights.values())
    assert bits <= budget + 1e-9 and plan.bits == pytest.approx(bits)
    fits = {c: u for c, u in plan.uniform.items() if u["bits"] <= budget and c != "bf16"}
    assert fits  # nvfp4 schemes at 4.5 bits, the 8-bit ones at 8
    assert all(plan.total_loss_increase <= u["loss_increase"] for u in fits.values())
    if budget == 6:  # no uniform scheme sits at 6 bits: the mix is strictly better than every 4-bit one
        assert plan.total_loss_increase < min(u["loss_increase"] for u in fits.values())
        assert len(plan.counts()) > 1


def test_each_layer_gets_its_planned_scheme(plans):
    report = plans[6]
    model = tiny_llama()
    ptq.quantize(model, "auto", calib(BATCHES), budget=6)
    assert model.ptq_report.schemes == report.schemes  # deterministic
    for name, choice in report.plan.per_layer.items():
        layer = model.get_submodule(name)
        if choice == "bf16":
            assert type(layer) is torch.nn.Linear and name in report.skipped
        else:
            assert isinstance(layer, ptq.QuantLinear) and layer.scheme.name == choice == report.schemes[name]


def test_layers_that_read_one_input_take_one_scheme(plans):
    """q/k/v and gate/up: vLLM fuses each into one GEMM (one scheme), ModelOpt's export requires it."""
    for report in plans.values():
        for block in range(2):
            for group in (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj")):
                names = [f"model.layers.{block}.{group[0]}.{p}" for p in group[1:]]
                assert len({report.plan.per_layer[n] for n in names}) == 1, names


def test_plan_bits_plans_a_group_as_one():
    predicted = {"a": {"nvfp4": 1.0, "fp8": 0.1}, "b": {"nvfp4": 0.0, "fp8": 0.0}, "c": {"nvfp4": 0.5, "fp8": 0.2}}
    params = {"a": 10, "b": 10, "c": 10}
    alone = plan_bits(predicted, params, 6.5)  # bits for one 8-bit layer: a, the most sensitive
    assert alone.per_layer == {"a": "fp8", "b": "nvfp4", "c": "nvfp4"}
    tied = plan_bits(predicted, params, 6.5, groups=[["a", "b"]])  # a and b only together: 8-bit c instead
    assert tied.per_layer == {"a": "nvfp4", "b": "nvfp4", "c": "fp8"}
    assert tied.loss_increase == {"a": 1.0, "b": 0.0, "c": 0.2}
    assert plan_bits(predicted, params, 8, groups=[["a", "b"]]).per_layer == dict.fromkeys("abc", "fp8")


def test_the_plan_prints_and_saves(plans, tmp_path):
    report = plans[6]
    text = str(report)
    assert "auto plan: 6.00 effective bits" in text or "auto plan: 5." in text
    assert all(f"{n}: {c}" in text for n, c in report.schemes.items())
    table = str(report.plan)
    assert all(n in table for n in report.plan.per_layer)
    saved = json.loads(report.plan.to_json(tmp_path / "plan.json"))
    assert saved["per_layer"] == report.plan.per_layer and saved["budget"] == 6
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def _make_sensitive(model, block: int, channel: int, factor: float) -> None:
    """Scale ``up_proj``'s output ``channel`` by ``factor`` and ``down_proj``'s input column by its inverse: the
    function is unchanged, ``down_proj`` sees one input channel far outside the others' range."""
    mlp = model.model.layers[block].mlp
    with torch.no_grad():
        mlp.up_proj.weight[channel] *= factor
        mlp.down_proj.weight[:, channel] /= factor


def test_a_layer_made_sensitive_gets_more_bits():
    name = "model.layers.1.mlp.down_proj"
    before = auto(tiny_llama(), 6).plan
    model = tiny_llama()
    x = BATCHES[0]
    ref = model(x).logits
    _make_sensitive(model, 1, 5, 300.0)
    torch.testing.assert_close(model(x).logits, ref, rtol=1e-4, atol=1e-4)  # the same function
    after = auto(model, 6).plan
    assert EFFECTIVE_BITS[after.per_layer[name]] > EFFECTIVE_BITS[before.per_layer[name]]
    # the shrunk weight column falls under INT8's per-row step: its input channel is lost
    assert after.predicted[name]["int8-weight-only"] > 10 * before.predicted[name]["int8-weight-only"]


def test_plan_bits_refuses_a_budget_below_the_candidates():
    with pytest.raises(ValueError, match="fewest these candidates allow is 4.50"):
        plan_bits({"a": {"nvfp4": 1.0}}, {"a": 10}, 4)
    with pytest.raises(ValueError, match=r"in \(0, 16\]"):
        plan_bits({"a": {"nvfp4": 1.0}}, {"a": 10}, 17)


def test_auto_refuses_what_it_cannot_plan(tmp_path):
    model, loop = tiny_llama(), calib(BATCHES)
    with pytest.raises(ValueError, match="budget=BITS"):
        ptq.quantize(model, "auto", loop)
    with pytest.raises(ValueError, match="drop keep_bf16"):
        ptq.quantize(model, "auto", loop, budget=6, keep_bf16=2)
    with pytest.raises(ValueError, match="int8-smoothquant's folds"):
        ptq.quantize(model, "auto", loop, budget=6, candidates=["fp8", "int8-smoothquant"])
    with pytest.raises(ValueError, match="go with scheme='auto'"):
        ptq.quantize(model, "fp8", loop, budget=6)
    with pytest.raises(ValueError, match="whole model"):
        quantize_checkpoint(str(tmp_path), "auto", tmp_path / "q", loop, budget=6)
    with pytest.raises(TypeError, match="fp8kit.jobs.quantize_checkpoint"):
        ptq.quantize(str(tmp_path), "auto", loop, budget=6)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    return save_sample_llama(tmp_path_factory.mktemp("hf"))


def test_cli_writes_a_one_scheme_plan_and_a_mix(local_model, tmp_path, capsys):
    model, text = str(local_model / "model"), str(local_model / "text.txt")
    base = ["quantize", "--model", model, "--scheme", "auto", "--text", text, "--calib-batches", "2", "--no-gptq"]
    out = tmp_path / "one"
    args = [*base, "--budget", "6", "--candidates", "bf16,nvfp4-weight-only", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "auto plan:" in printed and "nvfp4-weight-only" in printed
    loaded = load_pretrained(out)
    kinds = {type(m).__name__ for n, m in loaded.named_modules() if n.endswith("_proj")}
    assert "QuantLinear" in kinds and "Linear" in kinds  # nvfp4 layers and BF16 layers
    mix = tmp_path / "mix"
    assert main([*base, "--budget", "6", "--out", str(mix)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    loaded = load_pretrained(mix)
    schemes = loaded.ptq_report.schemes
    assert loaded.ptq_report.scheme == "auto" and len(set(schemes.values())) > 1
    counts = {s: list(schemes.values()).count(s) for s in set(schemes.values())}
    assert all(f"{s} {k}" in last for s, k in counts.items()) and str(mix) in last, last
    qc = json.loads((mix / "config.json").read_text())["quantization_config"]
    assert len(qc["config_groups"]) == len(counts)
    block = [*base, "--budget", "6", "--format", "fp8-block", "--out", str(tmp_path / "block")]
    assert main(block) == 2
    assert "fp8-block format carries the fp8-block scheme only" in capsys.readouterr().err
    assert main(["quantize", "--model", model, "--scheme", "fp8", "--budget", "6", "--out", str(tmp_path / "x")]) == 2
